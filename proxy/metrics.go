package proxy

import (
	"github.com/prometheus/client_golang/prometheus"

	"github.com/shunt-project/shunt/internal/promsnap"
)

// Collector exports a running TCP proxy's stats (`shunt proxy --metrics-addr`).
func Collector(stats func() Stats) prometheus.Collector {
	return promsnap.New("proxy", func() (Stats, error) { return stats(), nil }, []promsnap.Stat[Stats]{
		promsnap.Counter("connections_accepted_total", "Client connections accepted.", func(s Stats) float64 { return float64(s.Accepted) }),
		promsnap.Gauge("connections_active", "Client connections open now.", func(s Stats) float64 { return float64(s.Active) }),
		promsnap.Counter("connections_refused_total", "Client connections closed because no upstream would take them.", func(s Stats) float64 { return float64(s.Refused) }),
		promsnap.Counter("connections_failed_total", "Connections ended by a reset or an error.", func(s Stats) float64 { return float64(s.Failed) }),
		promsnap.Counter("bytes_up_total", "Bytes from clients to upstreams, of ended connections.", func(s Stats) float64 { return float64(s.Up) }),
		promsnap.Counter("bytes_down_total", "Bytes from upstreams to clients, of ended connections.", func(s Stats) float64 { return float64(s.Down) }),
		promsnap.Counter("bytes_kernel_total", "Of those bytes, the ones the kernel moved (mode kernel).", func(s Stats) float64 { return float64(s.Kernel) }),
		promsnap.Counter("bytes_passed_by_total", "Of the kernel's bytes, the ones sent straight between client and upstream, passing the proxy's sockets by (mode kernel, legs paired by bypass).", func(s Stats) float64 { return float64(s.PassedBy) }),
		promsnap.Counter("connections_shortcut_total", "Connections whose two legs bypass paired, so that client and upstream could reach each other directly (mode kernel).", func(s Stats) float64 { return float64(s.ShortcutConns) }),
		promsnap.Gauge("directions_in_kernel", "Directions of open connections the kernel forwards now (mode kernel; the rest are paced through user space).", func(s Stats) float64 { return float64(s.InKernel) }),
		promsnap.Counter("directions_throttled_total", "Times flow control gave a direction to user space, of ended connections (mode kernel).", func(s Stats) float64 { return float64(s.Throttled) }),
	})
}

// UDPCollector exports a running UDP proxy's stats (`shunt proxy --udp --metrics-addr`).
func UDPCollector(stats func() UDPStats) prometheus.Collector {
	return promsnap.New("proxy_udp", func() (UDPStats, error) { return stats(), nil }, []promsnap.Stat[UDPStats]{
		promsnap.Counter("flows_total", "Client flows seen.", func(s UDPStats) float64 { return float64(s.Flows) }),
		promsnap.Gauge("flows_active", "Client flows open now.", func(s UDPStats) float64 { return float64(s.Active) }),
		promsnap.Counter("flows_refused_total", "Flows over --max-conns, or whose upstream could not be reached.", func(s UDPStats) float64 { return float64(s.Refused) }),
		promsnap.Counter("flows_upstream_refused_total", "Flows whose upstream refused a datagram (ICMP port unreachable).", func(s UDPStats) float64 { return float64(s.UpstreamRefused) }),
		promsnap.Counter("datagrams_up_total", "Datagrams from clients to upstreams.", func(s UDPStats) float64 { return float64(s.Up) }),
		promsnap.Counter("datagrams_down_total", "Datagrams from upstreams to clients.", func(s UDPStats) float64 { return float64(s.Down) }),
		promsnap.Counter("datagrams_kernel_total", "Of those datagrams, the ones the kernel moved (mode kernel).", func(s UDPStats) float64 { return float64(s.Kernel) }),
		promsnap.Counter("datagrams_dropped_total", "Datagrams dropped.", func(s UDPStats) float64 { return float64(s.Dropped) }),
	})
}
