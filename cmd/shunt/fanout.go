package main

import (
	"errors"
	"fmt"
	"text/tabwriter"
	"time"

	"github.com/spf13/cobra"

	"github.com/shunt-project/shunt/fanout"
)

const defaultFanoutControl = "/run/shunt/fanout.sock"

func newFanoutCmd(e *env) *cobra.Command {
	var (
		source, listen, framing, slow, queue, control, path string
		metricsAddr                                         string
	)
	c := &cobra.Command{
		Use:   "fanout --source udp://ADDR:PORT --listen tcp://ADDR:PORT",
		Short: "Relay every datagram of a UDP feed to every TCP subscriber",
		Long: `fanout receives a feed on a UDP socket and writes every datagram, in order,
to every TCP subscriber connected to --listen. A subscriber gets messages from
the moment it is connected. --framing u16 or u32 puts a big-endian length
before each message so a reader can split the stream.

A slow subscriber never holds up the others: at most --queue bytes wait for
it in shunt (its kernel send buffer holds more). Past that it loses messages
(--slow drop: counted, and with framing a gap marker, a length of all ones
followed by the 4-byte count of lost messages) or is disconnected
(--slow disconnect). 'shunt fanout stats' reads per-subscriber counters from
the running forwarder through --control. It runs until interrupted (Ctrl-C,
SIGTERM). --path batch (default) writes each subscriber once per batch of
datagrams; --path uring does the same with one io_uring submission for all
subscribers; --path per-message writes once per message, as a plain relay
loop does; --path kernel (root) sends each datagram once to a multicast group
on loopback and lets a BPF program forward the kernel's copies to each
subscriber's socket, with --queue bounding the kernel memory a subscriber's
backlog may pin (there the gap marker goes out with the subscriber's next
message); --path zerocopy frames each batch once and sends that one buffer to
every subscriber that has caught up with MSG_ZEROCOPY (over loopback the
kernel copies anyway; 'fanout stats' counts it). docs/BENCHMARKS.md compares
them.`,
		Example: `  shunt fanout --source udp://0.0.0.0:5000 --listen tcp://0.0.0.0:6000 --framing u32
  shunt fanout stats`,
		Args: noArgs,
		RunE: func(c *cobra.Command, _ []string) error {
			var cfg fanout.Config
			var err error
			if source == "" || listen == "" {
				return usageError{fmt.Errorf("--source and --listen are required (see '%s --help')", c.CommandPath())}
			}
			if cfg.Source, err = fanout.ParseEndpoint("udp", source); err != nil {
				return usageError{fmt.Errorf("--source %w", err)}
			}
			if cfg.Listen, err = fanout.ParseEndpoint("tcp", listen); err != nil {
				return usageError{fmt.Errorf("--listen %w", err)}
			}
			if cfg.Framing, err = fanout.ParseFraming(framing); err != nil {
				return usageError{fmt.Errorf("--framing: %w", err)}
			}
			if cfg.Slow, err = fanout.ParseSlowPolicy(slow); err != nil {
				return usageError{fmt.Errorf("--slow: %w", err)}
			}
			sizes, err := parseSizes("--queue", queue)
			if err != nil || len(sizes) != 1 || sizes[0] > 1<<30 {
				return usageError{fmt.Errorf("--queue: want one size up to 1G, like 1M, got %q", queue)}
			}
			cfg.Queue = int(sizes[0])
			if cfg.Path, err = fanout.ParsePath(path); err != nil {
				return usageError{fmt.Errorf("--path: %w", err)}
			}
			if err := checkMetricsAddr(metricsAddr); err != nil {
				return err
			}
			if metricsAddr != "" && control == "" {
				return usageError{errors.New("--metrics-addr reads the forwarder's counters through --control: give it a path")}
			}
			cfg.Control = control
			cfg.Log = e.stderr
			f, err := fanout.New(cfg)
			if err != nil {
				return err
			}
			defer f.Close()
			stopMetrics, err := serveProcessMetrics(e, metricsAddr, fanout.Collector(func() (fanout.Stats, error) { return fanout.Query(control) }))
			if err != nil {
				return err
			}
			defer func() { _ = stopMetrics() }()
			fmt.Fprintf(e.stderr, "fanout: relaying udp://%s to subscribers of tcp://%s (framing %s, slow %s, queue %d bytes)\n",
				f.SourceAddr(), f.ListenAddr(), cfg.Framing, cfg.Slow, cfg.Queue)
			if err := f.Run(c.Context()); err != nil {
				return err
			}
			t := f.Stats().Totals
			fmt.Fprintf(e.stderr, "fanout: stopped after %d messages to %d subscribers\n", t.Received, t.Connected)
			return nil
		},
	}
	c.Flags().StringVar(&source, "source", "", "UDP address the feed arrives on: udp://ADDR:PORT")
	c.Flags().StringVar(&listen, "listen", "", "TCP address subscribers connect to: tcp://ADDR:PORT")
	c.Flags().StringVar(&framing, "framing", "none", "none, u16 or u32: a length before each message")
	c.Flags().StringVar(&slow, "slow", "drop", "drop (lose messages, counted) or disconnect a subscriber whose queue is full")
	c.Flags().StringVar(&queue, "queue", "1M", "bytes that may wait in shunt for one subscriber")
	c.Flags().StringVar(&path, "path", "batch", "batch (one write per subscriber per batch), uring (the same in one io_uring submission), per-message (one write per message), kernel (BPF forwards the kernel's multicast copies) or zerocopy (one shared buffer, MSG_ZEROCOPY)")
	c.Flags().StringVar(&control, "control", defaultFanoutControl, `unix socket for 'shunt fanout stats' ("" for none)`)
	metricsAddrFlag(c, &metricsAddr)
	c.AddCommand(newFanoutStatsCmd(e))
	return c
}

func newFanoutStatsCmd(e *env) *cobra.Command {
	var (
		control string
		asJSON  bool
	)
	c := &cobra.Command{
		Use:   "stats [--control PATH] [--json]",
		Short: "Per-subscriber counters of a running forwarder",
		Args:  noArgs,
		RunE: func(c *cobra.Command, _ []string) error {
			st, err := fanout.Query(control)
			if err != nil {
				return err
			}
			if asJSON {
				return writeJSON(e.stdout, st)
			}
			t := st.Totals
			fmt.Fprintf(e.stdout, "%s -> %s, framing %s, slow %s, queue %d bytes\n", st.Source, st.Listen, st.Framing, st.Slow, st.Queue)
			fmt.Fprintf(e.stdout, "received %d messages (%d bytes), %d oversized; %d subscribers now, %d connected, %d disconnected (%d for being slow)\n",
				t.Received, t.Bytes, t.Oversized, t.Subscribers, t.Connected, t.Disconnected, t.SlowDropped)
			if len(st.Subscribers) == 0 {
				return nil
			}
			w := tabwriter.NewWriter(e.stdout, 0, 4, 2, ' ', 0)
			fmt.Fprintln(w, "PEER\tSINCE\tMESSAGES\tBYTES\tDROPPED\tQUEUED\t")
			for _, s := range st.Subscribers {
				note := ""
				if s.HalfClose {
					note = "half-closed"
				}
				fmt.Fprintf(w, "%s\t%s\t%d\t%d\t%d\t%d\t%s\n", s.Peer, s.Since.Format(time.RFC3339), s.Messages, s.Bytes, s.Dropped, s.Queued, note)
			}
			return w.Flush()
		},
	}
	c.Flags().StringVar(&control, "control", defaultFanoutControl, "the forwarder's control socket")
	c.Flags().BoolVar(&asJSON, "json", false, "print JSON")
	return c
}
