package bench

import (
	"cmp"
	"slices"
	"time"
)

// Dist summarizes latency samples.
type Dist struct {
	Count int           `json:"count"`
	P50   time.Duration `json:"p50_ns"`
	P99   time.Duration `json:"p99_ns"`
	P999  time.Duration `json:"p999_ns"`
	Max   time.Duration `json:"max_ns"`
}

func distOf(samples []time.Duration) Dist {
	if len(samples) == 0 {
		return Dist{}
	}
	s := slices.Clone(samples)
	slices.Sort(s)
	q := func(p float64) time.Duration { return s[min(len(s)-1, int(p*float64(len(s))))] }
	return Dist{Count: len(s), P50: q(0.50), P99: q(0.99), P999: q(0.999), Max: s[len(s)-1]}
}

// median is the middle value (the upper one of an even count); 0 for none.
func median[T cmp.Ordered](v []T) T {
	var zero T
	if len(v) == 0 {
		return zero
	}
	s := slices.Clone(v)
	slices.Sort(s)
	return s[len(s)/2]
}

// StallLimit is the published defect: a message that takes this long.
const StallLimit = 10 * time.Millisecond

// stalled reports whether a distribution shows a stall: a message over
// StallLimit, or a max over 100 times the median.
func stalled(d Dist) bool {
	return d.Max > StallLimit || (d.P50 > 0 && d.Max > 100*d.P50)
}

// combine merges per-round distributions known only by their percentiles:
// the median of each percentile, the largest max, the total count.
func combine(ds []Dist) Dist {
	var out Dist
	pick := func(f func(Dist) time.Duration) time.Duration {
		v := make([]time.Duration, len(ds))
		for i, d := range ds {
			v[i] = f(d)
		}
		return median(v)
	}
	out.P50 = pick(func(d Dist) time.Duration { return d.P50 })
	out.P99 = pick(func(d Dist) time.Duration { return d.P99 })
	out.P999 = pick(func(d Dist) time.Duration { return d.P999 })
	for _, d := range ds {
		out.Count += d.Count
		out.Max = max(out.Max, d.Max)
	}
	return out
}

// pooled gathers one cell's runs across rounds.
type pooled struct {
	samples []time.Duration
	p50s    []time.Duration // one per round
	cpu     time.Duration
	wall    time.Duration
}

func (p *pooled) add(samples []time.Duration, cpu, wall time.Duration) {
	p.samples = append(p.samples, samples...)
	p.p50s = append(p.p50s, distOf(samples).P50)
	p.cpu += cpu
	p.wall += wall
}

// pool returns the accumulator of a cell, making it on first use.
func pool[T any](m map[Cell]*T, c Cell) *T {
	if m[c] == nil {
		m[c] = new(T)
	}
	return m[c]
}
