package metrics

import (
	"runtime"

	"github.com/prometheus/client_golang/prometheus"
	"github.com/prometheus/client_golang/prometheus/collectors"
)

// ProcessRegistry holds a process's collector (proxy.Collector, daemon.Collector, fanout.Collector), its
// build and the Go runtime's and process's own metrics.
func ProcessRegistry(version string, c prometheus.Collector) *prometheus.Registry {
	r := prometheus.NewRegistry()
	build := prometheus.NewGauge(prometheus.GaugeOpts{Name: "shunt_build_info", Help: "This shunt's version and the Go it was built with.",
		ConstLabels: prometheus.Labels{"version": version, "goversion": runtime.Version()}})
	build.Set(1)
	r.MustRegister(c, build, collectors.NewGoCollector(), collectors.NewProcessCollector(collectors.ProcessCollectorOpts{}))
	return r
}
