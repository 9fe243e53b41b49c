package agent_test

import (
	"context"
	"errors"
	"fmt"
	"os"
	"path/filepath"
	"sort"
	"strings"
	"testing"
	"time"

	"github.com/shunt-project/shunt/agent"
	"github.com/shunt-project/shunt/bypass"
	"github.com/shunt-project/shunt/bypass/bypasstest"
	"github.com/shunt-project/shunt/guard"
	"github.com/shunt-project/shunt/host"
	"github.com/shunt-project/shunt/internal/runlock"
	"github.com/shunt-project/shunt/internal/testenv"
)

// mkCgroup makes a child cgroup of parent, removed in cleanup (before
// parent: cleanups run last first).
func mkCgroup(t *testing.T, parent, name string) string { return mkCgroupTB(t, parent, name) }

func mkCgroupTB(t testing.TB, parent, name string) string {
	t.Helper()
	p := filepath.Join(parent, name)
	if err := os.Mkdir(p, 0o755); err != nil {
		t.Fatal(err)
	}
	t.Cleanup(func() { os.Remove(p) })
	return p
}

func writeConfig(t *testing.T, path, text string) {
	t.Helper()
	// Written whole and renamed, as an editor or a config manager would.
	tmp := path + ".tmp"
	if err := os.WriteFile(tmp, []byte(text), 0o644); err != nil {
		t.Fatal(err)
	}
	if err := os.Rename(tmp, path); err != nil {
		t.Fatal(err)
	}
}

// mustOneCgroup makes a pin directory, a cgroup named name under the
// test's own, and a configuration that enables it (needs root).
func mustOneCgroup(t *testing.T, name string) (pin, cgroup, config string) {
	t.Helper()
	testenv.RequireRoot(t)
	pin = bypasstest.MustPinDir(t)
	cgroup = mkCgroup(t, testenv.MustCgroup(t).Path, name)
	config = filepath.Join(t.TempDir(), "config.yaml")
	writeConfig(t, config, fmt.Sprintf("bypass:\n  cgroups: [%q]\n", cgroup))
	return pin, cgroup, config
}

// runAgent starts an agent until the test ends.
func runAgent(t *testing.T, config, pin string) *testenv.SyncBuffer {
	return runAgentFor(t, config, pin)
}

func runAgentFor(t testing.TB, config, pin string) *testenv.SyncBuffer {
	t.Helper()
	return runAgentWith(t, agent.Options{ConfigPath: config, PinDir: pin, IndexDir: filepath.Join(pin, "no-index"),
		Version: "test", Features: host.Probe()})
}

// runAgentWith starts an agent with opts until the test ends; it returns
// the agent's log, shown when the test ends.
func runAgentWith(t testing.TB, opts agent.Options) *testenv.SyncBuffer {
	t.Helper()
	log := &testenv.SyncBuffer{}
	opts.Log = log
	a, err := agent.New(opts)
	if err != nil {
		t.Fatal(err)
	}
	ctx, cancel := context.WithCancel(context.Background())
	done := make(chan error, 1)
	go func() { done <- a.Run(ctx) }()
	t.Cleanup(func() {
		cancel()
		if err := <-done; err != nil {
			t.Errorf("agent: %v", err)
		}
		t.Logf("agent log:\n%s", log)
	})
	return log
}

// isEnabled says whether bypass is enabled for the cgroup at path.
func isEnabled(t testing.TB, pin, path string) bool {
	t.Helper()
	in, err := bypass.Open(pin)
	if err != nil {
		return false
	}
	defer in.Close()
	cg, err := host.ResolveCgroup(path)
	if err != nil {
		t.Fatal(err)
	}
	return in.IsEnabled(cg.ID)
}

// enabled lists the paths of the cgroups bypass is enabled for.
func enabled(t *testing.T, pin string) []string {
	t.Helper()
	in, err := bypass.Open(pin)
	if err != nil {
		return nil
	}
	defer in.Close()
	cgs, err := in.Cgroups()
	if err != nil {
		t.Fatal(err)
	}
	var out []string
	for _, c := range cgs {
		out = append(out, c.Path)
	}
	sort.Strings(out)
	return out
}

