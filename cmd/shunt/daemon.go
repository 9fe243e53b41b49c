package main

import (
	"errors"
	"fmt"
	"text/tabwriter"
	"time"

	"github.com/spf13/cobra"

	"github.com/shunt-project/shunt/daemon"
	"github.com/shunt-project/shunt/host"
	"github.com/shunt-project/shunt/splice"
)

func newDaemonCmd(e *env) *cobra.Command {
	var (
		socket, maxInflight string
		metricsAddr         string
		maxPairs            int
		takeOver            bool
	)
	c := &cobra.Command{
		Use:   "daemon [--socket PATH]",
		Short: "Join sockets that other processes hand over (SCM_RIGHTS)",
		Long: `daemon listens on a unix socket (root only) where any process sends two
connected TCP sockets and gets them joined in the kernel, as 'shunt proxy
--mode kernel' joins its own: it answers with a handle, and when the pair
ends it tells the connection that sent it (bytes each way, and why if it
ended early). Pairs keep going when the sending process disconnects or
exits. Wire format: docs/DAEMON.md; a Go client is package daemon, a Python
one examples/splice_client.py.

It runs until interrupted (Ctrl-C, SIGTERM); the pairs it holds are then
reset, since nothing else would forward FIN, RST and flow control for them.
To restart without dropping them, start the new daemon with --take-over:
it takes every pair (and the kernel objects) from the running one, which
then exits; bytes keep flowing in the kernel meanwhile.`,
		Example: `  sudo shunt daemon &
  sudo shunt daemon stats`,
		Args: noArgs,
		RunE: func(c *cobra.Command, _ []string) error {
			sizes, err := parseSizes("--max-inflight", maxInflight)
			if err != nil || len(sizes) != 1 || sizes[0] > 1<<30 {
				return usageError{fmt.Errorf("--max-inflight: want one size up to 1G, like 4M, got %q", maxInflight)}
			}
			if maxPairs < 1 || maxPairs > 1<<20 {
				return usageError{fmt.Errorf("--max-pairs: want 1 to %d, got %d", 1<<20, maxPairs)}
			}
			if err := checkMetricsAddr(metricsAddr); err != nil {
				return err
			}
			if err := host.CheckPrivileges(); err != nil {
				return err
			}
			opts := splice.Options{MaxInflight: uint32(sizes[0]), MaxPairs: maxPairs}
			logf := func(format string, args ...any) { fmt.Fprintf(e.stderr, format+"\n", args...) }
			var srv *daemon.Server
			if takeOver {
				var n int
				if srv, n, err = daemon.TakeOver(socket, opts, logf); err != nil {
					return err
				}
				fmt.Fprintf(e.stderr, "daemon: took over %d pairs; listening on %s\n", n, socket)
			} else {
				if srv, err = daemon.Listen(socket, opts, logf); err != nil {
					return err
				}
				fmt.Fprintf(e.stderr, "daemon: listening on %s\n", socket)
			}
			stopMetrics, err := serveProcessMetrics(e, metricsAddr, daemon.Collector(srv.Totals))
			if err != nil {
				srv.Close()
				return err
			}
			serveErr := srv.Serve(c.Context())
			n := len(srv.Stats())
			closeErr := errors.Join(srv.Close(), stopMetrics())
			if handed, ok := srv.HandedOver(); ok {
				fmt.Fprintf(e.stderr, "daemon: handed %d pairs over to a new daemon\n", handed)
			} else {
				fmt.Fprintf(e.stderr, "daemon: stopped; %d pairs reset\n", n)
			}
			if serveErr != nil {
				return serveErr
			}
			return closeErr
		},
	}
	c.PersistentFlags().StringVar(&socket, "socket", daemon.DefaultSocket, "the control socket")
	c.Flags().StringVar(&maxInflight, "max-inflight", "4M", "bytes one direction may have unacknowledged in the outgoing socket before user space paces it")
	c.Flags().IntVar(&maxPairs, "max-pairs", splice.DefaultMaxPairs, "pairs held at once")
	c.Flags().BoolVar(&takeOver, "take-over", false, "take the pairs of the daemon running on --socket, which then exits")
	metricsAddrFlag(c, &metricsAddr)
	c.AddCommand(newDaemonStatsCmd(e, &socket))
	return c
}

func newDaemonStatsCmd(e *env, socket *string) *cobra.Command {
	var asJSON bool
	c := &cobra.Command{
		Use:   "stats [--json]",
		Short: "The pairs a running daemon holds",
		Args:  noArgs,
		RunE: func(c *cobra.Command, _ []string) error {
			cl, err := daemon.Dial(*socket)
			if err != nil {
				return err
			}
			defer cl.Close()
			pairs, err := cl.Stats()
			if err != nil {
				return err
			}
			if asJSON {
				if pairs == nil {
					pairs = []daemon.PairInfo{}
				}
				return writeJSON(e.stdout, pairs)
			}
			fmt.Fprintf(e.stdout, "%d pairs\n", len(pairs))
			if len(pairs) == 0 {
				return nil
			}
			w := tabwriter.NewWriter(e.stdout, 0, 4, 2, ' ', 0)
			fmt.Fprintln(w, "HANDLE\tPROTO\tA\tB\tSINCE\tBYTES A->B\tBYTES B->A\tBY KERNEL\t")
			for _, p := range pairs {
				note := ""
				if !p.InKernel {
					note = "user space"
				}
				if p.DroppedAB+p.DroppedBA > 0 {
					note = fmt.Sprintf("%d datagrams dropped", p.DroppedAB+p.DroppedBA)
				}
				fmt.Fprintf(w, "%d\t%s\t%s\t%s\t%s\t%d\t%d\t%d\t%s\n", p.Handle, p.Proto, p.A, p.B, p.Since.Format(time.RFC3339), p.BytesAB, p.BytesBA, p.Kernel, note)
			}
			return w.Flush()
		},
	}
	c.Flags().BoolVar(&asJSON, "json", false, "print JSON")
	return c
}
