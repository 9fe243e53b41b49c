package main

import (
	"encoding/json"
	"os"
	"path/filepath"
	"strings"
	"testing"
	"time"

	"github.com/shunt-project/shunt/bench"
	"github.com/shunt-project/shunt/internal/testenv"
)

// Benchmarks are not tests; this only proves the scenario runs end to end at
// a tiny size, measures every mode, and cleans up after itself.
func TestBenchLatencyTiny(t *testing.T) {
	testenv.RequireRoot(t)
	dir := t.TempDir()
	out, stderr, code := runShunt(t, nil, "bench", "latency", "--json", "--rounds", "1", "--count", "200", "--warmup", "10",
		"--sizes", "14,1K", "--out", dir)
	if code != 0 {
		t.Fatalf("exit %d: %s", code, stderr)
	}
	var res []bench.LatencyResult
	if err := json.Unmarshal([]byte(out), &res); err != nil {
		t.Fatalf("%v: %s", err, out)
	}
	if len(res) != 12 {
		t.Fatalf("want 2 sizes x 3 modes x 2 placements, got %d results", len(res))
	}
	for _, r := range res {
		if r.Dist.Count != 200 || r.Dist.P50 <= 0 || r.Dist.Max < r.Dist.P50 {
			t.Errorf("%d %s %s: implausible %+v", r.Size, r.Placement, r.Mode, r.Dist)
		}
	}
	requireFiles(t, dir, "latency.json", "latency.md", "latency-same-cpu.png", "latency-cross-cpu.png")
	out, stderr, code = runShunt(t, nil, "bench", "latency", "--json", "--rounds", "1", "--count", "100",
		"--topology", "loopback", "--placement", "same-cpu", "--modes", "tcp,shunt,shunt-bare")
	if code != 0 || json.Unmarshal([]byte(out), &res) != nil || len(res) != 3 || res[0].Topology != "loopback" {
		t.Fatalf("loopback: exit %d: %s %s", code, stderr, out)
	}
	for _, bad := range []struct{ args, want string }{
		{"--modes tcp,carrier-pigeon", `unknown value "carrier-pigeon"`},
		{"--sizes 14,lots", `"lots" is not a size`},
		{"--topology wormhole", `unknown topology "wormhole"`},
		{"--placement far-away", `unknown value "far-away"`},
	} {
		_, stderr, code = runShunt(t, nil, append([]string{"bench", "latency"}, strings.Fields(bad.args)...)...)
		if code != 2 || !strings.Contains(stderr, bad.want) {
			t.Errorf("%s: exit %d, %q", bad.args, code, stderr)
		}
	}
}

// --new-conn: a connection per round trip, in every TCP mode, each one
// paired where shunt is on (the run fails otherwise).
func TestBenchLatencyNewConnTiny(t *testing.T) {
	testenv.RequireRoot(t)
	out, stderr, code := runShunt(t, nil, "bench", "latency", "--json", "--new-conn", "--rounds", "1", "--count", "50",
		"--warmup", "5", "--modes", "tcp,shunt,shunt-trust,shunt-bare,shunt-pair-brief", "--placement", "same-cpu")
	if code != 0 {
		t.Fatalf("exit %d: %s", code, stderr)
	}
	var res []bench.LatencyResult
	if err := json.Unmarshal([]byte(out), &res); err != nil || len(res) != 5 {
		t.Fatalf("want 5 modes: %v %s", err, out)
	}
	for _, r := range res {
		if r.Dist.Count != 50 || r.Dist.P50 <= 0 {
			t.Errorf("%s: implausible %+v", r.Mode, r.Dist)
		}
	}
	_, stderr, code = runShunt(t, nil, "bench", "latency", "--new-conn", "--modes", "tcp,unix")
	if code == 0 || !strings.Contains(stderr, "cannot make a connection per round trip") {
		t.Errorf("--new-conn with unix: exit %d, %q", code, stderr)
	}
}

