package main

import (
	"fmt"
	"time"

	"github.com/spf13/cobra"

	"github.com/shunt-project/shunt/bench"
)

func newDemoCmd(e *env) *cobra.Command {
	var (
		rounds   int
		count    int
		duration time.Duration
	)
	c := &cobra.Command{
		Use:   "demo",
		Short: "Show what bypass does, on this host, in under a minute",
		Long: `demo makes two network namespaces joined by veth and a cgroup, then
measures request/response latency and bulk throughput between them over plain
TCP and with shunt bypass, in interleaved rounds, and prints the comparison.
It needs root and nothing else, and removes everything it made, also on
Ctrl-C or failure. For the full method see 'shunt bench --help'.`,
		Args: noArgs,
		RunE: func(c *cobra.Command, _ []string) error {
			if rounds < 1 || count < 1 || duration <= 0 {
				return usageError{fmt.Errorf("--rounds, --count and --duration must be positive")}
			}
			l, err := bench.NewLab("shunt-demo-")
			if err != nil {
				return err
			}
			defer l.Close()
			fmt.Fprintf(e.stdout, "shunt demo: client and server in two network namespaces joined by veth, one cgroup;\nplain TCP vs shunt bypass, %d interleaved rounds.\n\n", rounds)

			p := progress(e)
			lat, err := bench.RunLatency(c.Context(), l, bench.LatencyConfig{
				Matrix: bench.Matrix{Rounds: rounds, Sizes: []int{14}, Topology: bench.Veth, Progress: p,
					Modes: []string{bench.ModeTCP, bench.ModeShunt}, Placements: []string{bench.SameCPU, bench.CrossCPU}},
				Count: count, Warmup: count / 10,
			})
			clearProgress(e, p)
			if err != nil {
				return err
			}
			fmt.Fprintln(e.stdout, "Latency: 14-byte request and response")
			printLatency(e.stdout, lat)

			thr, err := bench.RunThroughput(c.Context(), l, bench.ThroughputConfig{
				Matrix: bench.Matrix{Rounds: rounds, Sizes: []int{64 << 10}, Topology: bench.Veth, Progress: p,
					Modes: []string{bench.ModeTCP, bench.ModeShunt}, Placements: []string{bench.CrossCPU, bench.AnyCPU}},
				Duration: duration,
			})
			clearProgress(e, p)
			if err != nil {
				return err
			}
			fmt.Fprintln(e.stdout, "\nThroughput: one-way stream of 64 KiB writes; cross-cpu: sender on CPU 0, receiver on CPU 1;\nany-cpu: neither pinned, where the scheduler puts them (as programs run)")
			printThroughput(e.stdout, thr)
			fmt.Fprintln(e.stdout, "\nEverything the demo made is removed. Turn bypass on for real: shunt bypass enable --help")
			return nil
		},
	}
	c.Flags().IntVar(&rounds, "rounds", 3, "interleaved rounds")
	c.Flags().IntVar(&count, "count", 5000, "round trips per latency round and mode")
	c.Flags().DurationVar(&duration, "duration", time.Second, "sender time per throughput round and mode")
	return c
}
