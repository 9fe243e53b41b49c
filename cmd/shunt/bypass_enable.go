package main

import (
	"context"
	"fmt"
	"strconv"
	"strings"

	"github.com/spf13/cobra"

	"github.com/shunt-project/shunt/bypass"
	"github.com/shunt-project/shunt/host"
)

func newBypassEnableCmd(e *env, g *globals) *cobra.Command {
	var (
		cgroupPath      string
		maxBacklog      string
		excludePorts    string
		trustReaders    bool
		refuseSplice    bool
		pairBrief       bool
		noProbation     bool
		noFIONREADWatch bool
		wholeHost       bool
		noGuard         bool
		splicers        []string
	)
	c := &cobra.Command{
		Use:   "enable --cgroup PATH | --host",
		Short: "Bypass new connections of a cgroup, or of the whole host",
		Long: `enable attaches shunt to a cgroup v2 directory and returns. New TCP
connections whose two sockets both belong to enabled cgroups (or their
descendants) are bypassed from then on; connections already open are not
touched. State is pinned under --pin-dir, so bypass keeps working after
this command exits. Enabling a cgroup twice is harmless.

Flow control: a receiving socket may hold at most --max-backlog redirected
bytes its reader has not read (or its SO_RCVBUF, if the application set
one), and at most what the most TCP grows its buffer to (tcp_rmem[2])
leaves beside its writer's send buffer (SO_SNDBUF, else tcp_wmem[2]) and
an eighth of that: 1.5 MiB with 6 MiB and 4 MiB, as on 6.1 and 6.12,
nothing where tcp_wmem[2] is as large as tcp_rmem[2]. Past that its
writer's sends take the TCP path, where TCP slows the writer as
usual, until the reader has caught up. No byte is lost or
reordered by the switch.

Readers: only non-blocking recv/read (event loops: epoll, poll, Go) are
served by redirected bytes as by TCP, so nothing is redirected to a socket
until its reader has called recv that way (a connection's first bytes each
way take TCP); a reader that only splices (Go's io.Copy between two
connections) stays on TCP, and one that blocks in recv (a signal would end
its wait with EAGAIN), asks for MSG_WAITALL or reads through io_uring (each
completion says whether bytes are left, which only TCP tells) moves its
connection back to plain TCP. --trust-readers redirects from the first byte
and keeps blocking readers, for applications known never to splice(2) from
their sockets nor to be signalled, stopped or traced in a blocking read.

A reader that calls splice(2) after recv (HAProxy's splice-auto, a Go proxy
that reads a header and then io.Copy's) cannot read bytes redirected before
it spliced. shunt sees the splice, sends the connection back to TCP, and
learns the program, whose later readers stay on TCP from their first recv
('shunt status' lists them; 'shunt bypass forget' unlearns). A connection
caught with such bytes already queued is reset by the guard, so the
application sees an error instead of waiting for ever; if its peer had
already ended the stream, the splice returns that end first and the
application reads a short stream (counted as splice_readers_truncated and
logged by the guard). enable starts the guard in the background
(--no-guard: run 'shunt bypass guard' yourself). --splicer NAME teaches a
program before it is seen, which avoids both.

--exclude-ports keeps new connections to those server ports on TCP, for
applications that switch to MSG_WAITALL mid-stream (see
docs/TRANSPARENCY.md). It replaces the list set before; "none" clears it.

--host enables the root of the cgroup v2 hierarchy: every process on the
machine, shunt's own included. Say so explicitly; no cgroup is a mistake.`,
		Example: `  shunt bypass enable --cgroup /sys/fs/cgroup/unified/myapp
  shunt bypass enable --host                 # every process on this machine
  shunt bypass enable --cgroup /sys/fs/cgroup/unified/myapp --splicer haproxy`,
		Args: noArgs,
		RunE: func(c *cobra.Command, _ []string) error {
			sizes, err := parseSizes("--max-backlog", maxBacklog)
			if err != nil || len(sizes) != 1 || sizes[0] > 1<<31 {
				return usageError{fmt.Errorf("--max-backlog: want one size up to 2G, like 8M, got %q", maxBacklog)}
			}
			var exclude []uint16
			if c.Flags().Changed("exclude-ports") {
				if exclude, err = parsePorts(excludePorts); err != nil {
					return err
				}
			}
			if wholeHost == (cgroupPath != "") {
				return usageError{fmt.Errorf("say which processes to bypass: --cgroup PATH (a cgroup v2 directory), or --host for every process on this machine (see '%s --help')", c.CommandPath())}
			}
			if c.Flags().Changed("splicer") && len(splicers) == 0 {
				splicers = []string{""} // --splicer "": refused below
			}
			for _, name := range splicers {
				if name == "" || len(name) > 15 {
					return usageError{fmt.Errorf("--splicer: %q is not a command name (1 to 15 characters, as 'ps -o comm' shows it)", name)}
				}
			}
			opts := bypass.Options{MaxBacklog: uint32(sizes[0]), TrustReaders: trustReaders, RefuseSplice: refuseSplice, PairBrief: pairBrief, NoProbation: noProbation, NoFIONREADWatch: noFIONREADWatch}
			asked := c.Flags().Changed("max-backlog") || c.Flags().Changed("trust-readers") || c.Flags().Changed("refuse-splice") || c.Flags().Changed("pair-brief") || c.Flags().Changed("no-probation") || c.Flags().Changed("no-fionread-watch")
			if err := bypassEnable(c.Context(), e, g, cgroupPath, opts, asked, exclude, splicers); err != nil {
				return err
			}
			if noGuard {
				return nil
			}
			logPath, err := startGuard(e, g.pinDir)
			if err != nil {
				return err
			}
			fmt.Fprintf(e.stdout, "guard running (resets connections of splice readers that would wait for ever), log %s\n", logPath)
			return nil
		},
	}
	c.Flags().StringVar(&cgroupPath, "cgroup", "", "cgroup v2 directory whose processes' new connections are bypassed")
	c.Flags().BoolVar(&wholeHost, "host", false, "bypass every process on this machine (the root of the cgroup v2 hierarchy)")
	c.Flags().BoolVar(&noGuard, "no-guard", false, "do not start the guard in the background (run 'shunt bypass guard' yourself)")
	c.Flags().StringSliceVar(&splicers, "splicer", nil, "command name of a program that splices after recv: its readers stay on TCP (repeatable)")
	c.Flags().StringVar(&excludePorts, "exclude-ports", "", "server ports whose new connections stay on TCP, comma-separated, or none (replaces the list)")
	c.Flags().StringVar(&maxBacklog, "max-backlog", formatSize(bypass.DefaultMaxBacklog), "unread redirected bytes a receiver may hold before its writer moves to TCP, less where its tcp_rmem[2] leaves less beside the writer's send buffer (applies when shunt is first installed)")
	c.Flags().BoolVar(&refuseSplice, "refuse-splice", false, "where the kernel runs BPF LSM programs, fail a splice(2) from a bypassed socket with EINVAL before it reads, for applications that then read instead (Go's io.Copy): they stay bypassed; one that splices again without reading (HAProxy 2.6) has that splice let through, as without this flag (applies when shunt is first installed)")
	c.Flags().BoolVar(&pairBrief, "pair-brief", false, "pair every connection, also to server ports whose connections from one client address are brief (16 in a row closed after at most 4 sends each way), whose new connections are otherwise left on TCP but one in 64: a pairing costs them more than it wins (applies when shunt is first installed)")
	c.Flags().BoolVar(&noProbation, "no-probation", false, "redirect to a program's readers from their first recv also while the program is new to shunt, whose readers otherwise read by TCP until one of them has read 16 times or twice and 1 s passed (a program that reads a header and then splices is learned then with no connection reset): for hosts where none does (applies when shunt is first installed)")
	c.Flags().BoolVar(&noFIONREADWatch, "no-fionread-watch", false, "where FIONREAD leaves bytes of a bypassed socket out and shunt cannot correct it (lockdown), do not watch its answers on the ioctl system call's exit tracepoint: every system call of the host keeps the kernel's fast path (about 65 ns each on a 2-core VM), and a reader told too few waits for the stall watch (2-20 ms) or, if it sleeps while told 0, the stall scan (up to 1 s) before its connection goes back to TCP (applies when shunt is first installed)")
	c.Flags().BoolVar(&trustReaders, "trust-readers", false, "redirect before a reader has called recv, and to blocking readers: first exchanges and blocking programs are bypassed too; breaks splice(2) readers, and a signal in a blocking read returns EAGAIN (applies when shunt is first installed)")
	return c
}

