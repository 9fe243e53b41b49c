package metrics

import (
	"os"
	"regexp"
	"strings"
	"testing"

	"github.com/prometheus/client_golang/prometheus"

	"github.com/shunt-project/shunt/daemon"
	"github.com/shunt-project/shunt/fanout"
	"github.com/shunt-project/shunt/proxy"
)

// describedNames lists the metric names the collectors describe.
func describedNames(t *testing.T, cs ...prometheus.Collector) []string {
	t.Helper()
	ch := make(chan *prometheus.Desc, 1000)
	for _, c := range cs {
		c.Describe(ch)
	}
	close(ch)
	name := regexp.MustCompile(`fqName: "([^"]+)"`)
	var names []string
	for d := range ch {
		m := name.FindStringSubmatch(d.String())
		if m == nil {
			t.Fatalf("no name in %s", d)
		}
		names = append(names, m[1])
	}
	return names
}

// Every metric the collectors describe (shunt metrics', and the proxy's,
// daemon's and forwarder's own) has its row in docs/METRICS.md.
func TestEveryMetricDocumented(t *testing.T) {
	doc, err := os.ReadFile("../docs/METRICS.md")
	if err != nil {
		t.Fatal(err)
	}
	names := describedNames(t, New(Source{}),
		proxy.Collector(func() proxy.Stats { return proxy.Stats{} }),
		proxy.UDPCollector(func() proxy.UDPStats { return proxy.UDPStats{} }),
		daemon.Collector(func() daemon.Totals { return daemon.Totals{} }),
		fanout.Collector(func() (fanout.Stats, error) { return fanout.Stats{}, nil }))
	for _, n := range names {
		if !strings.Contains(string(doc), "| `"+n+"` |") {
			t.Errorf("docs/METRICS.md has no row for %s", n)
		}
	}
	if len(names) < 70 {
		t.Errorf("only %d metrics described", len(names))
	}
}
