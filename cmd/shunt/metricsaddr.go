package main

import (
	"context"
	"fmt"
	"net"

	"github.com/prometheus/client_golang/prometheus"
	"github.com/spf13/cobra"

	"github.com/shunt-project/shunt/metrics"
)

// metricsAddrFlag adds --metrics-addr to a long-running command (proxy,
// daemon, fanout): where it serves its own counters to Prometheus.
func metricsAddrFlag(c *cobra.Command, addr *string) {
	c.Flags().StringVar(addr, "metrics-addr", "", `serve this process's counters to Prometheus at http://HOST:PORT/metrics ("" for none; docs/METRICS.md)`)
}

// checkMetricsAddr rejects a --metrics-addr that is not HOST:PORT before
// anything is set up.
func checkMetricsAddr(addr string) error {
	if addr == "" {
		return nil
	}
	if _, _, err := net.SplitHostPort(addr); err != nil {
		return usageError{fmt.Errorf("--metrics-addr %q: want HOST:PORT, e.g. 127.0.0.1:9465", addr)}
	}
	return nil
}

// serveProcessMetrics serves c at addr (nothing if addr is "") until stop.
func serveProcessMetrics(e *env, addr string, c prometheus.Collector) (stop func() error, err error) {
	if addr == "" {
		return func() error { return nil }, nil
	}
	ln, err := net.Listen("tcp", addr)
	if err != nil {
		return nil, fmt.Errorf("--metrics-addr: %w", err)
	}
	fmt.Fprintf(e.stderr, "shunt: serving metrics at http://%s/metrics\n", ln.Addr())
	ctx, cancel := context.WithCancel(context.Background())
	done := make(chan error, 1)
	h := metrics.Handler(metrics.ProcessRegistry(version, c), e.stderr)
	go func() { done <- metrics.Serve(ctx, ln, h) }()
	return func() error {
		cancel()
		return <-done
	}, nil
}
