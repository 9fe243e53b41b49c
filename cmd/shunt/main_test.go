package main

import (
	"github.com/shunt-project/shunt/bench"

	"bytes"
	"io"
	"os"
	"os/exec"
	"path/filepath"
	"strings"
	"testing"

	"github.com/shunt-project/shunt/host"
)

// The test binary doubles as the shunt binary when SHUNT_TEST_MAIN=1, so
// tests can run shunt as another user or in another mount namespace.
func TestMain(m *testing.M) {
	bench.MaybeRunReapHolder()
	if os.Getenv("SHUNT_TEST_MAIN") == "1" {
		os.Exit(run(os.Args[1:], defaultEnv()))
	}
	os.Exit(m.Run())
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
