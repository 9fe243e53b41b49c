package pin_test

import (
	"os"
	"path/filepath"
	"strings"
	"testing"

	"github.com/shunt-project/shunt/host"
	"github.com/shunt-project/shunt/internal/pin"
	"github.com/shunt-project/shunt/internal/testenv"
)

// squat makes dir as another user would on a bpffs mounted 1777.
func squat(t *testing.T, uid int, mode os.FileMode) string {
	t.Helper()
	testenv.RequireRoot(t)
	dir := filepath.Join(host.BPFFSRoot, testenv.Name())
	if err := host.EnsureBPFFS(dir); err != nil {
		t.Fatal(err)
	}
	if err := os.Mkdir(dir, 0o700); err != nil {
		t.Fatal(err)
	}
	t.Cleanup(func() { os.RemoveAll(dir) })
	if err := os.Chown(dir, uid, uid); err != nil {
		t.Fatal(err)
	}
	if err := os.Chmod(dir, mode); err != nil {
		t.Fatal(err)
	}
	return dir
}

func build(tmp string) error { return os.Mkdir(filepath.Join(tmp, "maps"), 0o700) }

// A pin directory another user made first, or one others may write to, is
// refused, with what to do, and left as it was: before, root's objects were
// pinned into it, where its owner could unlink them.
func TestForeignDirectoryRefused(t *testing.T) {
	for _, c := range []struct {
		name string
		uid  int
		mode os.FileMode
		want string
	}{
		{"another user's", 65534, 0o755, "belongs to uid 65534"},
		{"writable by others", 0, 0o777, "is writable by other users"},
	} {
		t.Run(c.name, func(t *testing.T) {
			dir := squat(t, c.uid, c.mode)
			err := pin.Install(dir, build)
			if err == nil || !strings.Contains(err.Error(), c.want) || !strings.Contains(err.Error(), "remove it") {
				t.Fatalf("install over %s: %v, want an error saying %q and what to do", dir, err, c.want)
			}
			if _, err := os.Stat(filepath.Join(dir, "maps")); err == nil {
				t.Errorf("something was built into %s", dir)
			}
		})
	}
}

// An empty directory of shunt's own user (a leftover, or made by hand) is
// taken: before, enable then failed with "bypass is not enabled".
func TestEmptyLeftoverTaken(t *testing.T) {
	dir := squat(t, 0, 0o700)
	if err := pin.Install(dir, build); err != nil {
		t.Fatal(err)
	}
	if _, err := os.Stat(filepath.Join(dir, "maps")); err != nil {
		t.Errorf("the install is not in place: %v", err)
	}
}