// waitEnabled waits until exactly want are enabled and returns how long
// that took.
func waitEnabled(t *testing.T, pin string, want ...string) time.Duration {
	t.Helper()
	sort.Strings(want)
	start := time.Now()
	for {
		got := enabled(t, pin)
		if strings.Join(got, " ") == strings.Join(want, " ") {
			return time.Since(start)
		}
		if time.Since(start) > 10*time.Second {
			t.Fatalf("enabled %v, want %v", got, want)
		}
		time.Sleep(5 * time.Millisecond)
	}
}

// The agent enables what its patterns match less what is excluded, a new
// matching cgroup as it appears, follows a changed configuration, keeps
// the previous one when the new one is bad, and leaves bypass as it is
// when it stops.
func TestAgentHoldsTheDeclaredCgroups(t *testing.T) {
	testenv.RequireRoot(t)
	pin := bypasstest.MustPinDir(t)
	parent := testenv.MustCgroup(t).Path
	app1 := mkCgroup(t, parent, "app-1")
	app2 := mkCgroup(t, parent, "app-2")
	mkCgroup(t, parent, "other")
	config := filepath.Join(t.TempDir(), "config.yaml")
	writeConfig(t, config, fmt.Sprintf("bypass:\n  cgroups: [%q]\n  exclude: [%q]\n", parent+"/app-*", app2))

	log := runAgent(t, config, pin)
	waitEnabled(t, pin, app1)

	// A new cgroup that matches: enabled as soon as it appears.
	app3 := mkCgroup(t, parent, "app-3")
	took := waitEnabled(t, pin, app1, app3)
	t.Logf("a new matching cgroup was enabled %v after its creation", took)

	// Bypass works in it: a connection between two of its processes'
	// sockets is paired.
	side := testenv.Side{NS: testenv.MustNetNS(t), CG: host.Cgroup{Path: app3, ID: cgroupID(t, app3)}}
	c, s := testenv.ConnPair(t, "tcp4", side, "127.0.0.1:0", side, "127.0.0.1:0")
	testenv.Warm(t, c, s)
	if n := paired(t, pin); n < 1 {
		t.Errorf("%d connections paired in a cgroup the agent enabled", n)
	}
	if !guard.Running(pin) {
		t.Error("no guard runs for the install the agent made")
	}

	// The configuration changes: app-1 is no longer named.
	writeConfig(t, config, fmt.Sprintf("bypass:\n  cgroups: [%q]\n", app3))
	waitEnabled(t, pin, app3)

	// A bad configuration is reported and changes nothing.
	writeConfig(t, config, "bypass:\n  cgroup: [\"/x\"]\n")
	deadline := time.Now().Add(10 * time.Second)
	for !strings.Contains(log.String(), "field cgroup not found") {
		if time.Now().After(deadline) {
			t.Fatalf("the bad configuration was not reported:\n%s", log)
		}
		time.Sleep(10 * time.Millisecond)
	}
	if got := enabled(t, pin); len(got) != 1 || got[0] != app3 {
		t.Errorf("after a bad configuration: enabled %v, want [%s]", got, app3)
	}
	// The previous configuration still holds: a cgroup it does not name
	// stays off.
	mkCgroup(t, parent, "app-4")
	time.Sleep(200 * time.Millisecond)
	if got := enabled(t, pin); len(got) != 1 {
		t.Errorf("enabled %v after app-4 appeared under the kept configuration", got)
	}
}

// A pattern with a wildcard above its last component ("pods/*/app-*", as
// kubelet nests containers in pods): the agent watches each level, so a
// matching cgroup inside a directory that appears after it started, or that
// was removed and made again, is enabled too.
func TestAgentFollowsNestedPatterns(t *testing.T) {
	testenv.RequireRoot(t)
	pin := bypasstest.MustPinDir(t)
	parent := testenv.MustCgroup(t).Path
	config := filepath.Join(t.TempDir(), "config.yaml")
	writeConfig(t, config, fmt.Sprintf("bypass:\n  cgroups: [%q]\n  guard: false\n", parent+"/pod-*/app-*"))
	runAgent(t, config, pin)

	pod := mkCgroup(t, parent, "pod-1")
	app := mkCgroup(t, pod, "app-a")
	waitEnabled(t, pin, app)

	// The pod goes (rmdir of both) and comes back.
	if err := os.Remove(app); err != nil {
		t.Fatal(err)
	}
	if err := os.Remove(pod); err != nil {
		t.Fatal(err)
	}
	waitEnabled(t, pin)
	if err := os.Mkdir(pod, 0o755); err != nil {
		t.Fatal(err)
	}
	again := mkCgroup(t, pod, "app-b")
	waitEnabled(t, pin, again)
}

