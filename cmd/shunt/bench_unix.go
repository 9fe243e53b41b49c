package main

import (
	"fmt"
	"io"
	"text/tabwriter"

	"github.com/spf13/cobra"

	"github.com/shunt-project/shunt/bench"
	"github.com/shunt-project/shunt/bench/report"
	"github.com/shunt-project/shunt/host"
)

func newBenchUnixCmd(e *env) *cobra.Command {
	var (
		cfg bench.UnixConfig
		f   sweepFlags
	)
	c := &cobra.Command{
		Use:   "unix",
		Short: "A unix stream socket joined with a TCP one against a copy loop",
		Long: `unix measures what 'shunt splice' and the daemon do for a sidecar: its
application's unix stream socket joined with its TCP connection out (kernel:
TCP to unix forwarded by the kernel, unix to TCP copied by shunt), against a
copy loop, a goroutine per direction (copy). The application and the TCP
echo server run on CPU 1; the middle's goroutines are not pinned in either
mode. For each size and mode (interleaved,
--rounds times): --requests round trips of that size (p50, p99, p99.9, max),
then --bulk-time of the server sending to the application as fast as it can
(Gbit/s, whole-machine CPU per GB, share moved by the kernel).`,
		Example: `  shunt bench unix --sizes 64,16K --out /tmp/unix`,
		Args:    noArgs,
		RunE: func(c *cobra.Command, _ []string) error {
			var err error
			if cfg.Sizes, cfg.Modes, err = f.parse(); err != nil {
				return err
			}
			cfg.Requests, cfg.BulkTime, cfg.Rounds, cfg.Progress = f.requests, f.bulkTime, f.rounds, f.progress(e)
			if err := cfg.Check(); err != nil {
				return usageError{err}
			}
			if err := host.CheckPrivileges(); err != nil {
				return err
			}
			res, err := bench.RunUnix(c.Context(), cfg)
			if err != nil {
				return err
			}
			return emitBench(e, res, f.out, f.asJSON, printUnix, report.Unix)
		},
	}
	f.register(c.Flags(), "unix", "64,16K", "request and response sizes", bench.UnixModes, "kernel (joined by shunt), copy (user space)")
	return c
}

func printUnix(out io.Writer, res []bench.UnixResult) {
	w := tabwriter.NewWriter(out, 0, 4, 2, ' ', tabwriter.AlignRight)
	fmt.Fprintln(w, "mode\tsize\tp50\tp99\tmax\tbulk Gbit/s\tCPU s/GB\tby kernel\t")
	for _, r := range res {
		fmt.Fprintf(w, "%s\t%d\t%v\t%v\t%v\t%.2f\t%.2f\t%.0f%%\t\n", r.Mode, r.Size, r.RoundTrip.P50, r.RoundTrip.P99, r.RoundTrip.Max,
			r.Gbps, r.CPUPerGB, 100*r.KernelShare)
	}
	w.Flush()
}
