package main

import (
	"encoding/json"
	"strings"
	"testing"

	"github.com/shunt-project/shunt/bench"
	"github.com/shunt-project/shunt/internal/testenv"
)

// Benchmarks are not tests; this only proves the scenario runs end to end at
// a tiny size, measures every mode, and cleans up after itself.
func TestBenchLatencyTiny(t *testing.T) {
	testenv.RequireRoot(t)
	out, stderr, code := runShunt(t, nil, "bench", "latency", "--json", "--rounds", "1", "--count", "200", "--warmup", "10")
	if code != 0 {
		t.Fatalf("exit %d: %s", code, stderr)
	}
	var res []bench.LatencyResult
	if err := json.Unmarshal([]byte(out), &res); err != nil {
		t.Fatalf("%v: %s", err, out)
	}
	if len(res) != 6 {
		t.Fatalf("want 3 modes x 2 placements, got %d results", len(res))
	}
	for _, r := range res {
		if r.Dist.Count != 200 || r.Dist.P50 <= 0 || r.Dist.Max < r.Dist.P50 {
			t.Errorf("%s %s: implausible %+v", r.Placement, r.Mode, r.Dist)
		}
	}
	_, stderr, code = runShunt(t, nil, "bench", "latency", "--modes", "tcp,carrier-pigeon")
	if code != 2 || !strings.Contains(stderr, `unknown value "carrier-pigeon"`) {
		t.Errorf("bad mode: exit %d, %q", code, stderr)
	}
}

func TestBenchThroughputTiny(t *testing.T) {
	testenv.RequireRoot(t)
	out, stderr, code := runShunt(t, nil, "bench", "throughput", "--json", "--rounds", "1", "--duration", "50ms", "--placement", "same-cpu,cross-cpu")
	if code != 0 {
		t.Fatalf("exit %d: %s", code, stderr)
	}
	var res []bench.ThroughputResult
	if err := json.Unmarshal([]byte(out), &res); err != nil {
		t.Fatalf("%v: %s", err, out)
	}
	if len(res) != 6 {
		t.Fatalf("want 3 modes x 2 placements, got %d", len(res))
	}
	for _, r := range res {
		if r.MedianGbps <= 0 || r.CPUSecPerGB <= 0 {
			t.Errorf("%s %s: implausible %+v", r.Placement, r.Mode, r)
		}
	}
}

func TestDemoTiny(t *testing.T) {
	testenv.RequireRoot(t)
	out, stderr, code := runShunt(t, nil, "demo", "--rounds", "1", "--count", "200", "--duration", "50ms")
	if code != 0 {
		t.Fatalf("exit %d: %s", code, stderr)
	}
	for _, want := range []string{"Latency", "same-cpu", "cross-cpu", "Throughput", "shunt", "removed"} {
		if !strings.Contains(out, want) {
			t.Errorf("demo output lacks %q:\n%s", want, out)
		}
	}
}
