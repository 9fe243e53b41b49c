package daemon

import (
	"github.com/prometheus/client_golang/prometheus"

	"github.com/shunt-project/shunt/internal/promsnap"
)

// Collector exports a running splice daemon's counts (`shunt daemon --metrics-addr`).
func Collector(totals func() Totals) prometheus.Collector {
	return promsnap.New("daemon", func() (Totals, error) { return totals(), nil }, []promsnap.Stat[Totals]{
		promsnap.Counter("pairs_joined_total", "Socket pairs joined by this daemon (TCP and UDP).", func(t Totals) float64 { return float64(t.Joined) }),
		promsnap.Gauge("pairs", "Socket pairs held now, including ones taken over from a previous ", func(t Totals) float64 { return float64(t.Open) }),
		promsnap.Counter("pairs_ended_total", "TCP pairs that ended and UDP pairs closed.", func(t Totals) float64 { return float64(t.Ended) }),
		promsnap.Counter("pairs_failed_total", "Pairs ended by a reset or an error.", func(t Totals) float64 { return float64(t.Failed) }),
		promsnap.Counter("pairs_closed_total", "Pairs closed by a client's request (a TCP pair is reset).", func(t Totals) float64 { return float64(t.Closed) }),
		promsnap.Counter("bytes_total", "Bytes moved both ways, by ended and open pairs.", func(t Totals) float64 { return float64(t.Bytes) }),
		promsnap.Counter("bytes_kernel_total", "Of those bytes, the ones the kernel moved.", func(t Totals) float64 { return float64(t.Kernel) }),
		promsnap.Counter("datagrams_dropped_total", "UDP datagrams dropped at a pair's bound.", func(t Totals) float64 { return float64(t.Dropped) }),
	})
}
