package main

import (
	"io"
	"os"
	"os/exec"
	"strings"
	"testing"

	dto "github.com/prometheus/client_model/go"
	"github.com/prometheus/common/expfmt"
	"github.com/prometheus/common/model"

	"github.com/shunt-project/shunt/internal/testenv"
)

// scrape runs `shunt metrics --once` and parses what it printed.
func scrape(t *testing.T, pin, indexDir string) (string, map[string]*dto.MetricFamily) {
	t.Helper()
	out, stderr, code := runShunt(t, nil, "metrics", "--once", "--pin-dir", pin, "--index-dir", indexDir)
	if code != 0 {
		t.Fatalf("metrics --once: exit %d: %s", code, stderr)
	}
	p := expfmt.NewTextParser(model.UTF8Validation)
	fams, err := p.TextToMetricFamilies(strings.NewReader(out))
	if err != nil {
		t.Fatalf("parse the scrape: %v\n%s", err, out)
	}
	return out, fams
}

// value is the one sample of name whose labels include want.
func value(t *testing.T, fams map[string]*dto.MetricFamily, name string, want ...string) float64 {
	t.Helper()
	f, ok := fams[name]
	if !ok {
		t.Fatalf("no metric %s", name)
	}
	for _, m := range f.Metric {
		labels := map[string]string{}
		for _, l := range m.Label {
			labels[l.GetName()] = l.GetValue()
		}
		match := true
		for i := 0; i+1 < len(want); i += 2 {
			match = match && labels[want[i]] == want[i+1]
		}
		if !match {
			continue
		}
		switch {
		case m.Counter != nil:
			return m.Counter.GetValue()
		case m.Gauge != nil:
			return m.Gauge.GetValue()
		}
	}
	t.Fatalf("no sample of %s with %v", name, want)
	return 0
}

// What bypass and the index count shows in a scrape, which promtool finds
// clean; a scrape follows an enable and a disable without a restart.
func TestMetricsFollowBypassAndIndex(t *testing.T) {
	testenv.RequireRoot(t)
	testenv.NeedProgram(t, "promtool")
	pin, indexDir := testenv.MustPinDir(t), testenv.MustPinDir(t)
	cg := testenv.MustCgroup(t)

	_, fams := scrape(t, pin, indexDir)
	if value(t, fams, "shunt_bypass_enabled") != 0 || value(t, fams, "shunt_index_enabled") != 0 {
		t.Fatal("bypass or the index enabled before either was")
	}
	if _, stderr, code := runShunt(t, nil, "bypass", "enable", "--no-guard", "--cgroup", cg.Path, "--pin-dir", pin); code != 0 {
		t.Fatalf("enable: exit %d: %s", code, stderr)
	}
	if _, stderr, code := runShunt(t, nil, "index", "enable", "--cgroup", cg.Path, "--index-dir", indexDir); code != 0 {
		t.Fatalf("index enable: exit %d: %s", code, stderr)
	}
	t.Cleanup(func() { runShunt(t, nil, "index", "disable", "--index-dir", indexDir) })

	side := testenv.Side{NS: testenv.MustNetNS(t), CG: cg}
	c, s := testenv.ConnPair(t, "tcp4", side, "127.0.0.1:0", side, "127.0.0.1:0")
	testenv.Warm(t, c, s)
	c.Write([]byte("hello"))
	io.ReadFull(s, make([]byte, 5))

	out, fams := scrape(t, pin, indexDir)
	for _, w := range []struct {
		name   string
		labels []string
		want   float64
	}{
		{"shunt_bypass_enabled", nil, 1},
		{"shunt_bypass_cgroups", nil, 1},
		{"shunt_bypass_connections_paired_total", nil, 1},
		{"shunt_bypass_map_entries", []string{"map", "sock_hash"}, 2},
		{"shunt_bypass_guard_running", nil, 0},
		{"shunt_index_enabled", nil, 1},
		{"shunt_index_sockets", nil, 1}, // the client: the accepted socket's remote is no backend
		{"shunt_index_added_total", nil, 1},
		{"shunt_scrape_errors", []string{"part", "bypass"}, 0},
		{"shunt_scrape_errors", []string{"part", "index"}, 0},
	} {
		if got := value(t, fams, w.name, w.labels...); got != w.want {
			t.Errorf("%s%v = %v, want %v", w.name, w.labels, got, w.want)
		}
	}
	if value(t, fams, "shunt_kernel_info", "release", hostRelease(t)) != 1 {
		t.Error("shunt_kernel_info does not name this kernel")
	}

	check := exec.Command("promtool", "check", "metrics")
	check.Stdin = strings.NewReader(out)
	if msg, err := check.CombinedOutput(); err != nil {
		t.Errorf("promtool check metrics: %v\n%s", err, msg)
	}

	c.Close()
	s.Close()
	if _, stderr, code := runShunt(t, nil, "bypass", "disable", "--all", "--pin-dir", pin); code != 0 {
		t.Fatalf("disable: exit %d: %s", code, stderr)
	}
	if _, fams := scrape(t, pin, indexDir); value(t, fams, "shunt_bypass_enabled") != 0 {
		t.Error("bypass still enabled in the scrape after disable")
	}
}

// hostRelease is the running kernel's release, as uname gives it.
func hostRelease(t *testing.T) string {
	t.Helper()
	out, err := exec.Command("uname", "-r").Output()
	if err != nil {
		t.Fatal(err)
	}
	return strings.TrimSpace(string(out))
}

func TestMetricsBadListen(t *testing.T) {
	testenv.RequireRoot(t)
	_, stderr, code := runShunt(t, nil, "metrics", "--listen", "9464")
	if code != 2 {
		t.Errorf("metrics --listen 9464: exit %d, want 2", code)
	}
	oneLine(t, stderr, `--listen "9464": want HOST:PORT`)
}

// agent --check: a good file is ok; a bad one is one line, exit 2.
func TestAgentCheck(t *testing.T) {
	dir := t.TempDir()
	good, bad := dir+"/good.yaml", dir+"/bad.yaml"
	os.WriteFile(good, []byte("metrics: {address: \"127.0.0.1:9464\"}\n"), 0o644)
	os.WriteFile(bad, []byte("metrics: {adress: \"127.0.0.1:9464\"}\n"), 0o644)
	if out, stderr, code := runShunt(t, nil, "agent", "--config", good, "--check"); code != 0 || !strings.Contains(out, "ok") {
		t.Errorf("--check of a good file: exit %d, %q %q", code, out, stderr)
	}
	_, stderr, code := runShunt(t, nil, "agent", "--config", bad, "--check")
	if code != 2 {
		t.Errorf("--check of a bad file: exit %d, want 2", code)
	}
	oneLine(t, stderr, "field adress not found in metrics (it takes address)")
	_, stderr, code = runShunt(t, nil, "agent", "--config", dir+"/none.yaml", "--check")
	if code == 0 {
		t.Error("--check of a missing file: exit 0")
	}
	oneLine(t, stderr, "none.yaml: no such file or directory")
}
