package main

import (
	"fmt"
	"os"

	"github.com/spf13/cobra"

	"github.com/shunt-project/shunt/agent"
	"github.com/shunt-project/shunt/host"
)

func newAgentCmd(e *env, g *globals) *cobra.Command {
	var configPath string
	var check bool
	c := &cobra.Command{
		Use:   "agent [--config FILE] [--check]",
		Short: "Keep this machine's bypass as a configuration file declares it",
		Long: `agent is shunt's node agent. It enables bypass for the cgroups its
configuration names (paths or patterns, or this node's Kubernetes pods
selected by namespace, labels or annotation) and disables it for the others,
enables the socket index if asked, runs the guard, and serves metrics; then
it keeps the machine so: a cgroup that appears and matches is enabled as
soon as inotify reports it, and the configuration is read again on SIGHUP
or when its file changes (a bad one is reported and the previous one kept).

State stays pinned: stopping the agent leaves bypass as it is; removal is
explicit ('shunt bypass disable --all'). The agent owns the set of enabled
cgroups: one enabled by hand that the configuration does not name is
disabled. docs/AGENT.md describes the file, docs/KUBERNETES.md the DaemonSet.`,
		Example: `  shunt agent --config /etc/shunt/config.yaml
  shunt agent --config ./shunt.yaml --check      # only check the file`,
		Args: noArgs,
		RunE: func(c *cobra.Command, _ []string) error {
			if check {
				root, err := host.Cgroup2Root()
				if err != nil {
					return err
				}
				if _, err := agent.CheckConfig(configPath, agent.ConfigEnv{CgroupRoot: root, NodeName: os.Getenv("NODE_NAME")}); err != nil {
					return usageError{err}
				}
				fmt.Fprintf(e.stdout, "%s: ok\n", configPath)
				return nil
			}
			if err := host.CheckPrivileges(); err != nil {
				return err
			}
			a, err := agent.New(agent.Options{ConfigPath: configPath, NodeName: os.Getenv("NODE_NAME"), PinDir: g.pinDir, IndexDir: g.indexDir,
				PolicyDir: g.policyDir, Version: version, Features: e.probe(), Log: e.stderr})
			if err != nil {
				return usageError{err}
			}
			return a.Run(c.Context())
		},
	}
	c.Flags().StringVar(&configPath, "config", "/etc/shunt/config.yaml", "the agent's configuration file (docs/AGENT.md)")
	c.Flags().BoolVar(&check, "check", false, "check the configuration file and exit")
	return c
}
