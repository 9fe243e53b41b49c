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
	var listen, tokenFile string
	var once bool
	c := &cobra.Command{
		Use:   "metrics [--listen ADDR] [--token-file FILE] [--once]",
		Short: "Serve bypass's and the index's counters to Prometheus",
		Long: `metrics serves Prometheus metrics at http://ADDR/metrics until interrupted:
what bypass and the socket index have counted (read from their pins at each
scrape, so enabling or disabling them needs no restart), the maps' fill,
whether a guard runs, and this build's version and the kernel's mechanisms.
docs/METRICS.md lists every metric. --once prints one scrape and exits.

The metrics name every policy rule and cgroup path, and any local user can
reach a loopback port: --token-file makes every scrape send that file's
token (Authorization: Bearer; Prometheus: authorization.credentials_file).`,
		Example: `  shunt metrics                              # http://127.0.0.1:9464/metrics
  shunt metrics --listen :9464               # every address: mind who may read it
  shunt metrics --token-file /etc/shunt/metrics-token   # scrapes must send the token
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
			var token string
			if tokenFile != "" {
				var err error
				if token, err = metrics.ReadToken(tokenFile); err != nil {
					return usageError{fmt.Errorf("--token-file: %w", err)}
				}
			}
			h = metrics.RequireToken(h, token)
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
	c.Flags().StringVar(&tokenFile, "token-file", "", "a file (mode 600) holding a bearer token every scrape must send")
	return c
}
