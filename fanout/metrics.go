package fanout

import (
	"github.com/prometheus/client_golang/prometheus"

	"github.com/shunt-project/shunt/internal/promsnap"
)

// Collector exports a running forwarder's totals (`shunt fanout --metrics-addr`).
// read takes a snapshot from the forwarder's event loop (Query).
func Collector(read func() (Stats, error)) prometheus.Collector {
	return promsnap.New("fanout", read, []promsnap.Stat[Stats]{
		promsnap.Counter("messages_received_total", "Messages received from the feed.", func(s Stats) float64 { return float64(s.Totals.Received) }),
		promsnap.Counter("bytes_received_total", "Bytes received from the feed.", func(s Stats) float64 { return float64(s.Totals.Bytes) }),
		promsnap.Counter("messages_oversized_total", "Messages too long for the framing, delivered to nobody.", func(s Stats) float64 { return float64(s.Totals.Oversized) }),
		promsnap.Gauge("subscribers", "Subscribers connected now.", func(s Stats) float64 { return float64(s.Totals.Subscribers) }),
		promsnap.Counter("subscribers_connected_total", "Subscribers that connected.", func(s Stats) float64 { return float64(s.Totals.Connected) }),
		promsnap.Counter("subscribers_disconnected_total", "Subscribers gone, by their choice or for being slow.", func(s Stats) float64 { return float64(s.Totals.Disconnected) }),
		promsnap.Counter("subscribers_disconnected_slow_total", "Subscribers disconnected for being slow (--slow disconnect).", func(s Stats) float64 { return float64(s.Totals.SlowDropped) }),
		promsnap.Gauge("messages_dropped", "Messages dropped to full queues, summed over the subscribers connected now.", func(s Stats) float64 {
			var n uint64
			for _, sub := range s.Subscribers {
				n += sub.Dropped
			}
			return float64(n)
		}),
		promsnap.Gauge("queued_bytes", "Bytes waiting in the forwarder for subscribers now.", func(s Stats) float64 {
			n := 0
			for _, sub := range s.Subscribers {
				n += sub.Queued
			}
			return float64(n)
		}),
	})
}
