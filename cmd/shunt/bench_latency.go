package main

import (
	"context"
	"fmt"
	"io"
	"text/tabwriter"
	"time"

	"github.com/spf13/cobra"

	"github.com/shunt-project/shunt/bench"
	"github.com/shunt-project/shunt/bench/report"
)

func newBenchLatencyCmd(e *env) *cobra.Command {
	var (
		m            matrixFlags
		cfg          bench.LatencyConfig
		withSockperf bool
	)
	c := &cobra.Command{
		Use:   "latency",
		Short: "Request/response ping-pong",
		Long: `latency sends a message, waits for the same size back, and times each round
trip, over plain TCP, the same TCP connection bypassed by shunt, and an
AF_UNIX socketpair (the floor for host-local). CPU is the whole machine's,
from /proc/stat, divided by round trips. A run that meets a stall (a round
trip over 10 ms, or max over 100x p50) is marked STALL.

--new-conn makes each round trip a new connection (connect, request,
response, the server closes): what a short connection costs. Such
connections are brief, so after the first 16 the default install leaves
all but one in 64 unpaired; mode shunt-pair-brief (installed with
--pair-brief) pairs each, which prices the pairing. Mode shunt-trust is
shunt installed with --trust-readers, which redirects a connection's first
request and response too, and keeps readers that block in recv (sockperf's)
on the bypass.`,
		Example: `  shunt bench latency --sizes 14,1K,16K,64K --rounds 5 --out /tmp/lat
  shunt bench latency --new-conn --modes tcp,shunt,shunt-pair-brief,shunt-trust --count 2000 --warmup 100`,
		Args: noArgs,
		RunE: func(c *cobra.Command, _ []string) error {
			if withSockperf {
				m.modes += "," + bench.ModeSockperfTCP + "," + bench.ModeSockperfShunt
			}
			mx, err := m.matrix("--sizes", bench.ModeTCP, bench.ModeShunt, bench.ModeUnix, bench.ModeBare, bench.ModeTrust, bench.ModePaired, bench.ModeSockperfTCP, bench.ModeSockperfShunt)
			if err != nil {
				return err
			}
			if cfg.Count < 1 || cfg.Warmup < 0 {
				return usageError{fmt.Errorf("--count must be at least 1")}
			}
			cfg.Matrix = mx
			return runBench(c.Context(), e, &m, &cfg.Matrix, func(ctx context.Context, l *bench.Lab) ([]bench.LatencyResult, error) {
				return bench.RunLatency(ctx, l, cfg)
			}, printLatency, report.Latency)
		},
	}
	m.register(c.Flags(), "sizes", "14", "tcp,shunt,unix", "same-cpu,cross-cpu", "tcp, shunt, unix, shunt-bare (shunt's pairing, redirect without checks), shunt-trust (installed with --trust-readers), shunt-pair-brief (installed with --pair-brief: short connections paired too), sockperf-tcp, sockperf-shunt-trust (sockperf reads with blocking calls, which the default install keeps on TCP)")
	c.Flags().IntVar(&cfg.Count, "count", 20000, "round trips measured per run")
	c.Flags().DurationVar(&cfg.MaxTime, "duration", 2*time.Second, "a run stops early after this long")
	c.Flags().IntVar(&cfg.Warmup, "warmup", 1000, "round trips before measuring")
	c.Flags().BoolVar(&cfg.NewConn, "new-conn", false, "a new connection for every round trip (connect, request, response, close)")
	c.Flags().BoolVar(&withSockperf, "with-sockperf", false, "also measure with sockperf ping-pong (modes sockperf-tcp, sockperf-shunt-trust; sockperf reports RTT/2)")
	return c
}

func us(d time.Duration) string { return fmt.Sprintf("%.1f", float64(d)/1e3) }

func printLatency(w io.Writer, res []bench.LatencyResult) {
	tw := tabwriter.NewWriter(w, 0, 4, 2, ' ', tabwriter.AlignRight)
	fmt.Fprintln(tw, "size\tplacement\tmode\tp50 us\tp99 us\tp99.9 us\tmax us\tround trips/s\tCPU us/RT\tp50 vs tcp\t")
	stalls := 0
	for _, r := range res {
		ratio := "-"
		if r.RatioToTCP > 0 {
			ratio = fmt.Sprintf("%.2f", r.RatioToTCP)
		}
		mark := ""
		if r.Stalled {
			mark = " STALL"
			stalls++
		}
		rate, cpu := "-", "-"
		if r.RoundTripsPS > 0 {
			rate, cpu = fmt.Sprintf("%.0f", r.RoundTripsPS), us(r.CPUPerRT)
		}
		fmt.Fprintf(tw, "%d\t%s\t%s\t%s\t%s\t%s\t%s%s\t%s\t%s\t%s\t\n", r.Size, r.Placement, r.Mode, us(r.MedianP50), us(r.Dist.P99),
			us(r.Dist.P999), us(r.Dist.Max), mark, rate, cpu, ratio)
	}
	tw.Flush()
	if len(res) > 0 {
		fmt.Fprintf(w, "\n%s topology; p50 is the median of the rounds' p50s, other percentiles pool all rounds (%d round trips in the first row).\n",
			res[0].Topology, res[0].Dist.Count)
	}
	for _, r := range res {
		if _, _, ext := bench.ExternalMode(r.Mode); ext {
			fmt.Fprintln(w, "sockperf rows are sockperf's own figures: half round trips (RTT/2), ratio against sockperf-tcp.")
			break
		}
	}
	if stalls > 0 {
		fmt.Fprintf(w, "STALL: %d run(s) had a round trip over %v or a max over 100x p50\n", stalls, bench.StallLimit)
	}
}