func TestBenchThroughputTiny(t *testing.T) {
	testenv.RequireRoot(t)
	dir := t.TempDir()
	// 300 ms a run: in 50 ms, under -race beside other packages' tests, a
	// shunt run's fresh connection once redirected nothing yet (its reader
	// had not caught up with the first TCP bytes), which its row now says.
	out, stderr, code := runShunt(t, nil, "bench", "throughput", "--json", "--rounds", "1", "--duration", "300ms",
		"--placement", "same-cpu,cross-cpu,any-cpu", "--read-size", "64K", "--out", dir)
	if code != 0 {
		t.Fatalf("exit %d: %s", code, stderr)
	}
	var res []bench.ThroughputResult
	if err := json.Unmarshal([]byte(out), &res); err != nil {
		t.Fatalf("%v: %s", err, out)
	}
	if len(res) != 9 {
		t.Fatalf("want 3 modes x 3 placements, got %d", len(res))
	}
	for _, r := range res {
		if r.MedianGbps <= 0 || r.CPUSecPerGB <= 0 || r.ReadSize != 64<<10 {
			t.Errorf("%s %s: implausible %+v (want reads of 64 KiB)", r.Placement, r.Mode, r)
		}
		// Every shunt row says how much went by redirect (some, with a
		// 64 KiB reader); the others have no install to ask.
		if b := r.Bypass; (r.Mode == bench.ModeShunt) != (b != nil) || b != nil && (b.RedirectedShare <= 0 || b.RedirectedShare > 1) {
			t.Errorf("%s %s: bypass %+v", r.Placement, r.Mode, b)
		}
	}
	requireFiles(t, dir, "throughput.json", "throughput.md", "throughput-same-cpu.png", "throughput-cross-cpu.png", "throughput-any-cpu.png")
	for _, bad := range []struct{ args, want string }{
		{"--read-size 0", `"0" is not a size`},
		{"--read-size 1K,2K", "one size up to 64M"},
		{"--read-size 128M", "one size up to 64M"},
	} {
		_, stderr, code = runShunt(t, nil, append([]string{"bench", "throughput"}, strings.Fields(bad.args)...)...)
		if code != 2 || !strings.Contains(stderr, bad.want) {
			t.Errorf("%s: exit %d, %q", bad.args, code, stderr)
		}
	}
}

func requireFiles(t *testing.T, dir string, names ...string) {
	t.Helper()
	for _, n := range names {
		if st, err := os.Stat(filepath.Join(dir, n)); err != nil || st.Size() == 0 {
			t.Errorf("report file %s missing or empty: %v", n, err)
		}
	}
}

func TestDemoTiny(t *testing.T) {
	testenv.RequireRoot(t)
	out, stderr, code := runShunt(t, nil, "demo", "--rounds", "1", "--count", "200", "--duration", "50ms")
	if code != 0 {
		t.Fatalf("exit %d: %s", code, stderr)
	}
	for _, want := range []string{"Latency", "same-cpu", "cross-cpu", "any-cpu", "Throughput", "shunt", "removed"} {
		if !strings.Contains(out, want) {
			t.Errorf("demo output lacks %q:\n%s", want, out)
		}
	}
}

func TestBenchEchoTiny(t *testing.T) {
	testenv.RequireRoot(t)
	dir := t.TempDir()
	out, stderr, code := runShunt(t, nil, "bench", "echo", "--json", "--rounds", "1", "--count", "20", "--blocks", "16K,256K",
		"--modes", strings.Join(bench.EchoModes, ","), "--placement", "same-cpu,cross-cpu", "--out", dir)
	if code != 0 {
		t.Fatalf("exit %d: %s", code, stderr)
	}
	var res []bench.EchoResult
	if err := json.Unmarshal([]byte(out), &res); err != nil {
		t.Fatalf("%v: %s", err, out)
	}
	if want := 2 * 2 * len(bench.EchoModes); len(res) != want {
		t.Fatalf("want %d results, got %d", want, len(res))
	}
	for _, r := range res {
		if r.Dist.Count != 20 || r.Dist.P50 <= 0 {
			t.Errorf("%d %s %s: implausible %+v", r.Block, r.Placement, r.Mode, r.Dist)
		}
		if (r.Mode == bench.EchoSockmap) != (r.SndBuf > 0) {
			t.Errorf("%s: server sndbuf %d; auto sizes it for sockmap only", r.Mode, r.SndBuf)
		}
	}
	requireFiles(t, dir, "echo.json", "echo.md", "echo-same-cpu.png", "echo-cross-cpu.png")
}

