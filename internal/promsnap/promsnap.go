// Package promsnap exports a running process's stats to Prometheus: one
// snapshot per scrape, each number taken from it. The proxy, the splice
// daemon and the fan-out forwarder each describe their own numbers with it,
// so a binary links only the collectors of what it runs.
package promsnap

import "github.com/prometheus/client_golang/prometheus"

// Stat is one number of a stats snapshot S.
type Stat[S any] struct {
	name, help string
	kind       prometheus.ValueType
	value      func(S) float64
}

// Counter is a number of S that only grows.
func Counter[S any](name, help string, value func(S) float64) Stat[S] {
	return Stat[S]{name, help, prometheus.CounterValue, value}
}

// Gauge is a number of S that goes up and down.
func Gauge[S any](name, help string, value func(S) float64) Stat[S] {
	return Stat[S]{name, help, prometheus.GaugeValue, value}
}

type collector[S any] struct {
	read  func() (S, error)
	stats []Stat[S]
	descs []*prometheus.Desc
	fail  *prometheus.Desc
}

// New exports stats, read once a scrape, as shunt_SUBSYSTEM_NAME, with
// shunt_SUBSYSTEM_scrape_errors saying whether the read failed.
func New[S any](subsystem string, read func() (S, error), stats []Stat[S]) prometheus.Collector {
	c := &collector[S]{read: read, stats: stats,
		fail: prometheus.NewDesc(prometheus.BuildFQName("shunt", subsystem, "scrape_errors"), "1 where reading the "+subsystem+"'s stats failed during this scrape (the reason is logged).", nil, nil)}
	for _, s := range stats {
		c.descs = append(c.descs, prometheus.NewDesc(prometheus.BuildFQName("shunt", subsystem, s.name), s.help, nil, nil))
	}
	return c
}

func (c *collector[S]) Describe(ch chan<- *prometheus.Desc) {
	for _, d := range c.descs {
		ch <- d
	}
	ch <- c.fail
}

func (c *collector[S]) Collect(ch chan<- prometheus.Metric) {
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
