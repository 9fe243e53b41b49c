// Package testenv builds the real-kernel fixtures shunt's tests run in: network
// namespaces, veth links, cgroups and bpffs pin directories, each named with a
// shunt-test- prefix and removed in cleanup, also when the test fails.
package testenv

import (
	"os"
	"os/exec"
	"testing"

	"github.com/shunt-project/shunt/internal/lab"
)

// RequireRoot skips a test that needs root, except under CI (CI=true), where
// nothing may skip: there the test fails instead.
func RequireRoot(t testing.TB) {
	t.Helper()
	if os.Geteuid() == 0 {
		return
	}
	if os.Getenv("CI") == "true" {
		t.Fatal("this test needs root, and CI must run every test: run the tests as root")
	}
	t.Skip("needs root (real BPF programs, namespaces and cgroups)")
}

// Name returns a fresh name with the shunt-test- prefix.
func Name() string { return lab.Name("shunt-test-") }

// NeedProgram fails the test if a program it runs is missing (CI installs
// them all: scripts/deps.sh), and skips it outside CI.
func NeedProgram(t testing.TB, name string) {
	t.Helper()
	if _, err := exec.LookPath(name); err != nil {
		if os.Getenv("CI") != "" {
			t.Fatalf("%s is not installed: scripts/deps.sh installs it", name)
		}
		t.Skipf("%s is not installed (scripts/deps.sh installs it)", name)
	}
}
