package main

import (
	"bufio"
	"bytes"
	"io"
	"os"
	"os/exec"
	"path/filepath"
	"strings"
	"testing"

	"github.com/shunt-project/shunt/bench"
	"github.com/shunt-project/shunt/host"
	"github.com/shunt-project/shunt/internal/leakcheck"
	"github.com/shunt-project/shunt/internal/testenv"
)

// The test binary doubles as the shunt binary when SHUNT_TEST_MAIN=1, so
// tests can run shunt as another user or in another mount namespace.
func TestMain(m *testing.M) {
	bench.MaybeRunReapHolder()
	if os.Getenv("SHUNT_TEST_MAIN") == "1" {
		os.Exit(run(os.Args[1:], defaultEnv()))
	}
	// Processes shunt starts (the guard) run this binary as shunt too.
	os.Setenv("SHUNT_TEST_MAIN", "1")
	os.Exit(leakcheck.Main(m))
}

// runShunt runs a command line in-process.
func runShunt(t *testing.T, e *env, args ...string) (stdout, stderr string, code int) {
	t.Helper()
	var out, errb bytes.Buffer
	if e == nil {
		e = defaultEnv()
	}
	e.stdout, e.stderr = &out, &errb
	code = run(args, e)
	return out.String(), errb.String(), code
}

// shuntBinary returns a copy of the test binary that any user may run.
func shuntBinary(t *testing.T) string {
	t.Helper()
	self, err := os.Executable()
	if err != nil {
		t.Fatal(err)
	}
	dir, err := os.MkdirTemp("", "shunt-test-bin-")
	if err != nil {
		t.Fatal(err)
	}
	t.Cleanup(func() { os.RemoveAll(dir) })
	if err := os.Chmod(dir, 0o755); err != nil {
		t.Fatal(err)
	}
	dst := filepath.Join(dir, "shunt")
	src, err := os.Open(self)
	if err != nil {
		t.Fatal(err)
	}
	defer src.Close()
	f, err := os.OpenFile(dst, os.O_CREATE|os.O_WRONLY, 0o755)
	if err != nil {
		t.Fatal(err)
	}
	if _, err := io.Copy(f, src); err != nil {
		t.Fatal(err)
	}
	f.Close()
	return dst
}

// subprocess returns a command that runs shunt (the test binary) with args.
func subprocess(bin string, args ...string) *exec.Cmd {
	cmd := exec.Command(bin, args...)
	cmd.Env = append(os.Environ(), "SHUNT_TEST_MAIN=1")
	return cmd
}

// oneLine checks that a failure printed exactly one line naming the fix.
func oneLine(t *testing.T, stderr, want string) {
	t.Helper()
	lines := strings.Split(strings.TrimRight(stderr, "\n"), "\n")
	if len(lines) != 1 || !strings.HasPrefix(lines[0], "shunt: ") {
		t.Errorf("want one 'shunt: ...' line on stderr, got %q", stderr)
	}
	if !strings.Contains(stderr, want) {
		t.Errorf("stderr %q does not say %q", stderr, want)
	}
}

func mustCgroup2Root(t *testing.T) string {
	t.Helper()
	root, err := host.Cgroup2Root()
	if err != nil {
		t.Fatal(err)
	}
	return root
}

// running is a long-running shunt command started by startShunt.
type running struct {
	cmd   *exec.Cmd
	lines *bufio.Scanner // its stderr
}

// startShunt runs shunt (this test binary) with args in ns (nil: here) and
// waits for its first stderr line, which must contain want.
func startShunt(t *testing.T, ns *testenv.NetNS, want string, args ...string) *running {
	t.Helper()
	cmd := subprocess(os.Args[0], args...)
	if ns != nil {
		cmd = subprocess("nsenter", append([]string{"--net=/run/netns/" + ns.Name, os.Args[0]}, args...)...)
	}
	stderr, err := cmd.StderrPipe()
	if err != nil {
		t.Fatal(err)
	}
	if err := cmd.Start(); err != nil {
		t.Fatal(err)
	}
	t.Cleanup(func() { cmd.Process.Kill(); cmd.Wait() })
	r := &running{cmd: cmd, lines: bufio.NewScanner(stderr)}
	if !r.lines.Scan() || !strings.Contains(r.lines.Text(), want) {
		t.Fatalf("shunt %s said %q, want %q", args[0], r.lines.Text(), want)
	}
	return r
}

// wait collects the rest of stderr and the exit.
func (r *running) wait() ([]string, error) {
	var rest []string
	for r.lines.Scan() {
		rest = append(rest, r.lines.Text())
	}
	return rest, r.cmd.Wait()
}