// Stopping the agent leaves bypass running: state is pinned.
func TestAgentStopLeavesBypass(t *testing.T) {
	testenv.RequireRoot(t)
	pin := bypasstest.MustPinDir(t)
	parent := testenv.MustCgroup(t).Path
	app := mkCgroup(t, parent, "app")
	config := filepath.Join(t.TempDir(), "config.yaml")
	writeConfig(t, config, fmt.Sprintf("bypass:\n  cgroups: [%q]\n  guard: false\n", app))

	log := &testenv.SyncBuffer{}
	a, err := agent.New(agent.Options{ConfigPath: config, PinDir: pin, Features: host.Probe(), Log: log})
	if err != nil {
		t.Fatal(err)
	}
	ctx, cancel := context.WithCancel(context.Background())
	done := make(chan error, 1)
	go func() { done <- a.Run(ctx) }()
	waitEnabled(t, pin, app)
	if guard.Running(pin) {
		t.Error("a guard runs although the configuration says guard: false")
	}
	cancel()
	if err := <-done; err != nil {
		t.Fatal(err)
	}
	if got := enabled(t, pin); len(got) != 1 || got[0] != app {
		t.Errorf("after the agent stopped: enabled %v, want [%s]", got, app)
	}
}

// Bad configurations: one line naming the field; nothing is done.
func TestConfigErrors(t *testing.T) {
	root := "/sys/fs/cgroup"
	for _, tc := range []struct{ yaml, want string }{
		{"bypass:\n  cgroup: [\"/sys/fs/cgroup/a\"]\n", "field cgroup not found"},
		{"bypass:\n  cgroups: [\"app-*\"]\n", `bypass.cgroups[0]: "app-*" is not an absolute path`},
		{"bypass:\n  cgroups: [\"/sys/fs/cgroup/a\", \"/etc/*\"]\n", `bypass.cgroups[1]: "/etc/*" is outside the cgroup v2 hierarchy`},
		{"bypass:\n  exclude: [\"/sys/fs/cgroup/[a\"]\n", `bypass.exclude[0]: "/sys/fs/cgroup/[a" is not a valid pattern`},
		{"bypass:\n  cgroups: [\"/sys/fs/cgroup/a/../b\"]\n", "is not a clean path"},
		{"metrics:\n  address: \"9464\"\n", `metrics.address: "9464" is not HOST:PORT`},
		// Found here, not after the agent has enabled cgroups.
		{"metrics: {address: \"127.0.0.1:9464\", token_file: token}\n", `metrics.token_file: "token" is not an absolute path`},
		{"metrics:\n  address: \"127.0.0.1:99999\"\n", `metrics.address: "127.0.0.1:99999": port "99999" is not a number from 0 to 65535`},
		{"metrics:\n  address: \"999.1.1.1:9464\"\n", `metrics.address: "999.1.1.1:9464": host "999.1.1.1" is not an IP address`},
		{"bypass: {cgroups: [\"/sys/fs/cgroup/a\"]}\n---\nbypass: {cgroups: [\"/sys/fs/cgroup/b\"]}\n", "line 2: a second YAML document (after ---): the configuration is one"},
		{"metrics: {address: 127.0.0.1:9464}\nindex: {enabled: maybe}\n", "cannot unmarshal"},
		{"bypass: [\n", "did not find expected"},
		{"kubernetes: {node_name: n, driver: docker}\n", `kubernetes.driver: "docker" is not systemd, cgroupfs or empty`},
		{"kubernetes: {driver: systemd}\n", "kubernetes.node_name: empty, and NODE_NAME is not set"},
		{"kubernetes: {node_name: n, labels: {\"a b\": x}}\n", "kubernetes.labels:"},
		{"kubernetes: {node_name: n, cgroup_root: /etc}\n", `kubernetes.cgroup_root: "/etc" is not a directory of the cgroup v2 hierarchy`},
		{"kubernetes: {node_name: n, namespace: [a]}\n", "field namespace not found in kubernetes (it takes node_name"},
	} {
		_, err := agent.ParseConfig([]byte(tc.yaml), agent.ConfigEnv{CgroupRoot: root})
		if err == nil || !strings.Contains(err.Error(), tc.want) || strings.Contains(err.Error(), "\n") {
			t.Errorf("%q: error %v, want one line with %q", tc.yaml, err, tc.want)
		}
	}
	// The example, as written.
	cfg, err := agent.ParseConfig([]byte(`bypass: {cgroups: ["/sys/fs/cgroup/app-*"]}`+"\n"+`metrics: {address: "127.0.0.1:9464"}`), agent.ConfigEnv{CgroupRoot: root})
	if err != nil || cfg.Bypass.Cgroups[0] != "/sys/fs/cgroup/app-*" || cfg.Metrics.Address != "127.0.0.1:9464" || !cfg.GuardOn() {
		t.Errorf("example: %+v, %v", cfg, err)
	}
	if cfg, err := agent.ParseConfig(nil, agent.ConfigEnv{CgroupRoot: root}); err != nil || len(cfg.Bypass.Cgroups) != 0 {
		t.Errorf("an empty file: %+v, %v; want a configuration that asks for nothing", cfg, err)
	}
}

