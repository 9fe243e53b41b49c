// Package testenv builds the real-kernel fixtures shunt's tests run in: network
// namespaces, veth links, cgroups and bpffs pin directories, each named with a
// shunt-test- prefix and removed in cleanup, also when the test fails.
package testenv

import (
	"os"
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
