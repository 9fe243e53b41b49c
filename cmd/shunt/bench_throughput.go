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

func newBenchThroughputCmd(e *env) *cobra.Command {
	var (
		m         matrixFlags
		cfg       bench.ThroughputConfig
		withIperf bool
		readSize  string
	)
	c := &cobra.Command{
		Use:   "throughput",
		Short: "One-way bulk stream",
		Long: `throughput writes blocks of each --write-sizes for --duration and counts
what the receiver got until its last byte, over plain TCP, shunt bypass and an
AF_UNIX socketpair. CPU is the whole machine's, from /proc/stat, per GB.`,
		Example: `  shunt bench throughput --write-sizes 64,1K,16K,256K --duration 1s --out /tmp/thr`,
		Args:    noArgs,
		RunE: func(c *cobra.Command, _ []string) error {
			if withIperf {
				m.modes += "," + bench.ModeIperfTCP + "," + bench.ModeIperfShunt
			}
			mx, err := m.matrix("--write-sizes", bench.ModeTCP, bench.ModeShunt, bench.ModeUnix, bench.ModeBare, bench.ModeIperfTCP, bench.ModeIperfShunt)
			if err != nil {
				return err
			}
			if cfg.Duration <= 0 {
				return usageError{fmt.Errorf("--duration must be positive")}
			}
			rs, err := parseSizes("--read-size", readSize)
			if err != nil {
				return err
			}
			if len(rs) != 1 || rs[0] > 64<<20 {
				return usageError{fmt.Errorf("--read-size: one size up to 64M, not %q", readSize)}
			}
			cfg.ReadSize = rs[0]
			cfg.Matrix = mx
			return runBench(c.Context(), e, &m, &cfg.Matrix, func(ctx context.Context, l *bench.Lab) ([]bench.ThroughputResult, error) {
				return bench.RunThroughput(ctx, l, cfg)
			}, printThroughput, report.Throughput)
		},
	}
	m.register(c.Flags(), "write-sizes", "64K", "tcp,shunt,unix", "cross-cpu", "tcp, shunt, unix, shunt-bare (redirect without checks or flow control), iperf3-tcp, iperf3-shunt-trust (iperf3 reads with blocking calls, which the default install keeps on TCP)")
	c.Flags().BoolVar(&withIperf, "with-iperf3", false, "also measure with iperf3 (modes iperf3-tcp, iperf3-shunt-trust; whole seconds)")
	c.Flags().DurationVar(&cfg.Duration, "duration", time.Second, "how long the sender writes, per run")
	c.Flags().StringVar(&readSize, "read-size", formatSize(bench.DefaultReadSize), "the receiver's buffer: the most one read takes (not for iperf3 modes)")
	c.Flags().BoolVar(&cfg.Nagle, "nagle", false, "leave Nagle's algorithm on at the TCP writer (programs that never set TCP_NODELAY); by default it sets TCP_NODELAY")
	return c
}

func printThroughput(w io.Writer, res []bench.ThroughputResult) {
	tw := tabwriter.NewWriter(w, 0, 4, 2, ' ', tabwriter.AlignRight)
	fmt.Fprintln(tw, "write size\tplacement\tmode\tGbit/s (median)\tmin\tmax\tCPU s/GB\tpeak TCP mem MiB\tvs tcp\tby redirect\tsent back\tthrottles a run\t")
	for _, r := range res {
		lo, hi := r.RoundGbps[0], r.RoundGbps[0]
		for _, g := range r.RoundGbps {
			lo, hi = min(lo, g), max(hi, g)
		}
		ratio := "-"
		if r.RatioToTCP > 0 {
			ratio = fmt.Sprintf("%.2f", r.RatioToTCP)
		}
		share, sentBack, throttles := "-", "-", "-"
		if b := r.Bypass; b != nil {
			share, sentBack = fmt.Sprintf("%.0f%%", 100*b.RedirectedShare), fmt.Sprintf("%d of %d", b.SentBackRuns, len(r.RoundGbps))
			throttles = fmt.Sprintf("%.0f", b.ThrottlesPerRun)
		}
		fmt.Fprintf(tw, "%d\t%s\t%s\t%.2f\t%.2f\t%.2f\t%.2f\t%.1f\t%s\t%s\t%s\t%s\t\n", r.WriteSize, r.Placement, r.Mode, r.MedianGbps, lo, hi, r.CPUSecPerGB, r.PeakTCPMemMiB, ratio, share, sentBack, throttles)
	}
	tw.Flush()
	if len(res) > 0 {
		reads := ""
		if n := res[0].ReadSize; n > 0 {
			reads = ", reads of up to " + formatSize(uint64(n))
		}
		fmt.Fprintf(w, "\n%s topology, %d rounds per row%s.\n", res[0].Topology, len(res[0].RoundGbps), reads)
	}
	if shuntBehindTCP(res) {
		fmt.Fprintln(w, "Where shunt is below tcp: each redirected send is its own message that wakes the reader, and\n"+
			"across CPUs the writer waits while the reader copies under its socket lock; TCP gathers writes\n"+
			"into segments and queues without that lock (docs/BENCHMARKS.md, \"One-way throughput\").")
	}
}

// shuntBehindTCP says whether a bypass row moved fewer bytes than TCP's.
func shuntBehindTCP(res []bench.ThroughputResult) bool {
	for _, r := range res {
		if r.Mode == bench.ModeShunt && r.RatioToTCP > 0 && r.RatioToTCP < 1 {
			return true
		}
	}
	return false
}
