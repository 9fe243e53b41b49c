package main

import (
	"fmt"
	"io"
	"strconv"
	"strings"
	"text/tabwriter"

	"github.com/spf13/cobra"

	"github.com/shunt-project/shunt/bench"
	"github.com/shunt-project/shunt/bench/report"
	"github.com/shunt-project/shunt/fanout"
	"github.com/shunt-project/shunt/host"
)

func newBenchFanoutCmd(e *env) *cobra.Command {
	var (
		cfg                             bench.FanoutConfig
		sizes, rates, subs, paths, slow string
		output                          benchOutput
	)
	c := &cobra.Command{
		Use:   "fanout",
		Short: "One UDP feed to N TCP subscribers: delivery latency and CPU per path",
		Long: `fanout measures 'shunt fanout' as the Kylin talk did: the source stamps
each message with its send time and every subscriber takes the delivery
latency, pooled over all subscribers. For every message size, rate and
subscriber count it runs each data path (interleaved, --rounds times) for
--duration, with the relay loop on CPU 0 and the source and all subscribers
(read by one epoll thread) on CPU 1. CPU is the whole machine's, per GB
delivered to subscribers.`,
		Example: `  shunt bench fanout --subscribers 1,10,100,1000 --out /tmp/fanout`,
		Args:    noArgs,
		RunE: func(c *cobra.Command, _ []string) error {
			ints := func(flag, list string, lo int) ([]int, error) {
				var v []int
				for _, f := range strings.Split(list, ",") {
					n, err := strconv.Atoi(strings.TrimSpace(f))
					if err != nil || n < lo {
						return nil, usageError{fmt.Errorf("%s: %q is not a number of at least %d", flag, f, lo)}
					}
					v = append(v, n)
				}
				return v, nil
			}
			var err error
			if cfg.Sizes, err = ints("--sizes", sizes, 16); err != nil {
				return err
			}
			if cfg.Rates, err = ints("--rates", rates, 1); err != nil {
				return err
			}
			if cfg.Subscribers, err = ints("--subscribers", subs, 1); err != nil {
				return err
			}
			if cfg.Slow, err = ints("--slow", slow, 0); err != nil {
				return err
			}
			for _, p := range strings.Split(paths, ",") {
				path, err := fanout.ParsePath(strings.TrimSpace(p))
				if err != nil {
					return usageError{fmt.Errorf("--paths: %w", err)}
				}
				cfg.Paths = append(cfg.Paths, path)
			}
			if cfg.Rounds < 1 || cfg.Duration <= 0 {
				return usageError{fmt.Errorf("--rounds and --duration must be positive")}
			}
			if err := host.CheckPrivileges(); err != nil {
				return err
			}
			if !output.json {
				cfg.Progress = e.stderr
			}
			res, err := bench.RunFanout(c.Context(), cfg)
			if err != nil {
				return err
			}
			return emitBench(e, output, res, printFanout, report.Fanout)
		},
	}
	c.Flags().StringVar(&sizes, "sizes", "100,1400", "message sizes in bytes (at least 16)")
	c.Flags().StringVar(&rates, "rates", "10000,100000", "messages per second from the source")
	c.Flags().StringVar(&subs, "subscribers", "1,10,100,1000", "subscriber counts")
	c.Flags().StringVar(&paths, "paths", "batch,uring,per-message,zerocopy,kernel", "data paths: batch, uring, per-message, kernel, zerocopy")
	c.Flags().StringVar(&slow, "slow", "0", "extra subscribers that never read, one run per value (e.g. 0,1): what a stalled subscriber costs the others")
	c.Flags().DurationVar(&cfg.Duration, "duration", 1e9, "sending time per run")
	c.Flags().IntVar(&cfg.Rounds, "rounds", 3, "interleaved rounds")
	output.flags(c.Flags(), "write fanout.md, fanout.json and fanout.png to this directory")
	return c
}

func printFanout(out io.Writer, res []bench.FanoutResult) {
	w := tabwriter.NewWriter(out, 0, 4, 2, ' ', tabwriter.AlignRight)
	fmt.Fprintln(w, "path\tsize\trate\tsubs\tslow\tdelivered\tundelivered\tp50\tp99\tmax\tCPU s/GB\t")
	for _, r := range res {
		fmt.Fprintf(w, "%s\t%d\t%d\t%d\t%d\t%d\t%d\t%v\t%v\t%v\t%.2f\t\n", r.Path, r.Size, r.Rate, r.Subscribers, r.Slow, r.Delivered, r.Undelivered,
			r.Latency.P50, r.Latency.P99, r.Latency.Max, r.CPUPerGB)
	}
	w.Flush()
}
