package metrics

import (
	"os"
	"regexp"
	"strings"
	"testing"

	"github.com/prometheus/client_golang/prometheus"
)

// Every metric the collector describes has its row in docs/METRICS.md.
func TestEveryMetricDocumented(t *testing.T) {
	doc, err := os.ReadFile("../docs/METRICS.md")
	if err != nil {
		t.Fatal(err)
	}
	ch := make(chan *prometheus.Desc, 100)
	New(Source{}).Describe(ch)
	close(ch)
	name := regexp.MustCompile(`fqName: "([^"]+)"`)
	n := 0
	for d := range ch {
		m := name.FindStringSubmatch(d.String())
		if m == nil {
			t.Fatalf("no name in %s", d)
		}
		n++
		if !strings.Contains(string(doc), "| `"+m[1]+"` |") {
			t.Errorf("docs/METRICS.md has no row for %s", m[1])
		}
	}
	if n < 30 {
		t.Errorf("only %d metrics described", n)
	}
}
