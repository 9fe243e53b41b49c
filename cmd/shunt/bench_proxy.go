package main

import (
	"fmt"
	"io"
	"os"
	"strings"
	"text/tabwriter"
	"time"

	"github.com/spf13/cobra"

	"github.com/shunt-project/shunt/bench"
	"github.com/shunt-project/shunt/bench/report"
	"github.com/shunt-project/shunt/host"
)

func newBenchProxyCmd(e *env) *cobra.Command {
	var (
		cfg                  bench.ProxyConfig
		modes, sizes, blocks string
		output               benchOutput
	)
	c := &cobra.Command{
		Use:   "proxy",
		Short: "shunt proxy in each mode against HAProxy, nginx and socat",
		Long: `proxy puts each proxy between a client and an upstream in a namespace of
its own, the proxy on CPU 0, client and upstream on CPU 1, and measures
request/response latency (one request at a time, the upstream echoes it) and
bulk throughput (client to upstream). Proxies run interleaved, --rounds
times, the order rotating. CPU per GB is the whole machine's (kernel
forwarding runs in softirq and kworkers) and the proxy processes' own.

HAProxy runs with option splice-auto, nginx with its stream module, socat
with fork; each is left out with a clear message if it is not installed.
shunt-shortcut is shunt-kernel with the client, the proxy and the upstream
in a cgroup a private bypass install is enabled for (trusting readers: the
benchmark's peers read with blocking calls), so that the client's bytes go
straight to the upstream's socket and back, passing the join by.
"direct" is no proxy at all: the client connects to the upstream, the floor
a proxy that joins sockets in the kernel can approach.`,
		Example: `  shunt bench proxy --out /tmp/proxy
  shunt bench proxy --modes shunt-kernel,haproxy --blocks 2M --rounds 5`,
		Args: noArgs,
		RunE: func(c *cobra.Command, _ []string) error {
			var err error
			if cfg.Modes, err = oneOf("--modes", modes, bench.ProxyModes...); err != nil {
				return err
			}
			if sizes != "" {
				if cfg.Sizes, err = parseSizes("--sizes", sizes); err != nil {
					return err
				}
			}
			if blocks != "" {
				if cfg.Blocks, err = parseSizes("--blocks", blocks); err != nil {
					return err
				}
			}
			if cfg.Rounds < 1 || cfg.Requests < 1 || cfg.BulkTime <= 0 {
				return usageError{fmt.Errorf("--rounds, --requests and --bulk-time must be positive")}
			}
			if err := host.CheckPrivileges(); err != nil {
				return err
			}
			if cfg.Shunt, err = os.Executable(); err != nil {
				return err
			}
			progress := io.Discard
			if !output.json {
				progress = e.stderr
			}
			res, err := bench.RunProxy(c.Context(), cfg, progress)
			if err != nil {
				return err
			}
			return emitBench(e, output, res, printProxy, report.Proxy)
		},
	}
	f := c.Flags()
	f.StringVar(&modes, "modes", strings.Join(bench.ProxyModes, ","), "proxies: "+strings.Join(bench.ProxyModes, ", "))
	f.StringVar(&sizes, "sizes", "64,16K", `request/response sizes ("" for none)`)
	f.StringVar(&blocks, "blocks", "16K,2M", `bulk write sizes ("" for none)`)
	f.IntVar(&cfg.Rounds, "rounds", 3, "interleaved rounds")
	f.IntVar(&cfg.Requests, "requests", 20000, "round trips per request/response run (at most)")
	f.DurationVar(&cfg.MaxTime, "max-time", 5*time.Second, "a request/response run stops after this long")
	f.DurationVar(&cfg.BulkTime, "bulk-time", 2*time.Second, "sending time per bulk run")
	output.flags(f, "write proxy.md, proxy.json and plots to this directory")
	return c
}

func printProxy(out io.Writer, res []bench.ProxyResult) {
	w := tabwriter.NewWriter(out, 0, 4, 2, ' ', tabwriter.AlignRight)
	fmt.Fprintln(w, "proxy\ttest\tsize\tp50\tp99\tmax\tGbit/s\tover 10ms\tmachine s/GB\tproxy s/GB\tin kernel\t")
	for _, r := range res {
		if r.Test == "rr" {
			fmt.Fprintf(w, "%s\trr\t%d\t%v\t%v\t%v\t\t%d\t%.2f\t%.2f\t\t\n", r.Mode, r.Size, r.Dist.P50, r.Dist.P99, r.Dist.Max, r.Over10ms, r.MachineCPUPerGB, r.ProxyCPUPerGB)
		} else {
			fmt.Fprintf(w, "%s\tbulk\t%d\t\t\t\t%.2f\t%d\t%.2f\t%.2f\t%s\t\n", r.Mode, r.Size, r.Gbps, r.Over10ms, r.MachineCPUPerGB, r.ProxyCPUPerGB, kernelShare(r))
		}
	}
	w.Flush()
}

func kernelShare(r bench.ProxyResult) string {
	if len(r.RoundKernelShare) == 0 {
		return ""
	}
	return fmt.Sprintf("%.0f%%", 100*r.KernelShare)
}
