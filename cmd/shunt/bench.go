package main

import (
	"context"
	"fmt"
	"io"
	"os"
	"strings"
	"text/tabwriter"
	"time"

	"github.com/spf13/cobra"
	"golang.org/x/sys/unix"

	"github.com/shunt-project/shunt/bench"
)

func newBenchCmd(e *env) *cobra.Command {
	c := &cobra.Command{
		Use:   "bench SCENARIO",
		Short: "Measure shunt against plain TCP and the host-local floor",
		Long: `bench runs a benchmark scenario in namespaces and a cgroup of its own and
removes them afterwards. Modes are interleaved round by round and both ends
are pinned the same way in every mode. Numbers: docs/BENCHMARKS.md.`,
		Args: noArgs,
	}
	c.AddCommand(newBenchLatencyCmd(e), newBenchThroughputCmd(e))
	return c
}

func newBenchLatencyCmd(e *env) *cobra.Command {
	var (
		cfg        bench.LatencyConfig
		modes      string
		placements string
		asJSON     bool
	)
	c := &cobra.Command{
		Use:   "latency",
		Short: "Request/response ping-pong between two namespaces joined by veth",
		Long: `latency sends a message, waits for the same size back, and times each round
trip, over plain TCP, over the same TCP connection bypassed by shunt, and over
an AF_UNIX socketpair (the floor for host-local). CPU is the whole machine's,
from /proc/stat, divided by round trips.`,
		Example: `  shunt bench latency --size 14 --rounds 5 --count 20000`,
		Args:    noArgs,
		RunE: func(c *cobra.Command, _ []string) error {
			var err error
			if cfg.Modes, err = oneOf("--modes", modes, bench.ModeTCP, bench.ModeShunt, bench.ModeUnix, bench.ModeBare); err != nil {
				return err
			}
			if cfg.Placements, err = oneOf("--placement", placements, bench.SameCPU, bench.CrossCPU); err != nil {
				return err
			}
			if cfg.Size < 1 || cfg.Count < 1 || cfg.Rounds < 1 || cfg.Warmup < 0 {
				return usageError{fmt.Errorf("--size, --count and --rounds must be at least 1")}
			}
			return runBench(c.Context(), e, asJSON, func(ctx context.Context, l *bench.Lab, p func(string)) ([]bench.LatencyResult, error) {
				cfg.Progress = p
				return bench.RunLatency(ctx, l, cfg)
			}, printLatency)
		},
	}
	c.Flags().IntVar(&cfg.Size, "size", 14, "message size in bytes, each way")
	c.Flags().IntVar(&cfg.Count, "count", 20000, "round trips measured per round and mode")
	c.Flags().IntVar(&cfg.Warmup, "warmup", 1000, "round trips before measuring")
	c.Flags().IntVar(&cfg.Rounds, "rounds", 5, "interleaved rounds")
	c.Flags().StringVar(&modes, "modes", "tcp,shunt,unix", "modes to compare: tcp, shunt, unix, shunt-bare (shunt's pairing, redirect without checks)")
	c.Flags().StringVar(&placements, "placement", "same-cpu,cross-cpu", "CPU placement: same-cpu (both on CPU 1), cross-cpu (client 0, server 1)")
	c.Flags().BoolVar(&asJSON, "json", false, "print JSON")
	return c
}

// oneOf splits a comma list and checks each item is allowed.
func oneOf(flag, list string, allowed ...string) ([]string, error) {
	var out []string
	for _, v := range strings.Split(list, ",") {
		v = strings.TrimSpace(v)
		ok := false
		for _, a := range allowed {
			ok = ok || v == a
		}
		if !ok {
			return nil, usageError{fmt.Errorf("%s: unknown value %q (choose from %s)", flag, v, strings.Join(allowed, ", "))}
		}
		out = append(out, v)
	}
	return out, nil
}

func us(d time.Duration) string { return fmt.Sprintf("%.1f", float64(d)/1e3) }

func printLatency(w io.Writer, res []bench.LatencyResult) {
	tw := tabwriter.NewWriter(w, 0, 4, 2, ' ', tabwriter.AlignRight)
	fmt.Fprintln(tw, "placement\tmode\tp50 us\tp99 us\tp99.9 us\tmax us\tround trips/s\tCPU us/RT\tp50 vs tcp\t")
	stalls, eagain := 0, 0
	for _, r := range res {
		eagain += r.SpuriousEAGAIN
		ratio := "-"
		if r.RatioToTCP > 0 {
			ratio = fmt.Sprintf("%.2f", r.RatioToTCP)
		}
		mark := ""
		if r.Stalled {
			mark = " STALL"
			stalls++
		}
		fmt.Fprintf(tw, "%s\t%s\t%s\t%s\t%s\t%s%s\t%.0f\t%s\t%s\t\n", r.Placement, r.Mode, us(r.MedianP50), us(r.Dist.P99),
			us(r.Dist.P999), us(r.Dist.Max), mark, r.RoundTripsPS, us(r.CPUPerRT), ratio)
	}
	tw.Flush()
	if len(res) > 0 {
		fmt.Fprintf(w, "\n%d-byte messages, %d round trips per mode and placement; p50 is the median of the rounds' p50s, other percentiles pool all rounds.\n",
			res[0].Size, res[0].Dist.Count)
	}
	if eagain > 0 {
		fmt.Fprintf(w, "EAGAIN: %d blocking read(s) of bypassed sockets failed with EAGAIN after a signal (a kernel difference from TCP, docs/ARCHITECTURE.md); retried\n", eagain)
	}
	if stalls > 0 {
		fmt.Fprintf(w, "STALL: %d run(s) had a round trip over %v or a max over 100x p50\n", stalls, bench.StallLimit)
	}
}

// runBench runs a scenario in a fresh lab, with progress on a terminal, and
// prints its result as JSON or as a table.
func runBench[T any](ctx context.Context, e *env, asJSON bool, run func(context.Context, *bench.Lab, func(string)) (T, error), table func(io.Writer, T)) error {
	l, err := bench.NewLab("shunt-bench-")
	if err != nil {
		return err
	}
	defer l.Close()
	var p func(string)
	if !asJSON {
		p = progress(e)
	}
	res, err := run(ctx, l, p)
	clearProgress(e, p)
	if err != nil {
		return err
	}
	if asJSON {
		return writeJSON(e.stdout, res)
	}
	table(e.stdout, res)
	return nil
}

// progress returns a one-line progress display on a terminal, or nil.
func progress(e *env) func(string) {
	if !isTerminal(e.stderr) {
		return nil
	}
	return func(s string) { fmt.Fprintf(e.stderr, "\r\033[K%s", s) }
}

func clearProgress(e *env, p func(string)) {
	if p != nil {
		fmt.Fprint(e.stderr, "\r\033[K")
	}
}

// isTerminal reports whether w is a terminal (progress lines go only there).
func isTerminal(w io.Writer) bool {
	f, ok := w.(*os.File)
	if !ok {
		return false
	}
	_, err := unix.IoctlGetTermios(int(f.Fd()), unix.TCGETS)
	return err == nil
}
