package main

import (
	"context"
	"fmt"
	"io"
	"strings"
	"text/tabwriter"
	"time"

	"github.com/spf13/cobra"

	"github.com/shunt-project/shunt/bench"
	"github.com/shunt-project/shunt/bench/report"
)

func newBenchEchoCmd(e *env) *cobra.Command {
	var (
		m      matrixFlags
		cfg    bench.EchoConfig
		sndbuf string
	)
	c := &cobra.Command{
		Use:   "echo",
		Short: "Echo servers: read/write, splice(2), io_uring, kernel redirect",
		Long: `echo times how long a block takes to come back from an echo server, for a
user-space read/write loop, splice(2) through a pipe, io_uring, and kernel
redirection (an sk_skb verdict sending each socket's input back out, no
process involved). A "+bp" mode turns on busy polling (SO_BUSY_POLL 50 us).
The echo connection itself is plain TCP. A run with any echo over 10 ms is
marked STALL: stalls were the published defect of kernel redirection.`,
		Example: `  shunt bench echo --blocks 16K,2M --modes rw,splice,io_uring,sockmap --out /tmp/echo`,
		Args:    noArgs,
		RunE: func(c *cobra.Command, _ []string) error {
			mx, err := m.matrix("--blocks", bench.EchoModes...)
			if err != nil {
				return err
			}
			if cfg.Count < 1 {
				return usageError{fmt.Errorf("--count must be at least 1")}
			}
			switch sndbuf {
			case "auto":
				cfg.SndBuf = bench.SndBufAuto
			default:
				sb, err := parseSizes("--sndbuf", sndbuf)
				if sndbuf == "0" {
					sb, err = []int{0}, nil
				}
				if err != nil || len(sb) != 1 {
					return usageError{fmt.Errorf("--sndbuf: want auto, 0 or one size, got %q", sndbuf)}
				}
				cfg.SndBuf = sb[0]
			}
			cfg.Matrix = mx
			return runBench(c.Context(), e, &m, &cfg.Matrix, func(ctx context.Context, l *bench.Lab) ([]bench.EchoResult, error) {
				return bench.RunEcho(ctx, l, cfg)
			}, printEcho, report.Echo)
		},
	}
	m.register(c.Flags(), "blocks", "16K,2M", "rw,splice,io_uring,sockmap", "cross-cpu", strings.Join(bench.EchoModes, ", "))
	c.Flags().IntVar(&cfg.Count, "count", 2000, "echoes per run (at most)")
	c.Flags().DurationVar(&cfg.MaxTime, "duration", 2*time.Second, "a run stops early after this long")
	c.Flags().StringVar(&sndbuf, "sndbuf", "auto", "server send buffer: auto (4 blocks for sockmap, which avoids 4 ms retry stalls; kernel's otherwise), 0 (kernel's), or a size forced in every mode")
	return c
}

func printEcho(w io.Writer, res []bench.EchoResult) {
	tw := tabwriter.NewWriter(w, 0, 4, 2, ' ', tabwriter.AlignRight)
	fmt.Fprintln(tw, "block\tplacement\tmode\techoes\tp50 us\tp99 us\tp99.9 us\tmax us\t>10ms\tCPU us/echo\tsndbuf\t")
	stalls := 0
	for _, r := range res {
		mark := ""
		if r.Stalled {
			mark = " STALL"
			stalls++
		}
		sb := "kernel"
		if r.SndBuf > 0 {
			sb = fmt.Sprint(r.SndBuf)
		}
		fmt.Fprintf(tw, "%d\t%s\t%s\t%d\t%s\t%s\t%s\t%s%s\t%d\t%s\t%s\t\n", r.Block, r.Placement, r.Mode, r.Dist.Count,
			us(r.MedianP50), us(r.Dist.P99), us(r.Dist.P999), us(r.Dist.Max), mark, r.Over10ms, us(r.CPUPerEcho), sb)
	}
	tw.Flush()
	if stalls > 0 {
		fmt.Fprintf(w, "\nSTALL: %d run(s) had an echo over %v or a max over 100x p50\n", stalls, bench.StallLimit)
	}
}
