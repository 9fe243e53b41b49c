package testenv

import (
	"path/filepath"
	"testing"

	"github.com/shunt-project/shunt/host"
	"github.com/shunt-project/shunt/internal/lab"
)

// MustCgroup creates a cgroup v2 directory, removed in cleanup.
func MustCgroup(t testing.TB) host.Cgroup {
	t.Helper()
	return mustNewCgroup(t, Name())
}

// mustNewCgroup creates the cgroup at name, relative to the hierarchy's
// root, removed in cleanup.
func mustNewCgroup(t testing.TB, name string) host.Cgroup {
	t.Helper()
	cg, remove, err := lab.NewCgroup(name)
	if err != nil {
		t.Fatal(err)
	}
	t.Cleanup(func() {
		if err := remove(); err != nil {
			t.Error(err)
		}
	})
	return cg
}

// InCgroup runs fn with the test process moved into cg (see lab.InCgroup).
func InCgroup(t testing.TB, cg host.Cgroup, fn func()) {
	t.Helper()
	if err := lab.InCgroup(cg, func() error { fn(); return nil }); err != nil {
		t.Fatal(err)
	}
}

// MustChildCgroup creates a cgroup v2 directory named name inside parent,
// removed in cleanup (before parent, which was made first).
func MustChildCgroup(t testing.TB, parent host.Cgroup, name string) host.Cgroup {
	t.Helper()
	root, err := host.Cgroup2Root()
	if err != nil {
		t.Fatal(err)
	}
	rel, err := filepath.Rel(root, filepath.Join(parent.Path, name))
	if err != nil {
		t.Fatal(err)
	}
	return mustNewCgroup(t, rel)
}
