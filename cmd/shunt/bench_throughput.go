package main

import (
	"context"
	"fmt"
	"io"
	"text/tabwriter"
	"time"

	"github.com/spf13/cobra"

	"github.com/shunt-project/shunt/bench"
)

func newBenchThroughputCmd(e *env) *cobra.Command {
	var (
		cfg               bench.ThroughputConfig
		modes, placements string
		asJSON            bool
	)
	c := &cobra.Command{
		Use:   "throughput",
		Short: "One-way bulk stream between two namespaces joined by veth",
		Long: `throughput writes fixed-size blocks for --duration and counts what the
receiver got until its last byte, over plain TCP, shunt bypass and an AF_UNIX
socketpair. CPU is the whole machine's, from /proc/stat, per GB received.`,
		Example: `  shunt bench throughput --write-size 65536 --duration 2s --rounds 5`,
		Args:    noArgs,
		RunE: func(c *cobra.Command, _ []string) error {
			var err error
			if cfg.Modes, err = oneOf("--modes", modes, bench.ModeTCP, bench.ModeShunt, bench.ModeUnix); err != nil {
				return err
			}
			if cfg.Placements, err = oneOf("--placement", placements, bench.SameCPU, bench.CrossCPU); err != nil {
				return err
			}
			if cfg.WriteSize < 1 || cfg.Rounds < 1 || cfg.Duration <= 0 {
				return usageError{fmt.Errorf("--write-size, --rounds and --duration must be positive")}
			}
			return runBench(c.Context(), e, asJSON, func(ctx context.Context, l *bench.Lab, p func(string)) ([]bench.ThroughputResult, error) {
				cfg.Progress = p
				return bench.RunThroughput(ctx, l, cfg)
			}, printThroughput)
		},
	}
	c.Flags().IntVar(&cfg.WriteSize, "write-size", 64<<10, "bytes per write()")
	c.Flags().DurationVar(&cfg.Duration, "duration", time.Second, "how long the sender writes, per round and mode")
	c.Flags().IntVar(&cfg.Rounds, "rounds", 5, "interleaved rounds")
	c.Flags().StringVar(&modes, "modes", "tcp,shunt,unix", "modes to compare: tcp, shunt, unix")
	c.Flags().StringVar(&placements, "placement", "cross-cpu", "CPU placement: same-cpu, cross-cpu (sender 0, receiver 1)")
	c.Flags().BoolVar(&asJSON, "json", false, "print JSON")
	return c
}

func printThroughput(w io.Writer, res []bench.ThroughputResult) {
	tw := tabwriter.NewWriter(w, 0, 4, 2, ' ', tabwriter.AlignRight)
	fmt.Fprintln(tw, "placement\tmode\tGbit/s (median)\tmin\tmax\tCPU s/GB\tvs tcp\t")
	for _, r := range res {
		lo, hi := r.RoundGbps[0], r.RoundGbps[0]
		for _, g := range r.RoundGbps {
			lo, hi = min(lo, g), max(hi, g)
		}
		ratio := "-"
		if r.RatioToTCP > 0 {
			ratio = fmt.Sprintf("%.2f", r.RatioToTCP)
		}
		fmt.Fprintf(tw, "%s\t%s\t%.2f\t%.2f\t%.2f\t%.2f\t%s\t\n", r.Placement, r.Mode, r.MedianGbps, lo, hi, r.CPUSecPerGB, ratio)
	}
	tw.Flush()
	if len(res) > 0 {
		fmt.Fprintf(w, "\n%d-byte writes, %d rounds per mode.\n", res[0].WriteSize, len(res[0].RoundGbps))
	}
}