func cgroupID(t *testing.T, path string) uint64 {
	t.Helper()
	cg, err := host.ResolveCgroup(path)
	if err != nil {
		t.Fatal(err)
	}
	return cg.ID
}

func paired(t *testing.T, pin string) uint64 {
	t.Helper()
	in, err := bypass.Open(pin)
	if err != nil {
		t.Fatal(err)
	}
	defer in.Close()
	st, err := in.Stats()
	if err != nil {
		t.Fatal(err)
	}
	return st.Counters.Paired
}

// Someone removes the agent's install (`shunt bypass disable --all` on
// the node): the agent puts it back and guards it at once, not at its
// next resync (30 s), since its guard sees the removal. Before, the guard
// ended and nothing ran until the resync: no install, and no guard for
// one that another command put back meanwhile.
func TestAgentRestoresARemovedInstall(t *testing.T) {
	pin, app, config := mustOneCgroup(t, "app-1")
	log := runAgent(t, config, pin)
	waitEnabled(t, pin, app)
	for deadline := time.Now().Add(5 * time.Second); !guard.Running(pin); time.Sleep(10 * time.Millisecond) {
		if time.Now().After(deadline) {
			t.Fatal("no guard runs for the install the agent made")
		}
	}

	func() {
		release, err := runlock.Lock("install", pin, 10*time.Second, nil)
		if err != nil {
			t.Fatal(err)
		}
		defer release()
		in, err := bypass.Open(pin)
		if err != nil {
			t.Fatal(err)
		}
		ctx, cancel := context.WithTimeout(context.Background(), 10*time.Second)
		defer cancel()
		if err := in.Remove(ctx); err != nil {
			t.Fatal(err)
		}
	}()
	start := time.Now()
	for strings.Join(enabled(t, pin), " ") != app || !guard.Running(pin) {
		if time.Since(start) > 5*time.Second {
			t.Fatalf("5 s after its install was removed: enabled %v, guard running %v; want it back at once:\n%s", enabled(t, pin), guard.Running(pin), log)
		}
		time.Sleep(10 * time.Millisecond)
	}
	t.Logf("install and guard back %v after the removal", time.Since(start))
}

// A guard that cannot run (a kernel that refuses its programs) is said once
// per reconciliation and never holds the guard's lock: a guard holding it
// counts as running, and one that ended at once was started again at once,
// in a loop.
func TestAgentGuardThatCannotRunHoldsNothing(t *testing.T) {
	pin, app, config := mustOneCgroup(t, "app")
	refused := func(*bypass.Install) error { return errors.New("refused (test)") }
	log := runAgentWith(t, agent.WithGuardCheck(agent.Options{ConfigPath: config, PinDir: pin,
		IndexDir: filepath.Join(pin, "no-index"), Version: "test", Features: host.Probe()}, refused))
	waitEnabled(t, pin, app)
	for deadline := time.Now().Add(time.Second); time.Now().Before(deadline); time.Sleep(10 * time.Millisecond) {
		if guard.Running(pin) {
			t.Fatal("the guard's lock is held although the guard cannot run")
		}
	}
	if n := strings.Count(log.String(), "guard: cannot run: refused (test)"); n == 0 || n > 3 {
		t.Errorf("the guard's failure said %d times in a second, want once per reconciliation", n)
	}
}