// The cross-checks with real tools run in the lab too, bypass verified.
func TestBenchWithToolsTiny(t *testing.T) {
	testenv.RequireRoot(t)
	out, stderr, code := runShunt(t, nil, "bench", "latency", "--json", "--rounds", "1", "--duration", "1s",
		"--placement", "cross-cpu", "--modes", "sockperf-tcp,sockperf-shunt-trust")
	var lat []bench.LatencyResult
	if code != 0 || json.Unmarshal([]byte(out), &lat) != nil || len(lat) != 2 || lat[1].Dist.P50 <= 0 || lat[1].RatioToTCP <= 0 {
		t.Fatalf("sockperf: exit %d: %s %s", code, stderr, out)
	}
	out, stderr, code = runShunt(t, nil, "bench", "throughput", "--json", "--rounds", "1", "--duration", "1s", "--modes", "iperf3-tcp,iperf3-shunt-trust")
	var thr []bench.ThroughputResult
	if code != 0 || json.Unmarshal([]byte(out), &thr) != nil || len(thr) != 2 || thr[1].MedianGbps <= 0 {
		t.Fatalf("iperf3: exit %d: %s %s", code, stderr, out)
	}
}

// Ctrl-C in the middle of the demo removes every namespace, cgroup and pin
// it made.
func TestDemoInterruptCleansUp(t *testing.T) {
	testenv.RequireRoot(t)
	bin := shuntBinary(t)
	cmd := subprocess(bin, "demo", "--rounds", "100", "--count", "2000")
	var stderr strings.Builder
	cmd.Stderr = &stderr
	if err := cmd.Start(); err != nil {
		t.Fatal(err)
	}
	time.Sleep(1500 * time.Millisecond)
	if err := cmd.Process.Signal(os.Interrupt); err != nil {
		t.Fatal(err)
	}
	done := make(chan error, 1)
	go func() { done <- cmd.Wait() }()
	select {
	case <-done:
	case <-time.After(20 * time.Second):
		cmd.Process.Kill()
		t.Fatal("demo did not stop within 20 s of Ctrl-C")
	}
	if code := cmd.ProcessState.ExitCode(); code != 130 || !strings.Contains(stderr.String(), "interrupted") {
		t.Errorf("exit %d, stderr %q; want 130 and a line saying it was interrupted", code, stderr.String())
	}
	root := mustCgroup2Root(t)
	for _, pattern := range []string{"/run/netns/shunt-demo-*", "/sys/fs/bpf/shunt-demo-*", root + "/shunt-demo-*"} {
		if left, _ := filepath.Glob(pattern); len(left) > 0 {
			t.Errorf("left behind after Ctrl-C: %v", left)
		}
	}
}

func TestBenchBackpressureTiny(t *testing.T) {
	testenv.RequireRoot(t)
	dir := t.TempDir()
	out, stderr, code := runShunt(t, nil, "bench", "backpressure", "--json", "--duration", "600ms", "--out", dir)
	if code != 0 {
		t.Fatalf("exit %d: %s", code, stderr)
	}
	var res []bench.BackpressureResult
	if err := json.Unmarshal([]byte(out), &res); err != nil {
		t.Fatalf("%v: %s", err, out)
	}
	if len(res) != 3 || res[0].Mode != "tcp" || res[1].Mode != "shunt-bare" || res[2].Mode != "shunt" {
		t.Fatalf("want tcp, shunt-bare and shunt runs, got %s", out)
	}
	for _, r := range res {
		if len(r.Samples) < 4 || len(r.ProducedKBps) != 2 || r.ProducedKBps[0] <= 0 || r.ConsumedKBps <= 0 {
			t.Errorf("%s: implausible run %+v", r.Mode, r)
		}
	}
	requireFiles(t, dir, "backpressure.json", "backpressure.md", "backpressure.png")
	if _, stderr, code := runShunt(t, nil, "bench", "backpressure", "--producers", "fast"); code != 2 || !strings.Contains(stderr, "not a rate") {
		t.Errorf("bad --producers: exit %d, %q", code, stderr)
	}
}

