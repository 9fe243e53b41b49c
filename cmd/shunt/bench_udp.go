package main

import (
	"fmt"
	"io"
	"strings"
	"text/tabwriter"
	"time"

	"github.com/spf13/cobra"

	"github.com/shunt-project/shunt/bench"
	"github.com/shunt-project/shunt/bench/report"
	"github.com/shunt-project/shunt/host"
)

func newBenchUDPCmd(e *env) *cobra.Command {
	var (
		cfg          bench.UDPConfig
		sizes, modes string
		output       benchOutput
	)
	c := &cobra.Command{
		Use:   "udp",
		Short: "Two UDP sockets joined in the kernel against a user-space relay",
		Long: `udp measures what 'shunt splice' and the daemon do for UDP: two connected
UDP sockets joined in the kernel (kernel), against the relay a UDP proxy runs,
a goroutine per direction reading one socket and writing the other (relay).
Client and echo server run on CPU 1, the relay on CPU 0. For each datagram
size and mode (interleaved, --rounds times): --requests round trips (p50,
p99, p99.9, max, lost), then --bulk-time of the client sending as fast as it
can (datagrams sent and delivered, Gbit/s, whole-machine CPU per GB).`,
		Example: `  shunt bench udp --sizes 64,1400 --out /tmp/udp`,
		Args:    noArgs,
		RunE: func(c *cobra.Command, _ []string) error {
			var err error
			if cfg.Sizes, err = parseSizes("--sizes", sizes); err != nil {
				return err
			}
			for _, m := range strings.Split(modes, ",") {
				cfg.Modes = append(cfg.Modes, strings.TrimSpace(m))
			}
			if err := cfg.Check(); err != nil {
				return usageError{err}
			}
			if err := host.CheckPrivileges(); err != nil {
				return err
			}
			if !output.json {
				cfg.Progress = e.stderr
			}
			res, err := bench.RunUDP(c.Context(), cfg)
			if err != nil {
				return err
			}
			return emitBench(e, output, res, printUDP, report.UDP)
		},
	}
	c.Flags().StringVar(&sizes, "sizes", "64,1400", "datagram sizes in bytes (8 to 65507)")
	c.Flags().StringVar(&modes, "modes", strings.Join(bench.UDPModes, ","), "kernel (joined by shunt), relay (user space)")
	c.Flags().IntVar(&cfg.Requests, "requests", 20000, "round trips per run")
	c.Flags().DurationVar(&cfg.BulkTime, "bulk-time", 2*time.Second, "sending time per bulk run")
	c.Flags().IntVar(&cfg.Rounds, "rounds", 3, "interleaved rounds")
	output.flags(c.Flags(), "write udp.md and udp.json to this directory")
	return c
}

func printUDP(out io.Writer, res []bench.UDPResult) {
	w := tabwriter.NewWriter(out, 0, 4, 2, ' ', tabwriter.AlignRight)
	fmt.Fprintln(w, "mode\tsize\tp50\tp99\tmax\tlost\tsent\tdelivered\tGbit/s\tCPU s/GB\t")
	for _, r := range res {
		fmt.Fprintf(w, "%s\t%d\t%v\t%v\t%v\t%d\t%d\t%d\t%.2f\t%.2f\t\n", r.Mode, r.Size, r.RoundTrip.P50, r.RoundTrip.P99, r.RoundTrip.Max,
			r.Lost, r.Sent, r.Delivered, r.Gbps, r.CPUPerGB)
	}
	w.Flush()
}
