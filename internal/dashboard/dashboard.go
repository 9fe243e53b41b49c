// Package dashboard reads shunt's Grafana dashboard (deploy/grafana) and
// draws its panels from a Prometheus server's data, for the docs: Grafana
// itself cannot run where shunt is built (scripts/dashboard-snapshot.sh).
package dashboard

import (
	"encoding/json"
	"fmt"
	"os"
	"sort"
	"strings"
	"time"
)

// Dashboard is the part of a Grafana dashboard that shunt's tools read.
type Dashboard struct {
	Title  string  `json:"title"`
	Panels []Panel `json:"panels"`
}

// Panel is one panel; Type "row" is a section heading with no query.
type Panel struct {
	Type    string `json:"type"`
	Title   string `json:"title"`
	GridPos struct {
		H int `json:"h"`
		W int `json:"w"`
		X int `json:"x"`
		Y int `json:"y"`
	} `json:"gridPos"`
	Datasource *struct {
		UID string `json:"uid"`
	} `json:"datasource"`
	FieldConfig struct {
		Defaults struct {
			Unit string `json:"unit"`
		} `json:"defaults"`
	} `json:"fieldConfig"`
	Targets []Target `json:"targets"`
}

// Target is one query of a panel.
type Target struct {
	Expr         string `json:"expr"`
	LegendFormat string `json:"legendFormat"`
}

// Load reads a dashboard JSON file.
func Load(path string) (*Dashboard, error) {
	b, err := os.ReadFile(path)
	if err != nil {
		return nil, err
	}
	var d Dashboard
	if err := json.Unmarshal(b, &d); err != nil {
		return nil, fmt.Errorf("%s: %w", path, err)
	}
	return &d, nil
}

// Query is the target's PromQL with the dashboard's variables filled in as
// Grafana would with "All" nodes selected: every instance, and rates over
// the given interval (Grafana's $__rate_interval).
func (t Target) Query(rateInterval time.Duration) string {
	return strings.NewReplacer(
		"$__rate_interval", fmt.Sprintf("%ds", int(rateInterval.Seconds())),
		"$instance", ".*",
	).Replace(t.Expr)
}

// Legend names a series as Grafana does: {{label}} in the legend format
// replaced by the series' label, or the series' labels if no format is set.
func (t Target) Legend(labels map[string]string) string {
	if t.LegendFormat == "" {
		var parts []string
		for k, v := range labels {
			if k != "__name__" {
				parts = append(parts, k+"="+v)
			}
		}
		sort.Strings(parts)
		return strings.Join(parts, ",")
	}
	out := t.LegendFormat
	for k, v := range labels {
		out = strings.ReplaceAll(out, "{{"+k+"}}", v)
	}
	// Labels the series lacks (aggregated away) show as nothing.
	for {
		i := strings.Index(out, "{{")
		j := strings.Index(out, "}}")
		if i < 0 || j < i {
			return strings.TrimSpace(out)
		}
		out = out[:i] + out[j+2:]
	}
}