func TestBenchReapTiny(t *testing.T) {
	testenv.RequireRoot(t)
	dir := t.TempDir()
	out, stderr, code := runShunt(t, nil, "bench", "reap", "--json", "--sizes", "20,60", "--netns", "3", "--victims", "4", "--rounds", "1", "--out", dir)
	if code != 0 {
		t.Fatalf("exit %d: %s", code, stderr)
	}
	var res []bench.ReapResult
	if err := json.Unmarshal([]byte(out), &res); err != nil {
		t.Fatalf("%v: %s", err, out)
	}
	// udp and tcp, two sizes, index and iter.
	if len(res) != 8 {
		t.Fatalf("want 8 results, got %s", out)
	}
	for _, r := range res {
		if r.Destroyed != 4 || r.Took <= 0 {
			t.Errorf("implausible result %+v", r)
		}
	}
	requireFiles(t, dir, "reap.json", "reap.md", "reap.png")
	if _, stderr, code := runShunt(t, nil, "bench", "reap", "--sizes", "5"); code != 2 || !strings.Contains(stderr, "above --victims") {
		t.Errorf("bad --sizes: exit %d, %q", code, stderr)
	}
}

func TestBenchFanoutTiny(t *testing.T) {
	testenv.RequireRoot(t)
	dir := t.TempDir()
	out, stderr, code := runShunt(t, nil, "bench", "fanout", "--json", "--sizes", "100", "--rates", "2000", "--subscribers", "1,5",
		"--duration", "200ms", "--rounds", "1", "--out", dir)
	if code != 0 {
		t.Fatalf("exit %d: %s", code, stderr)
	}
	var res []bench.FanoutResult
	if err := json.Unmarshal([]byte(out), &res); err != nil {
		t.Fatalf("%v: %s", err, out)
	}
	if len(res) != 10 {
		t.Fatalf("want 5 paths x 2 subscriber counts, got %s", out)
	}
	for _, r := range res {
		if r.Sent == 0 || r.Delivered != r.Sent*uint64(r.Subscribers) || r.Latency.P50 <= 0 {
			t.Errorf("implausible run %+v", r)
		}
	}
	requireFiles(t, dir, "fanout.json", "fanout.md", "fanout.png")
	// A subscriber that never reads costs the readers nothing they can count.
	out, stderr, code = runShunt(t, nil, "bench", "fanout", "--json", "--sizes", "100", "--rates", "2000", "--subscribers", "3",
		"--slow", "1", "--paths", "batch", "--duration", "200ms", "--rounds", "1")
	res = nil
	if code != 0 || json.Unmarshal([]byte(out), &res) != nil || len(res) != 1 || res[0].Slow != 1 || res[0].Delivered != res[0].Sent*3 {
		t.Errorf("--slow 1: exit %d, %s %s", code, out, stderr)
	}
	if _, stderr, code := runShunt(t, nil, "bench", "fanout", "--sizes", "8"); code != 2 || !strings.Contains(stderr, "at least 16") {
		t.Errorf("bad --sizes: exit %d, %q", code, stderr)
	}
}

