package testenv

import (
	"context"
	"os"
	"path/filepath"
	"testing"
	"time"

	"github.com/shunt-project/shunt/bypass"
	"github.com/shunt-project/shunt/guard"
	"github.com/shunt-project/shunt/host"
	"github.com/shunt-project/shunt/internal/runlock"
)

// MustPinDir returns a fresh pin directory path under /sys/fs/bpf (not yet
// created). Cleanup removes whatever was installed there, draining first.
func MustPinDir(t testing.TB) string {
	t.Helper()
	dir := filepath.Join(host.BPFFSRoot, Name())
	if err := host.EnsureBPFFS(dir); err != nil {
		t.Fatal(err)
	}
	t.Cleanup(func() {
		if in, err := bypass.Open(dir); err == nil {
			ctx, cancel := context.WithTimeout(context.Background(), 5*time.Second)
			defer cancel()
			if err := in.Remove(ctx); err != nil {
				t.Errorf("remove install at %s: %v", dir, err)
			}
		}
		os.RemoveAll(dir)
		os.RemoveAll(bypass.LearnedDir(dir))
		// A guard (started by the CLI's enable) ends once the install is
		// gone; then its lock and log go too.
		for deadline := time.Now().Add(5 * time.Second); guard.Running(dir) && time.Now().Before(deadline); {
			time.Sleep(20 * time.Millisecond)
		}
		os.Remove(guard.LockPath(dir))
		os.Remove(guard.LogPath(dir))
		os.Remove(runlock.Path("install", dir))
	})
	return dir
}
