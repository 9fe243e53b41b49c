package main

import (
	"bufio"
	"bytes"
	"io"
	"net/http"
	"os"
	"os/exec"
	"path/filepath"
	"strings"
	"testing"
	"time"

	dto "github.com/prometheus/client_model/go"
	"github.com/prometheus/common/expfmt"
	"github.com/prometheus/common/model"

	"github.com/shunt-project/shunt/bypass/bypasstest"
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
	pin, indexDir := bypasstest.MustPinDir(t), bypasstest.MustPinDir(t)
	cg := testenv.MustCgroup(t)

	_, fams := scrape(t, pin, indexDir)
	if value(t, fams, "shunt_bypass_enabled") != 0 || value(t, fams, "shunt_index_enabled") != 0 {
		t.Fatal("bypass or the index enabled before either was")
	}
	if _, stderr, code := runShunt(t, nil, "bypass", "enable", "--no-guard", "--no-probation", "--cgroup", cg.Path, "--pin-dir", pin); code != 0 {
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
	if v := value(t, fams, "shunt_bypass_cgroup_redirected_bytes_total", "cgroup", cg.Path); v < 5 {
		t.Errorf("the cgroup's redirected bytes are %v, want at least the 5 of hello", v)
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
	oneLine(t, stderr, "field adress not found in metrics (it takes address, token_file)")
	_, stderr, code = runShunt(t, nil, "agent", "--config", dir+"/none.yaml", "--check")
	if code == 0 {
		t.Error("--check of a missing file: exit 0")
	}
	oneLine(t, stderr, "none.yaml: no such file or directory")
	// What start would refuse, --check refuses too: the policy file it
	// names, missing or bad (before, --check said ok).
	loose := dir + "/token"
	os.WriteFile(loose, []byte("s3cret\n"), 0o644)
	os.Chmod(loose, 0o644)
	withToken := dir + "/with-token.yaml"
	os.WriteFile(withToken, []byte("metrics: {address: \"127.0.0.1:9464\", token_file: "+loose+"}\n"), 0o644)
	if _, stderr, code = runShunt(t, nil, "agent", "--config", withToken, "--check"); code != 2 {
		t.Errorf("--check with a token file others can read: exit %d, want 2", code)
	}
	oneLine(t, stderr, "metrics.token_file: token file "+loose+" can be read by other users")
	for name, policy := range map[string]string{"missing": dir + "/no-policy.yaml", "bad": bad} {
		cfg := dir + "/with-policy-" + name + ".yaml"
		os.WriteFile(cfg, []byte("policy: {file: "+policy+"}\n"), 0o644)
		_, stderr, code = runShunt(t, nil, "agent", "--config", cfg, "--check")
		if code != 2 {
			t.Errorf("--check with a %s policy file: exit %d, want 2", name, code)
		}
		oneLine(t, stderr, "policy file "+policy)
	}
}

// scrapeAt reads http://addr/metrics from inside ns.
func scrapeAt(t *testing.T, ns *testenv.NetNS, addr string) (string, map[string]*dto.MetricFamily) {
	t.Helper()
	c := testenv.Dial(t, testenv.Side{NS: ns}, "tcp", addr, nil)
	defer c.Close()
	c.SetDeadline(time.Now().Add(10 * time.Second))
	if _, err := io.WriteString(c, "GET /metrics HTTP/1.0\r\nHost: shunt\r\n\r\n"); err != nil {
		t.Fatal(err)
	}
	resp, err := http.ReadResponse(bufio.NewReader(c), nil)
	if err != nil {
		t.Fatal(err)
	}
	defer resp.Body.Close()
	body, err := io.ReadAll(resp.Body)
	if err != nil || resp.StatusCode != http.StatusOK {
		t.Fatalf("GET /metrics: %s, %v\n%s", resp.Status, err, body)
	}
	parser := expfmt.NewTextParser(model.UTF8Validation)
	fams, err := parser.TextToMetricFamilies(bytes.NewReader(body))
	if err != nil {
		t.Fatalf("parse the scrape: %v\n%s", err, body)
	}
	return string(body), fams
}

// waitMetric waits up to 10 s for the metric name at addr to read want.
func waitMetric(t *testing.T, ns *testenv.NetNS, addr, name string, want float64) {
	t.Helper()
	var got float64
	for deadline := time.Now().Add(10 * time.Second); time.Now().Before(deadline); time.Sleep(10 * time.Millisecond) {
		_, fams := scrapeAt(t, ns, addr)
		if got = value(t, fams, name); got == want {
			return
		}
	}
	t.Fatalf("%s is %v 10 s on, want %v", name, got, want)
}

// promtoolClean fails the test if promtool finds fault with a scrape.
func promtoolClean(t *testing.T, out string) {
	t.Helper()
	check := exec.Command("promtool", "check", "metrics")
	check.Stdin = strings.NewReader(out)
	if msg, err := check.CombinedOutput(); err != nil {
		t.Errorf("promtool check metrics: %v\n%s", err, msg)
	}
}

// TestProcessMetrics: proxy, daemon and fanout started with --metrics-addr
// serve their own counters, which follow the traffic they carry; promtool
// finds each scrape clean.
func TestProcessMetrics(t *testing.T) {
	testenv.RequireRoot(t)
	testenv.NeedProgram(t, "promtool")
	const addr = "127.0.0.1:19464"
	serving := "serving metrics at http://" + addr + "/metrics"
	wantValues := func(t *testing.T, fams map[string]*dto.MetricFamily, want map[string]float64) {
		t.Helper()
		for name, v := range want {
			if got := value(t, fams, name); got != v {
				t.Errorf("%s = %v, want %v", name, got, v)
			}
		}
	}

	t.Run("proxy", func(t *testing.T) {
		ns := testenv.MustNetNS(t)
		startShunt(t, ns, serving, "proxy", "--listen", "127.0.0.1:17000", "--upstream", echoUpstream(t, testenv.Side{NS: ns}), "--metrics-addr", addr)
		c := testenv.Dial(t, testenv.Side{NS: ns}, "tcp", "127.0.0.1:17000", nil)
		// Once the kernel forwards both directions, small round trips are
		// the kernel's alone.
		waitMetric(t, ns, addr, "shunt_proxy_directions_in_kernel", 2)
		msg, echo := bytes.Repeat([]byte("x"), 100), make([]byte, 100)
		for range 10 {
			if _, err := c.Write(msg); err != nil {
				t.Fatal(err)
			}
			if _, err := io.ReadFull(c, echo); err != nil {
				t.Fatal(err)
			}
		}
		_, fams := scrapeAt(t, ns, addr)
		wantValues(t, fams, map[string]float64{"shunt_proxy_connections_active": 1, "shunt_build_info": 1})
		c.Close()
		waitMetric(t, ns, addr, "shunt_proxy_connections_active", 0)
		out, fams := scrapeAt(t, ns, addr)
		wantValues(t, fams, map[string]float64{
			"shunt_proxy_connections_accepted_total": 1, "shunt_proxy_connections_failed_total": 0,
			"shunt_proxy_bytes_up_total": 1000, "shunt_proxy_bytes_down_total": 1000, "shunt_proxy_bytes_kernel_total": 2000,
			"shunt_proxy_directions_in_kernel": 0, "shunt_proxy_scrape_errors": 0,
		})
		promtoolClean(t, out)
	})

	t.Run("fanout", func(t *testing.T) {
		ns := testenv.MustNetNS(t)
		ctl := filepath.Join(t.TempDir(), "fanout.sock")
		startShunt(t, ns, serving, "fanout", "--source", "udp://127.0.0.1:15000", "--listen", "tcp://127.0.0.1:16000",
			"--framing", "u32", "--control", ctl, "--metrics-addr", addr)
		sub := testenv.Dial(t, testenv.Side{NS: ns}, "tcp", "127.0.0.1:16000", nil)
		waitMetric(t, ns, addr, "shunt_fanout_subscribers", 1)
		sendDatagram(t, ns, "127.0.0.1:15000", "tick")
		sub.SetReadDeadline(time.Now().Add(5 * time.Second))
		if _, err := io.ReadFull(sub, make([]byte, 8)); err != nil {
			t.Fatal(err)
		}
		out, fams := scrapeAt(t, ns, addr)
		wantValues(t, fams, map[string]float64{
			"shunt_fanout_messages_received_total": 1, "shunt_fanout_bytes_received_total": 4,
			"shunt_fanout_subscribers_connected_total": 1, "shunt_fanout_messages_dropped": 0, "shunt_fanout_scrape_errors": 0,
		})
		promtoolClean(t, out)
	})

	t.Run("daemon", func(t *testing.T) {
		ns := testenv.MustNetNS(t)
		sock := filepath.Join(t.TempDir(), "daemon.sock")
		run := startShunt(t, ns, "daemon: listening on "+sock, "daemon", "--socket", sock, "--metrics-addr", addr)
		if !run.lines.Scan() || !strings.Contains(run.lines.Text(), serving) {
			t.Fatalf("shunt daemon said %q next, want %q", run.lines.Text(), serving)
		}
		out, fams := scrapeAt(t, ns, addr)
		wantValues(t, fams, map[string]float64{"shunt_daemon_pairs": 0, "shunt_daemon_pairs_joined_total": 0, "shunt_daemon_scrape_errors": 0})
		promtoolClean(t, out)
	})
}

// shunt metrics --token-file: a scrape without the token gets 401 and no
// metric; with it, the metrics. A token file other users can read is
// refused before anything is served.
func TestMetricsTokenFile(t *testing.T) {
	testenv.RequireRoot(t)
	ns := testenv.MustNetNS(t)
	dir := t.TempDir()
	token := filepath.Join(dir, "token")
	os.WriteFile(token, []byte("s3cret\n"), 0o600)
	loose := filepath.Join(dir, "loose")
	os.WriteFile(loose, []byte("s3cret\n"), 0o644)
	os.Chmod(loose, 0o644)
	_, stderr, code := runShunt(t, nil, "metrics", "--token-file", loose, "--pin-dir", bypasstest.MustPinDir(t))
	if code != 2 {
		t.Errorf("a token file others can read: exit %d, want 2", code)
	}
	oneLine(t, stderr, "can be read by other users")

	addr := "127.0.0.1:19464"
	startShunt(t, ns, "serving metrics at", "metrics", "--listen", addr, "--token-file", token, "--pin-dir", bypasstest.MustPinDir(t))
	get := func(auth string) (int, string) {
		c := testenv.Dial(t, testenv.Side{NS: ns}, "tcp", addr, nil)
		defer c.Close()
		c.SetDeadline(time.Now().Add(10 * time.Second))
		req := "GET /metrics HTTP/1.0\r\nHost: shunt\r\n"
		if auth != "" {
			req += "Authorization: " + auth + "\r\n"
		}
		io.WriteString(c, req+"\r\n")
		resp, err := http.ReadResponse(bufio.NewReader(c), nil)
		if err != nil {
			t.Fatal(err)
		}
		defer resp.Body.Close()
		body, _ := io.ReadAll(resp.Body)
		return resp.StatusCode, string(body)
	}
	if code, body := get(""); code != http.StatusUnauthorized || strings.Contains(body, "shunt_") {
		t.Errorf("without the token: %d %q", code, body)
	}
	if code, body := get("Bearer s3cret"); code != http.StatusOK || !strings.Contains(body, "shunt_bypass_enabled") {
		t.Errorf("with the token: %d, %d bytes", code, len(body))
	}
}