// parsePorts reads "80,8080" or "none".
func parsePorts(s string) ([]uint16, error) {
	ports := []uint16{}
	if s == "none" {
		return ports, nil
	}
	for _, f := range strings.Split(s, ",") {
		p, err := strconv.ParseUint(strings.TrimSpace(f), 10, 16)
		if err != nil || p == 0 {
			return nil, usageError{fmt.Errorf("--exclude-ports: %q is not a port (1-65535); give a comma-separated list or none", f)}
		}
		ports = append(ports, uint16(p))
	}
	return ports, nil
}

// exclude is nil when the list is to stay as it is; asked says whether the
// user gave options, which an install that exists already keeps as they were.
func bypassEnable(ctx context.Context, e *env, g *globals, cgroupPath string, opts bypass.Options, asked bool, exclude []uint16, splicers []string) error {
	if err := host.CheckPrivileges(); err != nil {
		return err
	}
	cg, err := cgroupArg(cgroupPath)
	if err != nil {
		return err
	}
	if err := e.probe().Err(); err != nil {
		return err
	}
	if err := host.EnsureBPFFS(g.pinDir); err != nil {
		return err
	}
	release, err := lockInstall(e, g.pinDir)
	if err != nil {
		return err
	}
	defer release()
	_, openErr := bypass.Open(g.pinDir)
	fresh := openErr != nil
	in, err := bypass.Create(g.pinDir, opts)
	if err != nil {
		return err
	}
	defer in.Close()
	if !fresh && asked {
		if have, err := in.Options(); err == nil && have != opts {
			fmt.Fprintf(e.stderr, "shunt: the install keeps the options it was created with (%s); to change them: shunt bypass disable --all, then enable again\n", describeOptions(have))
		}
	}
	for _, name := range splicers {
		if err := in.Learn(name); err != nil {
			return err
		}
	}
	// Before attaching: no connection may pair in between.
	if exclude != nil {
		if err := in.SetExcludedPorts(exclude); err != nil {
			if fresh {
				_ = in.Remove(ctx)
				_ = bypass.RemoveLearned(g.pinDir, true)
			}
			return err
		}
	}
	added, err := in.Attach(cg)
	if err != nil {
		if fresh {
			// Leave nothing behind that this command made.
			if cgs, _ := in.Cgroups(); len(cgs) == 0 {
				_ = in.Remove(ctx)
				_ = bypass.RemoveLearned(g.pinDir, true)
			}
		}
		return err
	}
	if exclude != nil {
		fmt.Fprintf(e.stdout, "new connections to server ports %v stay on TCP\n", exclude)
	}
	what := "cgroup " + cg.Path
	if cgroupPath == "" {
		what = fmt.Sprintf("the whole host: cgroup v2 root %s, every process on this machine, shunt's own included", cg.Path)
	}
	if added {
		fmt.Fprintf(e.stdout, "bypass enabled for %s\n", what)
	} else {
		fmt.Fprintf(e.stdout, "bypass already enabled for %s\n", what)
	}
	return nil
}
