package bench

import (
	"testing"
	"time"
)

func TestHistogramQuantiles(t *testing.T) {
	var h histogram
	for i := int64(1); i <= 100000; i++ {
		h.add(i * 1000) // 1 us .. 100 ms, uniform
	}
	d := h.dist()
	for _, c := range []struct {
		got, want time.Duration
	}{{d.P50, 50 * time.Millisecond}, {d.P99, 99 * time.Millisecond}, {d.Max, 100 * time.Millisecond}} {
		if r := float64(c.got) / float64(c.want); r < 0.97 || r > 1.03 {
			t.Errorf("quantile %v, want %v within 3%%", c.got, c.want)
		}
	}
}
