package metrics

import (
	"runtime"

	"github.com/prometheus/client_golang/prometheus"
	"github.com/prometheus/client_golang/prometheus/collectors"

	"github.com/shunt-project/shunt/daemon"
	"github.com/shunt-project/shunt/fanout"
	"github.com/shunt-project/shunt/proxy"
)

// stat is one number of a process's stats snapshot S.
type stat[S any] struct {
	name, help string
	kind       prometheus.ValueType
	value      func(S) float64
}

// snapshot exports the stats of a running proxy, daemon or forwarder: one
// snapshot per scrape, each number taken from it.
type snapshot[S any] struct {
	read  func() (S, error)
	stats []stat[S]
	descs []*prometheus.Desc
	fail  *prometheus.Desc
}

func newSnapshot[S any](subsystem string, read func() (S, error), stats []stat[S]) *snapshot[S] {
	c := &snapshot[S]{read: read, stats: stats,
		fail: prometheus.NewDesc(prometheus.BuildFQName("shunt", subsystem, "scrape_errors"), "1 where reading the "+subsystem+"'s stats failed during this scrape (the reason is logged).", nil, nil)}
	for _, s := range stats {
		c.descs = append(c.descs, prometheus.NewDesc(prometheus.BuildFQName("shunt", subsystem, s.name), s.help, nil, nil))
	}
	return c
}

func (c *snapshot[S]) Describe(ch chan<- *prometheus.Desc) {
	for _, d := range c.descs {
		ch <- d
	}
	ch <- c.fail
}

func (c *snapshot[S]) Collect(ch chan<- prometheus.Metric) {
	st, err := c.read()
	if err != nil {
		ch <- prometheus.NewInvalidMetric(c.fail, err)
		ch <- prometheus.MustNewConstMetric(c.fail, prometheus.GaugeValue, 1)
		return
	}
	ch <- prometheus.MustNewConstMetric(c.fail, prometheus.GaugeValue, 0)
	for i, s := range c.stats {
		ch <- prometheus.MustNewConstMetric(c.descs[i], s.kind, s.value(st))
	}
}

const (
	counterValue = prometheus.CounterValue
	gaugeValue   = prometheus.GaugeValue
)

// Proxy exports a running TCP proxy's stats (`shunt proxy --metrics-addr`).
func Proxy(stats func() proxy.Stats) prometheus.Collector {
	return newSnapshot("proxy", func() (proxy.Stats, error) { return stats(), nil }, []stat[proxy.Stats]{
		{"connections_accepted_total", "Client connections accepted.", counterValue, func(s proxy.Stats) float64 { return float64(s.Accepted) }},
		{"connections_active", "Client connections open now.", gaugeValue, func(s proxy.Stats) float64 { return float64(s.Active) }},
		{"connections_refused_total", "Client connections closed because no upstream would take them.", counterValue, func(s proxy.Stats) float64 { return float64(s.Refused) }},
		{"connections_failed_total", "Connections ended by a reset or an error.", counterValue, func(s proxy.Stats) float64 { return float64(s.Failed) }},
		{"bytes_up_total", "Bytes from clients to upstreams, of ended connections.", counterValue, func(s proxy.Stats) float64 { return float64(s.Up) }},
		{"bytes_down_total", "Bytes from upstreams to clients, of ended connections.", counterValue, func(s proxy.Stats) float64 { return float64(s.Down) }},
		{"bytes_kernel_total", "Of those bytes, the ones the kernel moved (mode kernel).", counterValue, func(s proxy.Stats) float64 { return float64(s.Kernel) }},
		{"directions_in_kernel", "Directions of open connections the kernel forwards now (mode kernel; the rest are paced through user space).", gaugeValue, func(s proxy.Stats) float64 { return float64(s.InKernel) }},
		{"directions_throttled_total", "Times flow control gave a direction to user space, of ended connections (mode kernel).", counterValue, func(s proxy.Stats) float64 { return float64(s.Throttled) }},
	})
}

// UDPProxy exports a running UDP proxy's stats (`shunt proxy --udp --metrics-addr`).
func UDPProxy(stats func() proxy.UDPStats) prometheus.Collector {
	return newSnapshot("proxy_udp", func() (proxy.UDPStats, error) { return stats(), nil }, []stat[proxy.UDPStats]{
		{"flows_total", "Client flows seen.", counterValue, func(s proxy.UDPStats) float64 { return float64(s.Flows) }},
		{"flows_active", "Client flows open now.", gaugeValue, func(s proxy.UDPStats) float64 { return float64(s.Active) }},
		{"flows_refused_total", "Flows over --max-conns, or whose upstream could not be reached.", counterValue, func(s proxy.UDPStats) float64 { return float64(s.Refused) }},
		{"flows_upstream_refused_total", "Flows whose upstream refused a datagram (ICMP port unreachable).", counterValue, func(s proxy.UDPStats) float64 { return float64(s.UpstreamRefused) }},
		{"datagrams_up_total", "Datagrams from clients to upstreams.", counterValue, func(s proxy.UDPStats) float64 { return float64(s.Up) }},
		{"datagrams_down_total", "Datagrams from upstreams to clients.", counterValue, func(s proxy.UDPStats) float64 { return float64(s.Down) }},
		{"datagrams_kernel_total", "Of those datagrams, the ones the kernel moved (mode kernel).", counterValue, func(s proxy.UDPStats) float64 { return float64(s.Kernel) }},
		{"datagrams_dropped_total", "Datagrams dropped.", counterValue, func(s proxy.UDPStats) float64 { return float64(s.Dropped) }},
	})
}

