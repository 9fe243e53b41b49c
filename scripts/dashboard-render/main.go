// Command dashboard-render draws shunt's Grafana dashboard from a Prometheus
// server's data into a PNG (scripts/dashboard-snapshot.sh runs it).
package main

import (
	"context"
	"flag"
	"fmt"
	"os"
	"time"

	"github.com/prometheus/client_golang/api"
	v1 "github.com/prometheus/client_golang/api/prometheus/v1"

	"github.com/shunt-project/shunt/internal/dashboard"
)

func main() {
	file := flag.String("dashboard", "deploy/grafana/shunt.json", "the dashboard JSON")
	prom := flag.String("prometheus", "http://127.0.0.1:9090", "the Prometheus server's URL")
	last := flag.Duration("last", 5*time.Minute, "the window drawn, ending now")
	step := flag.Duration("step", time.Second, "the resolution of the queries")
	rate := flag.Duration("rate-interval", 5*time.Second, "what $__rate_interval stands for (Grafana: 4 scrape intervals)")
	out := flag.String("out", "dashboard.png", "the PNG file written")
	flag.Parse()
	if err := run(*file, *prom, *last, *step, *rate, *out); err != nil {
		fmt.Fprintln(os.Stderr, "dashboard-render:", err)
		os.Exit(1)
	}
}

func run(file, prom string, last, step, rate time.Duration, out string) error {
	d, err := dashboard.Load(file)
	if err != nil {
		return err
	}
	client, err := api.NewClient(api.Config{Address: prom})
	if err != nil {
		return fmt.Errorf("--prometheus %s: %w", prom, err)
	}
	ctx, cancel := context.WithTimeout(context.Background(), time.Minute)
	defer cancel()
	end := time.Now()
	return dashboard.Render(ctx, v1.NewAPI(client), d, dashboard.Range{Start: end.Add(-last), End: end, Step: step, RateInterval: rate}, out)
}
