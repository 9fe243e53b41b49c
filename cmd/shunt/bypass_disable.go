package main

import (
	"context"
	"errors"
	"fmt"
	"os"
	"os/user"
	"strconv"
	"strings"
	"time"

	"golang.org/x/sys/unix"

	"github.com/spf13/cobra"

	"github.com/shunt-project/shunt/bypass"
	"github.com/shunt-project/shunt/host"
	"github.com/shunt-project/shunt/internal/runlock"
)

func newBypassDisableCmd(e *env, g *globals) *cobra.Command {
	var (
		cgroupPath string
		wholeHost  bool
		all        bool
		timeout    time.Duration
		force      bool
	)
	c := &cobra.Command{
		Use:   "disable --cgroup PATH | --host | --all",
		Short: "Stop bypassing new connections of a cgroup, or remove shunt",
		Long: `disable detaches shunt from a cgroup: its new connections take the normal
TCP path; connections already bypassed keep working.

With --all (or when the last enabled cgroup is disabled) shunt is removed:
every send switches to the TCP path, shunt waits until each bypassed socket's
reader has consumed what was redirected to it (so no byte is lost), and then
nothing of shunt stays pinned or attached. If readers do not catch up within
--timeout, shunt stays installed without any cgroup and says so; with
--force it resets those connections instead (each named: its application
sees the connection fail, not a stream with bytes missing) and removes
shunt, also on a kernel that refuses the drain's look into the sockets
(then every connection still bypassed is reset). It names
each cgroup it detaches and its owner, and the settings that go with the
install (--exclude-ports); what shunt learned about splice readers stays.`,
		Args: noArgs,
		RunE: func(c *cobra.Command, _ []string) error {
			given := 0
			for _, b := range []bool{cgroupPath != "", wholeHost, all} {
				if b {
					given++
				}
			}
			if given != 1 {
				return usageError{fmt.Errorf("give either --cgroup PATH, --host (the cgroup v2 root) or --all (see '%s --help')", c.CommandPath())}
			}
			if timeout < 0 {
				return usageError{fmt.Errorf("--timeout %v: give how long to wait, 0 or more", timeout)}
			}
			return bypassDisable(c.Context(), e, g, cgroupPath, all, timeout, force)
		},
	}
	c.Flags().StringVar(&cgroupPath, "cgroup", "", "cgroup v2 directory to disable")
	c.Flags().BoolVar(&wholeHost, "host", false, "disable the root of the cgroup v2 hierarchy (what enable --host enabled)")
	c.Flags().BoolVar(&all, "all", false, "disable every cgroup and remove shunt from the host")
	c.Flags().DurationVar(&timeout, "timeout", 10*time.Second, "how long to wait for readers to consume redirected bytes when removing")
	c.Flags().BoolVar(&force, "force", false, "when removing, reset the connections whose readers have not caught up by --timeout instead of leaving shunt installed")
	return c
}

func bypassDisable(ctx context.Context, e *env, g *globals, cgroupPath string, all bool, timeout time.Duration, force bool) error {
	if err := host.CheckPrivileges(); err != nil {
		return err
	}
	var cg host.Cgroup
	if !all {
		var err error
		if cg, err = cgroupArg(cgroupPath); err != nil {
			return err
		}
	}
	release, err := lockInstall(e, g.pinDir)
	if err != nil {
		return err
	}
	defer release()
	in, err := bypass.Open(g.pinDir)
	if errors.Is(err, bypass.ErrNotInstalled) {
		fmt.Fprintln(e.stdout, "bypass is not enabled; nothing to do")
		// Lock files an older shunt (or this command) left behind.
		if err := runlock.RemoveIfFree("guard", g.pinDir); err != nil {
			return err
		}
		return runlock.Remove("install", g.pinDir)
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
	if all {
		describeRemoval(e, in)
	}
	rctx, cancel := context.WithTimeout(ctx, timeout)
	defer cancel()
	if err := removeInstall(rctx, e, in, force); err != nil {
		var busy bypass.ErrBusy
		if errors.As(err, &busy) {
			return err
		}
		return fmt.Errorf("remove shunt: %w", err)
	}
	fmt.Fprintf(e.stdout, "shunt removed: nothing is pinned at %s or attached\n", g.pinDir)
	if _, err := os.Stat(bypass.LearnedDir(g.pinDir)); err == nil {
		fmt.Fprintf(e.stdout, "what shunt learned about splice readers stays at %s for the next install ('shunt bypass forget --all' removes it)\n", bypass.LearnedDir(g.pinDir))
	}
	// The guard removes its own lock file once it sees the install gone.
	return runlock.Remove("install", g.pinDir)
}

// removeInstall takes the install off the host; forced, it says which
// connections it reset on the way.
func removeInstall(ctx context.Context, e *env, in *bypass.Install, force bool) error {
	if !force {
		return in.Remove(ctx)
	}
	stuck, err := in.ForceRemove(ctx)
	for _, s := range stuck {
		conn := fmt.Sprintf("%s -> %s (netns %d, cookie %d)", s.Local, s.Remote, s.Netns, s.Cookie)
		why := "shunt could not look into it (not accepted by its server yet, or the kernel refused the drain)"
		if s.Unread {
			why = "its reader had not read what was redirected to it"
		}
		switch {
		case s.Err == nil:
			fmt.Fprintf(e.stdout, "reset %s: %s\n", conn, why)
		case errors.Is(s.Err, os.ErrNotExist):
			fmt.Fprintf(e.stdout, "%s had closed already (its peer's reset)\n", conn)
		default:
			fmt.Fprintf(e.stderr, "could not reset %s (%s): %v; what was redirected to it and not read is dropped with shunt\n", conn, why, s.Err)
		}
	}
	return err
}

// describeRemoval says what removing the install takes away: the cgroups
// still enabled and whose they are, and the settings that go with it.
func describeRemoval(e *env, in *bypass.Install) {
	cgs, _ := in.Cgroups()
	for _, cg := range cgs {
		path := cg.Path
		if path == "" {
			path = "(removed)"
		}
		fmt.Fprintf(e.stdout, "detaching cgroup %s (id %d, owner %s)\n", path, cg.ID, ownerOf(cg.Path))
	}
	if ports, _ := in.ExcludedPorts(); len(ports) > 0 {
		fmt.Fprintf(e.stdout, "dropped with the install: --exclude-ports %s (give it again at the next enable)\n", joinPorts(ports))
	}
	if progs, _ := in.SplicePrograms(); len(progs) > 0 {
		fmt.Fprintf(e.stdout, "kept: %d program(s) seen splicing, for the next install ('shunt bypass forget --all' drops them)\n", len(progs))
	}
}

// ownerOf names the user who owns a path.
func ownerOf(path string) string {
	var st unix.Stat_t
	if path == "" || unix.Stat(path, &st) != nil {
		return "unknown"
	}
	if u, err := user.LookupId(strconv.Itoa(int(st.Uid))); err == nil {
		return u.Username
	}
	return "uid " + strconv.Itoa(int(st.Uid))
}

func joinPorts(ports []uint16) string {
	s := make([]string, len(ports))
	for i, p := range ports {
		s[i] = strconv.Itoa(int(p))
	}
	return strings.Join(s, ",")
}
