package main

import (
	"context"
	"fmt"
	"io"
	"os"
	"strconv"
	"strings"

	"github.com/spf13/cobra"
	"github.com/spf13/pflag"
	"golang.org/x/sys/unix"

	"github.com/shunt-project/shunt/bench"
)

func newBenchCmd(e *env) *cobra.Command {
	c := &cobra.Command{
		Use:   "bench SCENARIO",
		Short: "Measure shunt against plain TCP and the host-local floor",
		Long: `bench runs a benchmark scenario in namespaces and a cgroup of its own and
removes them afterwards. Every size, placement and mode is measured once per
round, rounds outermost, and both ends are pinned the same way in every mode.
Numbers and method: docs/BENCHMARKS.md.`,
		Args: noArgs,
	}
	c.AddCommand(newBenchLatencyCmd(e), newBenchThroughputCmd(e), newBenchEchoCmd(e), newBenchBackpressureCmd(e), newBenchReapCmd(e), newBenchFanoutCmd(e), newBenchProxyCmd(e), newBenchUDPCmd(e))
	return c
}

// matrixFlags are the flags every scenario shares.
type matrixFlags struct {
	sizes, modes, placements, topology string
	rounds                             int
	output                             benchOutput
}

func (m *matrixFlags) register(fs *pflag.FlagSet, sizeName, sizes, modes, placements, modeHelp string) {
	fs.StringVar(&m.sizes, sizeName, sizes, "comma-separated sizes in bytes; K and M suffixes are powers of 1024")
	fs.StringVar(&m.modes, "modes", modes, "modes to compare: "+modeHelp)
	fs.StringVar(&m.placements, "placement", placements, "CPU placement: same-cpu (both on CPU 1), cross-cpu (client/sender on 0, server/receiver on 1), any-cpu (neither pinned: where the scheduler puts them)")
	fs.StringVar(&m.topology, "topology", bench.Veth, "veth (two namespaces joined by veth) or loopback (one namespace, 127.0.0.1)")
	fs.IntVar(&m.rounds, "rounds", 5, "interleaved rounds")
	m.output.flags(fs, "also write JSON, a markdown table and PNG plots to this directory")
}

func (m *matrixFlags) matrix(sizeFlag string, modes ...string) (bench.Matrix, error) {
	var mx bench.Matrix
	var err error
	if mx.Sizes, err = parseSizes(sizeFlag, m.sizes); err != nil {
		return mx, err
	}
	if mx.Modes, err = oneOf("--modes", m.modes, modes...); err != nil {
		return mx, err
	}
	if mx.Placements, err = oneOf("--placement", m.placements, bench.SameCPU, bench.CrossCPU, bench.AnyCPU); err != nil {
		return mx, err
	}
	mx.Topology, mx.Rounds = m.topology, m.rounds
	if err := mx.Validate(); err != nil {
		return mx, usageError{err}
	}
	return mx, nil
}

// parseSizes reads "14,1K,64K,2M".
func parseSizes(flag, list string) ([]int, error) {
	var out []int
	for _, v := range strings.Split(list, ",") {
		v = strings.TrimSpace(v)
		mult := 1
		switch {
		case strings.HasSuffix(v, "K"):
			mult, v = 1<<10, strings.TrimSuffix(v, "K")
		case strings.HasSuffix(v, "M"):
			mult, v = 1<<20, strings.TrimSuffix(v, "M")
		}
		n, err := strconv.Atoi(v)
		if err != nil || n < 1 {
			return nil, usageError{fmt.Errorf("%s: %q is not a size (e.g. 14,1K,64K,2M)", flag, v)}
		}
		out = append(out, n*mult)
	}
	return out, nil
}

// formatSize writes a size the way parseSizes reads it.
func formatSize(n uint64) string {
	switch {
	case n > 0 && n%(1<<20) == 0:
		return fmt.Sprintf("%dM", n>>20)
	case n > 0 && n%(1<<10) == 0:
		return fmt.Sprintf("%dK", n>>10)
	}
	return fmt.Sprint(n)
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

// runBench runs a scenario in a fresh lab, with progress on a terminal,
// prints its result as JSON or a table, and writes a report to --out.
func runBench[T any](ctx context.Context, e *env, m *matrixFlags, mx *bench.Matrix, run func(context.Context, *bench.Lab) (T, error),
	table func(io.Writer, T), report func(dir string, res T) error) error {
	l, err := bench.NewLab("shunt-bench-")
	if err != nil {
		return err
	}
	defer l.Close()
	if !m.output.json {
		mx.Progress = progress(e)
	}
	res, err := run(ctx, l)
	clearProgress(e, mx.Progress)
	if err != nil {
		return err
	}
	return emitBench(e, m.output, res, table, report)
}

// benchOutput is the --out and --json of a bench command.
type benchOutput struct {
	dir  string
	json bool
}

// flags registers --out (outHelp says what it writes) and --json.
func (o *benchOutput) flags(f *pflag.FlagSet, outHelp string) {
	f.StringVar(&o.dir, "out", "", outHelp)
	f.BoolVar(&o.json, "json", false, "print JSON")
}

// emitBench writes a benchmark's report to --out (if given) and prints its
// result as JSON or as a table.
func emitBench[T any](e *env, o benchOutput, res T, table func(io.Writer, T), report func(dir string, res T) error) error {
	if o.dir != "" {
		if err := report(o.dir, res); err != nil {
			return err
		}
	}
	if o.json {
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
