package main

import (
	"fmt"
	"io"
	"strconv"
	"strings"
	"text/tabwriter"
	"time"

	"github.com/spf13/cobra"

	"github.com/shunt-project/shunt/bench"
	"github.com/shunt-project/shunt/bench/report"
)

func newBenchBackpressureCmd(e *env) *cobra.Command {
	var (
		cfg          bench.BackpressureConfig
		modes, rates string
		output       benchOutput
	)
	c := &cobra.Command{
		Use:   "backpressure",
		Short: "Fast and slow producers into a slow consumer: how much piles up",
		Long: `backpressure reproduces the test of the LSF/MM/BPF 2026 talk on sockmap
backpressure: producers at 200 KB/s and 2000 KB/s write (blocking, as an
application would) to a consumer that reads 100 KB/s from each. It samples
what the producers' write() accepted and the consumer has not read, the
consumer's FIONREAD and the host's TCP memory. Over TCP the senders are slowed
and the backlog stays at the socket buffers; a redirect without flow control
(shunt-bare) lets it grow for as long as the producers run; shunt holds it at
its backlog limit plus what TCP buffers.`,
		Example: `  shunt bench backpressure --duration 10s --out /tmp/bp`,
		Args:    noArgs,
		RunE: func(c *cobra.Command, _ []string) error {
			var err error
			if cfg.Modes, err = oneOf("--modes", modes, bench.ModeTCP, bench.ModeBare, bench.ModeShunt); err != nil {
				return err
			}
			for _, r := range strings.Split(rates, ",") {
				n, err := strconv.Atoi(strings.TrimSpace(r))
				if err != nil || n < 1 {
					return usageError{fmt.Errorf("--producers: %q is not a rate in KB/s", r)}
				}
				cfg.ProducerKBps = append(cfg.ProducerKBps, n)
			}
			if cfg.Rounds < 1 || cfg.Duration <= 0 || cfg.ConsumerKBps < 1 || cfg.Interval <= 0 {
				return usageError{fmt.Errorf("--rounds, --duration, --consumer and --interval must be positive")}
			}
			if cfg.Topology != bench.Veth && cfg.Topology != bench.Loopback {
				return usageError{fmt.Errorf("unknown topology %q (veth or loopback)", cfg.Topology)}
			}
			l, err := bench.NewLab("shunt-bench-")
			if err != nil {
				return err
			}
			defer l.Close()
			if !output.json {
				cfg.Progress = progress(e)
			}
			res, err := bench.RunBackpressure(c.Context(), l, cfg)
			clearProgress(e, cfg.Progress)
			if err != nil {
				return err
			}
			return emitBench(e, output, res, printBackpressure, report.Backpressure)
		},
	}
	c.Flags().StringVar(&modes, "modes", "tcp,shunt-bare,shunt", "modes to compare: tcp, shunt-bare (redirect without flow control), shunt (bypass with flow control)")
	c.Flags().StringVar(&rates, "producers", "200,2000", "producer rates in KB/s, one producer each")
	c.Flags().IntVar(&cfg.ConsumerKBps, "consumer", 100, "KB/s the consumer reads from each producer")
	c.Flags().DurationVar(&cfg.Duration, "duration", 10*time.Second, "how long producers produce, per run")
	c.Flags().DurationVar(&cfg.Interval, "interval", 100*time.Millisecond, "sampling interval")
	c.Flags().IntVar(&cfg.Rounds, "rounds", 1, "interleaved rounds")
	c.Flags().StringVar(&cfg.Topology, "topology", bench.Veth, "veth or loopback")
	output.flags(c.Flags(), "also write JSON, a markdown table and a PNG plot to this directory")
	return c
}

func printBackpressure(w io.Writer, res []bench.BackpressureResult) {
	tw := tabwriter.NewWriter(w, 0, 4, 2, ' ', tabwriter.AlignRight)
	fmt.Fprintln(tw, "mode\tround\tpeak in flight MiB\tfinal in flight MiB\tfinal queued MiB\tproduced KB/s\tconsumed KB/s\t")
	for _, r := range res {
		last := r.Samples[len(r.Samples)-1]
		prod := make([]string, len(r.ProducedKBps))
		for i, p := range r.ProducedKBps {
			prod[i] = fmt.Sprintf("%.0f", p)
		}
		fmt.Fprintf(tw, "%s\t%d\t%.1f\t%.1f\t%.1f\t%s\t%.0f\t\n", r.Mode, r.Round, mib(r.PeakInFlight), mib(last.InFlight),
			mib(last.Queued), strings.Join(prod, " + "), r.ConsumedKBps)
	}
	tw.Flush()
}

func mib(b int64) float64 { return float64(b) / (1 << 20) }
