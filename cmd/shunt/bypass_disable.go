package main

import (
	"context"
	"errors"
	"fmt"
	"time"

	"github.com/spf13/cobra"

	"github.com/shunt-project/shunt/bypass"
	"github.com/shunt-project/shunt/host"
)

func newBypassDisableCmd(e *env, g *globals) *cobra.Command {
	var (
		cgroupPath string
		all        bool
		timeout    time.Duration
	)
	c := &cobra.Command{
		Use:   "disable [--cgroup PATH | --all]",
		Short: "Stop bypassing new connections of a cgroup, or remove shunt",
		Long: `disable detaches shunt from a cgroup: its new connections take the normal
TCP path; connections already bypassed keep working.

With --all (or when the last enabled cgroup is disabled) shunt is removed:
every send switches to the TCP path, shunt waits until each bypassed socket's
reader has consumed what was redirected to it (so no byte is lost), and then
nothing of shunt stays pinned or attached. If readers do not catch up within
--timeout, shunt stays installed without any cgroup and says so.`,
		Args: noArgs,
		RunE: func(c *cobra.Command, _ []string) error {
			if all && c.Flags().Changed("cgroup") {
				return usageError{errors.New("give either --cgroup or --all, not both")}
			}
			return bypassDisable(c.Context(), e, g, cgroupPath, all, timeout)
		},
	}
	c.Flags().StringVar(&cgroupPath, "cgroup", "", "cgroup v2 directory to disable (default: the root of the cgroup v2 hierarchy)")
	c.Flags().BoolVar(&all, "all", false, "disable every cgroup and remove shunt from the host")
	c.Flags().DurationVar(&timeout, "timeout", 10*time.Second, "how long to wait for readers to consume redirected bytes when removing")
	return c
}

func bypassDisable(ctx context.Context, e *env, g *globals, cgroupPath string, all bool, timeout time.Duration) error {
	if err := host.CheckPrivileges(); err != nil {
		return err
	}
	var cg host.Cgroup
	if !all {
		var err error
		if cg, err = host.ResolveCgroup(cgroupPath); err != nil {
			return err
		}
	}
	in, err := bypass.Open(g.pinDir)
	if errors.Is(err, bypass.ErrNotInstalled) {
		fmt.Fprintln(e.stdout, "bypass is not enabled; nothing to do")
		return nil
	}
	if err != nil {
		return err
	}
	defer in.Close()

	if !all {
		removed, err := in.Detach(cg.ID)
		if err != nil {
			return err
		}
		if !removed {
			fmt.Fprintf(e.stdout, "bypass was not enabled for cgroup %s; nothing to do\n", cg.Path)
			return nil
		}
		fmt.Fprintf(e.stdout, "bypass disabled for cgroup %s\n", cg.Path)
		if left, err := in.Cgroups(); err != nil || len(left) > 0 {
			return err
		}
	}
	rctx, cancel := context.WithTimeout(ctx, timeout)
	defer cancel()
	if err := in.Remove(rctx); err != nil {
		var busy bypass.ErrBusy
		if errors.As(err, &busy) {
			return err
		}
		return fmt.Errorf("remove shunt: %w", err)
	}
	fmt.Fprintf(e.stdout, "shunt removed: nothing is pinned at %s or attached\n", g.pinDir)
	return nil
}
