package metrics

import (
	"fmt"
	"os"
	"os/exec"
	"path/filepath"
	"regexp"
	"strings"
	"testing"
	"time"

	"github.com/shunt-project/shunt/internal/dashboard"
	"github.com/shunt-project/shunt/internal/testenv"
)

// TestDashboard: every query of the Grafana dashboard (deploy/grafana)
// names only metrics docs/METRICS.md lists (which TestEveryMetricDocumented
// ties to the collectors), uses the dashboard's data source variable, and
// parses as PromQL (promtool, with Grafana's variables filled in).
func TestDashboard(t *testing.T) {
	testenv.NeedProgram(t, "promtool")
	d, err := dashboard.Load("../deploy/grafana/shunt.json")
	if err != nil {
		t.Fatal(err)
	}
	doc, err := os.ReadFile("../docs/METRICS.md")
	if err != nil {
		t.Fatal(err)
	}
	name := regexp.MustCompile(`shunt_[a-z0-9_]+`)
	var rules strings.Builder
	rules.WriteString("groups:\n- name: dashboard\n  rules:\n")
	queries, used := 0, map[string]bool{}
	for _, p := range d.Panels {
		if p.Type == "row" {
			continue
		}
		if p.Datasource == nil || p.Datasource.UID != "${datasource}" {
			t.Errorf("panel %q does not use the ${datasource} variable", p.Title)
		}
		if len(p.Targets) == 0 {
			t.Errorf("panel %q has no query", p.Title)
		}
		for _, q := range p.Targets {
			for _, n := range name.FindAllString(q.Expr, -1) {
				used[n] = true
				if !strings.Contains(string(doc), "| `"+n+"` |") {
					t.Errorf("panel %q queries %s, which docs/METRICS.md does not list", p.Title, n)
				}
			}
			queries++
			fmt.Fprintf(&rules, "  - record: dashboard:query%d\n    expr: %q\n", queries, q.Query(time.Minute))
		}
	}
	if queries < 20 || len(used) < 30 {
		t.Errorf("%d queries over %d metrics: the dashboard lost its panels", queries, len(used))
	}
	f := filepath.Join(t.TempDir(), "rules.yml")
	if err := os.WriteFile(f, []byte(rules.String()), 0o644); err != nil {
		t.Fatal(err)
	}
	if out, err := exec.Command("promtool", "check", "rules", f).CombinedOutput(); err != nil {
		t.Errorf("promtool check rules: %v\n%s", err, out)
	}
}
