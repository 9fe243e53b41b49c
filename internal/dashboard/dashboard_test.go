package dashboard

import (
	"context"
	"encoding/json"
	"fmt"
	"image/png"
	"net/http"
	"net/http/httptest"
	"os"
	"path/filepath"
	"sync"
	"testing"
	"time"

	"github.com/prometheus/client_golang/api"
	v1 "github.com/prometheus/client_golang/api/prometheus/v1"
)

// fakePrometheus answers instant and range queries with one series per
// query (a ramp), or errors, and records the queries it was asked.
type fakePrometheus struct {
	mu    sync.Mutex
	asked map[string]bool
	fail  bool
}

func (f *fakePrometheus) ServeHTTP(w http.ResponseWriter, r *http.Request) {
	r.ParseForm()
	f.mu.Lock()
	f.asked[r.Form.Get("query")] = true
	f.mu.Unlock()
	w.Header().Set("Content-Type", "application/json")
	if f.fail {
		w.WriteHeader(http.StatusBadRequest)
		fmt.Fprint(w, `{"status":"error","errorType":"bad_data","error":"parse error"}`)
		return
	}
	metric := map[string]string{"cgroup": "/app-1"}
	var data any
	switch r.URL.Path {
	case "/api/v1/query":
		data = map[string]any{"resultType": "vector", "result": []any{
			map[string]any{"metric": metric, "value": []any{1700000000, "42"}}}}
	case "/api/v1/query_range":
		var values []any
		for i := 0; i < 60; i++ {
			values = append(values, []any{1700000000 + i, fmt.Sprint(i * 1000)})
		}
		data = map[string]any{"resultType": "matrix", "result": []any{
			map[string]any{"metric": metric, "values": values}}}
	default:
		http.NotFound(w, r)
		return
	}
	json.NewEncoder(w).Encode(map[string]any{"status": "success", "data": data})
}

func render(t *testing.T, f *fakePrometheus) (*Dashboard, string, error) {
	t.Helper()
	srv := httptest.NewServer(f)
	t.Cleanup(srv.Close)
	client, err := api.NewClient(api.Config{Address: srv.URL})
	if err != nil {
		t.Fatal(err)
	}
	d, err := Load("../../deploy/grafana/shunt.json")
	if err != nil {
		t.Fatal(err)
	}
	out := filepath.Join(t.TempDir(), "dashboard.png")
	start := time.Unix(1700000000, 0)
	err = Render(context.Background(), v1.NewAPI(client), d,
		Range{Start: start, End: start.Add(time.Minute), Step: time.Second, RateInterval: 5 * time.Second}, out)
	return d, out, err
}

// Render asks Prometheus every query of every panel, with the variables
// filled in, and writes a PNG as wide as Grafana's grid and as tall as the
// dashboard's rows.
func TestRenderAsksEveryQuery(t *testing.T) {
	f := &fakePrometheus{asked: map[string]bool{}}
	d, out, err := render(t, f)
	if err != nil {
		t.Fatal(err)
	}
	rows := 0
	for _, p := range d.Panels {
		rows = max(rows, p.GridPos.Y+p.GridPos.H)
		for _, q := range p.Targets {
			if !f.asked[q.Query(5*time.Second)] {
				t.Errorf("panel %q: query %q not asked", p.Title, q.Query(5*time.Second))
			}
		}
	}
	for q := range f.asked {
		if q == "" {
			t.Error("an empty query was asked")
		}
	}
	r, err := os.Open(out)
	if err != nil {
		t.Fatal(err)
	}
	defer r.Close()
	img, err := png.Decode(r)
	if err != nil {
		t.Fatal(err)
	}
	if w, h := img.Bounds().Dx(), img.Bounds().Dy(); w != 1800 || h != 60+30*rows {
		t.Errorf("image %dx%d, want 1800x%d", w, h, 60+30*rows)
	}
}

// A Prometheus that answers no query is an error, not a picture of empty
// panels.
func TestRenderFailsWhenEveryQueryFails(t *testing.T) {
	if _, _, err := render(t, &fakePrometheus{asked: map[string]bool{}, fail: true}); err == nil {
		t.Error("rendered although every query failed")
	}
}

func TestQueryAndLegend(t *testing.T) {
	q := Target{Expr: `sum by (cgroup) (rate(x_total{instance=~"$instance"}[$__rate_interval]))`, LegendFormat: "{{cgroup}} on {{instance}}"}
	if got, want := q.Query(4*time.Second), `sum by (cgroup) (rate(x_total{instance=~".*"}[4s]))`; got != want {
		t.Errorf("query %q, want %q", got, want)
	}
	if got := q.Legend(map[string]string{"cgroup": "/app"}); got != "/app on" {
		t.Errorf("legend %q, want %q (a label aggregated away shows as nothing)", got, "/app on")
	}
	if got := (Target{}).Legend(map[string]string{"b": "2", "a": "1", "__name__": "m"}); got != "a=1,b=2" {
		t.Errorf("legend without a format %q, want the labels in order", got)
	}
}

// Values read as Grafana writes them for the dashboard's units.
func TestFormatValue(t *testing.T) {
	for _, tc := range []struct {
		v    float64
		unit string
		want string
	}{
		{0.74, "percentunit", "74%"},
		{0.0018, "percentunit", "0.18%"},
		{3 << 20, "Bps", "3 MiB/s"},
		{512, "bytes", "512 B"},
		{1536, "bytes", "1.50 KiB"},
		{47, "cps", "47"},
		{12500, "ops", "12.5 k"},
		{2e9, "short", "2 G"},
	} {
		if got := formatValue(tc.v, tc.unit); got != tc.want {
			t.Errorf("formatValue(%v, %q) = %q, want %q", tc.v, tc.unit, got, tc.want)
		}
	}
}