// Daemon exports a running splice daemon's counts (`shunt daemon --metrics-addr`).
func Daemon(totals func() daemon.Totals) prometheus.Collector {
	return newSnapshot("daemon", func() (daemon.Totals, error) { return totals(), nil }, []stat[daemon.Totals]{
		{"pairs_joined_total", "Socket pairs joined by this daemon (TCP and UDP).", counterValue, func(t daemon.Totals) float64 { return float64(t.Joined) }},
		{"pairs", "Socket pairs held now, including ones taken over from a previous daemon.", gaugeValue, func(t daemon.Totals) float64 { return float64(t.Open) }},
		{"pairs_ended_total", "TCP pairs that ended and UDP pairs closed.", counterValue, func(t daemon.Totals) float64 { return float64(t.Ended) }},
		{"pairs_failed_total", "Pairs ended by a reset or an error.", counterValue, func(t daemon.Totals) float64 { return float64(t.Failed) }},
		{"pairs_closed_total", "Pairs closed by a client's request (a TCP pair is reset).", counterValue, func(t daemon.Totals) float64 { return float64(t.Closed) }},
		{"bytes_total", "Bytes moved both ways, by ended and open pairs.", counterValue, func(t daemon.Totals) float64 { return float64(t.Bytes) }},
		{"bytes_kernel_total", "Of those bytes, the ones the kernel moved.", counterValue, func(t daemon.Totals) float64 { return float64(t.Kernel) }},
		{"datagrams_dropped_total", "UDP datagrams dropped at a pair's bound.", counterValue, func(t daemon.Totals) float64 { return float64(t.Dropped) }},
	})
}

// Fanout exports a running forwarder's totals (`shunt fanout --metrics-addr`).
// read takes a snapshot from the forwarder's event loop (fanout.Query).
func Fanout(read func() (fanout.Stats, error)) prometheus.Collector {
	return newSnapshot("fanout", read, []stat[fanout.Stats]{
		{"messages_received_total", "Messages received from the feed.", counterValue, func(s fanout.Stats) float64 { return float64(s.Totals.Received) }},
		{"bytes_received_total", "Bytes received from the feed.", counterValue, func(s fanout.Stats) float64 { return float64(s.Totals.Bytes) }},
		{"messages_oversized_total", "Messages too long for the framing, delivered to nobody.", counterValue, func(s fanout.Stats) float64 { return float64(s.Totals.Oversized) }},
		{"subscribers", "Subscribers connected now.", gaugeValue, func(s fanout.Stats) float64 { return float64(s.Totals.Subscribers) }},
		{"subscribers_connected_total", "Subscribers that connected.", counterValue, func(s fanout.Stats) float64 { return float64(s.Totals.Connected) }},
		{"subscribers_disconnected_total", "Subscribers gone, by their choice or for being slow.", counterValue, func(s fanout.Stats) float64 { return float64(s.Totals.Disconnected) }},
		{"subscribers_disconnected_slow_total", "Subscribers disconnected for being slow (--slow disconnect).", counterValue, func(s fanout.Stats) float64 { return float64(s.Totals.SlowDropped) }},
		{"messages_dropped", "Messages dropped to full queues, summed over the subscribers connected now.", gaugeValue, func(s fanout.Stats) float64 {
			var n uint64
			for _, sub := range s.Subscribers {
				n += sub.Dropped
			}
			return float64(n)
		}},
		{"queued_bytes", "Bytes waiting in the forwarder for subscribers now.", gaugeValue, func(s fanout.Stats) float64 {
			n := 0
			for _, sub := range s.Subscribers {
				n += sub.Queued
			}
			return float64(n)
		}},
	})
}

// ProcessRegistry holds a process's collector (Proxy, Daemon, Fanout), its
// build and the Go runtime's and process's own metrics.
func ProcessRegistry(version string, c prometheus.Collector) *prometheus.Registry {
	r := prometheus.NewRegistry()
	build := prometheus.NewGauge(prometheus.GaugeOpts{Name: "shunt_build_info", Help: "This shunt's version and the Go it was built with.",
		ConstLabels: prometheus.Labels{"version": version, "goversion": runtime.Version()}})
	build.Set(1)
	r.MustRegister(c, build, collectors.NewGoCollector(), collectors.NewProcessCollector(collectors.ProcessCollectorOpts{}))
	return r
}
