package main

import (
	"context"
	"errors"
	"fmt"
	"io"
	"os"
	"os/exec"
	"os/signal"
	"strings"
	"syscall"

	"github.com/spf13/cobra"

	"github.com/shunt-project/shunt/bypass"
	"github.com/shunt-project/shunt/host"
	"github.com/shunt-project/shunt/policy"
	"github.com/shunt-project/shunt/sockindex"
)

// env is what a command needs from the outside world; tests replace parts.
type env struct {
	stdout, stderr io.Writer
	probe          func() host.Features
	shunt          func(args ...string) *exec.Cmd // this binary, for processes it starts
}

func defaultEnv() *env {
	return &env{stdout: os.Stdout, stderr: os.Stderr, probe: host.Probe, shunt: selfCommand}
}

// usageError marks mistakes in how shunt was called.
type usageError struct{ error }

// run executes one shunt command line and returns its exit code: 0 success,
// 1 failure, 2 bad usage.
func run(args []string, e *env) int {
	ctx, stop := signal.NotifyContext(context.Background(), os.Interrupt, syscall.SIGTERM)
	defer stop()
	root := newRoot(e)
	root.SetArgs(args)
	root.SetOut(e.stdout)
	root.SetErr(e.stderr)
	return finish(root.ExecuteContext(ctx), e)
}

// finish prints a command's error and returns its exit code.
func finish(err error, e *env) int {
	if err == nil {
		return 0
	}
	if errors.Is(err, context.Canceled) {
		fmt.Fprintln(e.stderr, "shunt: interrupted; what this command had made is removed")
		return 130
	}
	// Only typed usage errors exit 2; an error is printed whole, so a
	// message that spans lines shows (and fails the one-line tests).
	var ue usageError
	code := 1
	if errors.As(err, &ue) {
		code = 2
	}
	fmt.Fprintf(e.stderr, "shunt: %s\n", err)
	return code
}

type globals struct {
	pinDir    string
	indexDir  string
	policyDir string
}

func newRoot(e *env) *cobra.Command {
	g := &globals{}
	root := &cobra.Command{
		Use:   "shunt",
		Short: "In-kernel socket redirection you can leave on",
		Long: `shunt moves bytes between sockets inside the kernel (SOCKMAP).

  shunt bypass enable     host-local TCP between enabled cgroups skips the TCP/IP stack
  shunt status            what is installed
  shunt metrics           serve the counters to Prometheus
  shunt agent             keep bypass as a configuration file declares it
  shunt flows             the connections bypassed now
  shunt index enable      index connected sockets by backend
  shunt policy            who a cgroup may reach and be reached by, whichever path the bytes take
  shunt reap              destroy every socket connected to a backend
  shunt fanout            relay a UDP feed to many TCP subscribers
  shunt proxy             a TCP proxy whose connections are joined in the kernel
  shunt splice            join two sockets of a running process in the kernel
  shunt daemon            join sockets that other processes hand over`,
		SilenceErrors: true,
		SilenceUsage:  true,
	}
	defPin := os.Getenv("SHUNT_PIN_DIR")
	if defPin == "" {
		defPin = bypass.DefaultPinDir
	}
	root.PersistentFlags().StringVar(&g.pinDir, "pin-dir", defPin, "bpffs directory holding shunt's pinned state (env SHUNT_PIN_DIR)")
	defIndex := os.Getenv("SHUNT_INDEX_DIR")
	if defIndex == "" {
		defIndex = sockindex.DefaultPinDir
	}
	root.PersistentFlags().StringVar(&g.indexDir, "index-dir", defIndex, "bpffs directory holding the socket index (env SHUNT_INDEX_DIR)")
	defPolicy := os.Getenv("SHUNT_POLICY_DIR")
	if defPolicy == "" {
		defPolicy = policy.DefaultPinDir
	}
	root.PersistentFlags().StringVar(&g.policyDir, "policy-dir", defPolicy, "bpffs directory holding the policy (env SHUNT_POLICY_DIR)")
	root.SetFlagErrorFunc(func(c *cobra.Command, err error) error {
		return usageError{fmt.Errorf("%v (see '%s --help')", err, c.CommandPath())}
	})
	// With Args set (and a RunE, or cobra would print help before asking
	// it), unknown subcommands are its to report, typed.
	root.RunE = func(c *cobra.Command, _ []string) error { return c.Help() }
	root.Args = func(c *cobra.Command, args []string) error {
		if len(args) > 0 {
			return usageError{fmt.Errorf("unknown command %q for %q (see '%s --help')", args[0], c.CommandPath(), c.CommandPath())}
		}
		return nil
	}
	root.AddCommand(newBypassCmd(e, g), newStatusCmd(e, g), newMetricsCmd(e, g), newAgentCmd(e, g), newFlowsCmd(e, g), newIndexCmd(e, g), newPolicyCmd(e, g), newReapCmd(e, g), newFanoutCmd(e), newProxyCmd(e, g), newSpliceCmd(e), newDaemonCmd(e), newDemoCmd(e), newBenchCmd(e), newVersionCmd(e))
	refuseUnknownShells(root)
	return root
}

// requireArgs rejects positional arguments with a usage error.
func noArgs(c *cobra.Command, args []string) error {
	if len(args) > 0 {
		return usageError{fmt.Errorf("%s takes no arguments, got %q (see '%s --help')", c.CommandPath(), args[0], c.CommandPath())}
	}
	return nil
}

// refuseUnknownShells makes `completion SHELL` for a shell cobra has no
// script for a usage error: cobra's own command prints its help and exits 0.
func refuseUnknownShells(root *cobra.Command) {
	root.InitDefaultCompletionCmd()
	for _, c := range root.Commands() {
		if c.Name() != "completion" {
			continue
		}
		var shells []string
		for _, s := range c.Commands() {
			shells = append(shells, s.Name())
		}
		c.Args = cobra.ArbitraryArgs
		c.RunE = func(c *cobra.Command, args []string) error {
			if len(args) > 0 {
				return usageError{fmt.Errorf("completion: %q is not a shell shunt writes a script for: %s", args[0], strings.Join(shells, ", "))}
			}
			return c.Help()
		}
	}
}

// cgroupArg resolves a cgroup given on the command line: one that does not
// exist or is not of cgroup v2 is a usage error (exit 2), as in policy.
func cgroupArg(path string) (host.Cgroup, error) {
	cg, err := host.ResolveCgroup(path)
	var pe host.CgroupPathError
	if errors.As(err, &pe) {
		return cg, usageError{err}
	}
	return cg, err
}
