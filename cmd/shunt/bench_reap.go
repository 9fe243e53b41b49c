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
	"github.com/shunt-project/shunt/host"
)

func newBenchReapCmd(e *env) *cobra.Command {
	var (
		cfg          bench.ReapConfig
		sizes, proto string
		output       benchOutput
	)
	c := &cobra.Command{
		Use:   "reap",
		Short: "Destroy a backend's sockets among up to a million: index against iterators",
		Long: `reap reproduces the table of the RFC "bpf: Efficient socket destruction":
sockets spread over --netns namespaces, of which --victims are connected to
the backend that goes away (127.0.0.1:9999 in several namespaces) and the rest
elsewhere. At each size it reaps with the index (exact SOCK_DESTROY) and with
iterators (iter/tcp or iter/udp + bpf_sock_destroy in every namespace),
interleaved, --rounds times, and reports medians. Sizes build on each other,
UDP first, then TCP. A million TCP sockets take a few GiB of kernel memory.`,
		Example: `  shunt bench reap --sizes 100,1000,10000,100000,1000000 --out /tmp/reap`,
		Args:    noArgs,
		RunE: func(c *cobra.Command, _ []string) error {
			for _, s := range strings.Split(sizes, ",") {
				n, err := strconv.Atoi(strings.TrimSpace(s))
				if err != nil || n <= cfg.Victims {
					return usageError{fmt.Errorf("--sizes: %q is not a socket count above --victims (%d)", s, cfg.Victims)}
				}
				cfg.Sizes = append(cfg.Sizes, n)
			}
			for _, p := range strings.Split(proto, ",") {
				if p != "udp" && p != "tcp" {
					return usageError{fmt.Errorf("--proto: %q is not udp or tcp", p)}
				}
				cfg.Protos = append(cfg.Protos, p)
			}
			if cfg.Netns < 1 || cfg.Victims < 1 || cfg.Rounds < 1 || cfg.VictimNetns < 0 {
				return usageError{fmt.Errorf("--netns, --victims and --rounds must be positive, --victim-netns not negative")}
			}
			if err := host.CheckPrivileges(); err != nil {
				return err
			}
			prog := io.Discard
			if !output.json {
				prog = e.stderr
			}
			res, err := bench.RunReap(c.Context(), cfg, prog)
			if err != nil {
				return err
			}
			return emitBench(e, output, res, printReapBench, report.Reap)
		},
	}
	c.Flags().StringVar(&sizes, "sizes", "100,1000,10000,100000", "sockets on the host at each step (1000000 works; give it memory)")
	c.Flags().IntVar(&cfg.Netns, "netns", 100, "namespaces the sockets are spread over")
	c.Flags().IntVar(&cfg.Victims, "victims", 10, "sockets connected to the backend that is reaped")
	c.Flags().IntVar(&cfg.VictimNetns, "victim-netns", 0, "namespaces the victims are spread over (default: one victim per namespace)")
	c.Flags().StringVar(&proto, "proto", "udp,tcp", "protocols, in order")
	c.Flags().IntVar(&cfg.Rounds, "rounds", 5, "reaps per method and size (interleaved)")
	output.flags(c.Flags(), "write reap.md, reap.json and reap.png to this directory")
	return c
}

func printReapBench(out io.Writer, res []bench.ReapResult) {
	w := tabwriter.NewWriter(out, 0, 4, 2, ' ', tabwriter.AlignRight)
	fmt.Fprintln(w, "proto\tsockets\tmethod\tdestroyed\tmissed\tmedian\tmin\tmax\t")
	for _, r := range res {
		fmt.Fprintf(w, "%s\t%d\t%s\t%d\t%d\t%v\t%v\t%v\t\n", r.Proto, r.Sockets, r.Method, r.Destroyed, r.Missed, r.Took, r.Min, r.Max)
	}
	w.Flush()
	for _, r := range res {
		for _, f := range r.Failed {
			fmt.Fprintf(out, "%s %s at %d sockets failed: %s\n", r.Proto, r.Method, r.Sockets, f)
		}
	}
}
