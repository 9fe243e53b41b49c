package agent_test

import (
	"fmt"
	"os"
	"path/filepath"
	"slices"
	"testing"
	"time"

	"github.com/shunt-project/shunt/bypass"
	"github.com/shunt-project/shunt/bypass/bypasstest"
	"github.com/shunt-project/shunt/host"
	"github.com/shunt-project/shunt/internal/testenv"
)

// BenchmarkNewCgroupEnabled measures how long after its creation a cgroup
// that matches the agent's pattern is enabled: median and max over b.N
// cgroups, created one at a time (go test -bench NewCgroupEnabled
// -benchtime 100x ./agent).
func BenchmarkNewCgroupEnabled(b *testing.B) {
	testenv.RequireRoot(b)
	pin := bypasstest.MustPinDir(b)
	parent := testenv.MustCgroup(b).Path
	config := filepath.Join(b.TempDir(), "config.yaml")
	if err := os.WriteFile(config, []byte(fmt.Sprintf("bypass:\n  cgroups: [%q]\n  guard: false\n", parent+"/app-*")), 0o644); err != nil {
		b.Fatal(err)
	}
	runAgentFor(b, config, pin)
	mkCgroupTB(b, parent, "app-first") // the install exists from here
	for !isEnabled(b, pin, filepath.Join(parent, "app-first")) {
		time.Sleep(time.Millisecond)
	}
	in, err := bypass.Open(pin)
	if err != nil {
		b.Fatal(err)
	}
	defer in.Close()
	var took []time.Duration
	var made []string
	b.Cleanup(func() {
		for _, p := range made {
			os.Remove(p)
		}
	})
	b.ResetTimer()
	for i := range b.N {
		p := filepath.Join(parent, fmt.Sprintf("app-%d", i))
		start := time.Now()
		if err := os.Mkdir(p, 0o755); err != nil {
			b.Fatal(err)
		}
		made = append(made, p)
		cg, err := host.ResolveCgroup(p)
		if err != nil {
			b.Fatal(err)
		}
		for !in.IsEnabled(cg.ID) {
			if time.Since(start) > 10*time.Second {
				b.Fatalf("%s not enabled after 10 s", p)
			}
			time.Sleep(200 * time.Microsecond)
		}
		took = append(took, time.Since(start))
	}
	b.StopTimer()
	slices.Sort(took)
	b.ReportMetric(float64(took[len(took)/2].Microseconds())/1000, "ms-median")
	b.ReportMetric(float64(took[len(took)-1].Microseconds())/1000, "ms-max")
}
