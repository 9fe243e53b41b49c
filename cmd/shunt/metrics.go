package main

import (
	"fmt"
	"net"
	"net/http/httptest"

	"github.com/spf13/cobra"

	"github.com/shunt-project/shunt/host"
	"github.com/shunt-project/shunt/metrics"
)

func newMetricsCmd(e *env, g *globals) *cobra.Command {
	var listen string
	var once bool
	c := &cobra.Command{
		Use:   "metrics [--listen ADDR] [--once]",
		Short: "Serve bypass's and the index's counters to Prometheus",
		Long: `metrics serves Prometheus metrics at http://ADDR/metrics until interrupted:
what bypass and the socket index have counted (read from their pins at each
scrape, so enabling or disabling them needs no restart), the maps' fill,
whether a guard runs, and this build's version and the kernel's mechanisms.
docs/METRICS.md lists every metric. --once prints one scrape and exits.`,
		Example: `  shunt metrics                              # http://127.0.0.1:9464/metrics
  shunt metrics --listen :9464               # every address: mind who may read it
  shunt metrics --once | grep connections_paired`,
		Args: noArgs,
		RunE: func(c *cobra.Command, _ []string) error {
			if err := host.CheckPrivileges(); err != nil {
				return err
			}
			src := metrics.Source{PinDir: g.pinDir, IndexDir: g.indexDir, PolicyDir: g.policyDir, Version: version, Features: e.probe()}
			h := metrics.Handler(metrics.Registry(src), e.stderr)
			if once {
				rec := httptest.NewRecorder()
				h.ServeHTTP(rec, httptest.NewRequest("GET", "/metrics", nil))
				_, err := e.stdout.Write(rec.Body.Bytes())
				return err
			}
			if _, _, err := net.SplitHostPort(listen); err != nil {
				return usageError{fmt.Errorf("--listen %q: want HOST:PORT, e.g. 127.0.0.1:9464", listen)}
			}
			ln, err := net.Listen("tcp", listen)
			if err != nil {
				return err
			}
			fmt.Fprintf(e.stderr, "shunt: serving metrics at http://%s/metrics\n", ln.Addr())
			return metrics.Serve(c.Context(), ln, h)
		},
	}
	c.Flags().StringVar(&listen, "listen", "127.0.0.1:9464", "address to serve /metrics on")
	c.Flags().BoolVar(&once, "once", false, "print one scrape to stdout and exit")
	return c
}
