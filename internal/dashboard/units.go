package dashboard

import (
	"fmt"
	"math"

	"gonum.org/v1/plot"
)

// unitLabel is the axis label for a Grafana unit.
func unitLabel(unit string) string {
	switch unit {
	case "Bps":
		return "bytes/s"
	case "cps":
		return "connections/s"
	case "ops":
		return "per second"
	case "percentunit":
		return "share"
	case "bytes":
		return "bytes"
	}
	return ""
}

// formatValue writes v as Grafana would for the unit: SI prefixes, bytes
// in binary ones, shares in percent.
func formatValue(v float64, unit string) string {
	switch unit {
	case "percentunit":
		return trim(v*100) + "%"
	case "bytes", "Bps":
		s := binary(v) + "B"
		if unit == "Bps" {
			s += "/s"
		}
		return s
	}
	return si(v)
}

type prefix struct {
	f float64
	s string
}

var (
	siPrefixes     = []prefix{{1e9, "G"}, {1e6, "M"}, {1e3, "k"}}
	binaryPrefixes = []prefix{{1 << 30, "Gi"}, {1 << 20, "Mi"}, {1 << 10, "Ki"}}
)

func si(v float64) string { return scaled(v, siPrefixes, "") }

func binary(v float64) string { return scaled(v, binaryPrefixes, " ") }

// scaled writes v with the largest prefix it reaches, or bare with plain
// after it.
func scaled(v float64, prefixes []prefix, plain string) string {
	for _, p := range prefixes {
		if math.Abs(v) >= p.f {
			return trim(v/p.f) + " " + p.s
		}
	}
	return trim(v) + plain
}

func trim(v float64) string {
	if v == math.Trunc(v) {
		return fmt.Sprintf("%.0f", v)
	}
	if math.Abs(v) >= 10 {
		return fmt.Sprintf("%.1f", v)
	}
	return fmt.Sprintf("%.2f", v)
}

// unitTicks labels an axis's ticks in the panel's unit.
type unitTicks struct{ unit string }

func (u unitTicks) Ticks(min, max float64) []plot.Tick {
	ticks := plot.DefaultTicks{}.Ticks(min, max)
	for i := range ticks {
		if ticks[i].Label != "" {
			ticks[i].Label = formatValue(ticks[i].Value, u.unit)
		}
	}
	return ticks
}
