package testenv

import (
	"os"
	"path/filepath"
	"testing"

	"github.com/shunt-project/shunt/host"
)

// MustPinDir returns a fresh pin directory path under /sys/fs/bpf (not yet
// created); cleanup removes it and whatever is pinned in it. A directory a
// bypass install may be made in takes bypasstest.MustPinDir, which removes
// the install properly first.
func MustPinDir(t testing.TB) string {
	t.Helper()
	dir := filepath.Join(host.BPFFSRoot, Name())
	if err := host.EnsureBPFFS(dir); err != nil {
		t.Fatal(err)
	}
	t.Cleanup(func() { os.RemoveAll(dir) })
	return dir
}