func TestBenchProxyTiny(t *testing.T) {
	testenv.RequireRoot(t)
	t.Setenv("SHUNT_TEST_MAIN", "1") // the shunt proxies are this binary
	dir := t.TempDir()
	// /proc/stat counts CPU in 10 ms ticks: 200 round trips (~30 ms) once
	// read as no machine CPU at all, and so did 1,000 in the direct mode
	// (no proxy: ~11 us each, 11 ms in all); 5,000 tick in every mode.
	// --max-time: the 5,000 round trips must all run (each is checked
	// below); under -race beside other packages' tests socat's took 1 ms
	// each and the default 5 s stopped it at 4,340.
	out, stderr, code := runShunt(t, nil, "bench", "proxy", "--json", "--rounds", "1", "--requests", "5000",
		"--sizes", "64", "--blocks", "16K", "--bulk-time", "100ms", "--max-time", "2m", "--out", dir)
	if code != 0 {
		t.Fatalf("exit %d: %s", code, stderr)
	}
	var res []bench.ProxyResult
	if err := json.Unmarshal([]byte(out), &res); err != nil {
		t.Fatalf("%v: %s", err, out)
	}
	if len(res) != 2*len(bench.ProxyModes) {
		t.Fatalf("want 2 tests x %d proxies, got %d results", len(bench.ProxyModes), len(res))
	}
	for _, r := range res {
		ok := r.MachineCPUPerGB > 0
		if r.Test == "rr" {
			ok = ok && r.Dist.Count == 5000 && r.Dist.P50 > 0
		} else {
			ok = ok && r.Gbps > 0
		}
		if !ok {
			t.Errorf("%s %s: implausible %+v", r.Mode, r.Test, r)
		}
		if r.Mode == bench.ProxyKernel && r.Test == "bulk" && len(r.RoundKernelShare) != 1 {
			t.Errorf("kernel mode's share of kernel-forwarded bytes was not read: %+v", r)
		}
	}
	requireFiles(t, dir, "proxy.json", "proxy.md", "proxy-p99.png", "proxy-cpu.png")
	_, stderr, code = runShunt(t, nil, "bench", "proxy", "--modes", "shunt-kernel,squid")
	if code != 2 || !strings.Contains(stderr, `unknown value "squid"`) {
		t.Errorf("exit %d, %q", code, stderr)
	}
}

func TestBenchUDPTiny(t *testing.T) {
	testenv.RequireRoot(t)
	dir := t.TempDir()
	out, stderr, code := runShunt(t, nil, "bench", "udp", "--json", "--sizes", "64", "--requests", "200", "--bulk-time", "200ms", "--rounds", "1", "--out", dir)
	if code != 0 {
		t.Fatalf("exit %d: %s", code, stderr)
	}
	var res []bench.UDPResult
	if err := json.Unmarshal([]byte(out), &res); err != nil || len(res) != 2 {
		t.Fatalf("want kernel and relay, got %s (%v)", out, err)
	}
	for _, r := range res {
		if r.RoundTrip.Count+r.Lost != 200 || r.Lost > 0 || r.Delivered == 0 || r.Delivered > r.Sent || r.CPUPerGB <= 0 {
			t.Errorf("implausible run %+v", r)
		}
	}
	requireFiles(t, dir, "udp.json", "udp.md")
	if _, stderr, code := runShunt(t, nil, "bench", "udp", "--modes", "teleport"); code != 2 || !strings.Contains(stderr, "want kernel or relay") {
		t.Errorf("bad --modes: exit %d, %q", code, stderr)
	}
}

// The throughput table explains a bypass row below TCP, and says nothing
// when none is.
func TestThroughputTableExplainsARowBelowTCP(t *testing.T) {
	row := func(mode string, ratio float64) bench.ThroughputResult {
		return bench.ThroughputResult{Topology: bench.Veth, Placement: bench.CrossCPU, Mode: mode, WriteSize: 64 << 10,
			RoundGbps: []float64{10}, MedianGbps: 10, RatioToTCP: ratio}
	}
	for _, tc := range []struct {
		name string
		res  []bench.ThroughputResult
		want bool
	}{
		{"shunt ahead", []bench.ThroughputResult{row(bench.ModeTCP, 1), row(bench.ModeShunt, 1.2), row(bench.ModeUnix, 0.9)}, false},
		{"shunt behind", []bench.ThroughputResult{row(bench.ModeTCP, 1), row(bench.ModeShunt, 0.88)}, true},
		{"only the bare redirect behind", []bench.ThroughputResult{row(bench.ModeTCP, 1), row(bench.ModeBare, 0.7), row(bench.ModeShunt, 1.0)}, false},
	} {
		t.Run(tc.name, func(t *testing.T) {
			var out strings.Builder
			printThroughput(&out, tc.res)
			if got := strings.Contains(out.String(), "Where shunt is below tcp"); got != tc.want {
				t.Errorf("note printed %v, want %v:\n%s", got, tc.want, out.String())
			}
		})
	}
}
