// Package bypasstest holds the test helpers that need a bypass install: a
// pin directory whose install is removed when the test ends, and a guard
// running beside a test. internal/testenv stays a leaf every package's
// tests can use; this is where cleanup that knows bypass and the guard is
// registered.
package bypasstest

import (
	"context"
	"os"
	"testing"
	"time"

	"github.com/shunt-project/shunt/bypass"
	"github.com/shunt-project/shunt/guard"
	"github.com/shunt-project/shunt/internal/runlock"
	"github.com/shunt-project/shunt/internal/testenv"
)

// MustPinDir is testenv.MustPinDir for a directory a bypass install may be
// made in: when the test ends that install is removed (drained first), its
// learned programs and its guard's lock and log go too.
func MustPinDir(t testing.TB) string {
	t.Helper()
	dir := testenv.MustPinDir(t)
	// Cleanups run last-registered first: this one before testenv's
	// removal of the directory.
	t.Cleanup(func() {
		if in, err := bypass.Open(dir); err == nil {
			ctx, cancel := context.WithTimeout(context.Background(), 5*time.Second)
			defer cancel()
			if err := in.Remove(ctx); err != nil {
				t.Errorf("remove install at %s: %v", dir, err)
			}
		}
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

// RunGuard runs the guard on in until the test ends, telling report what
// it says; the test fails if the guard ends with an error.
func RunGuard(t testing.TB, in *bypass.Install, report func(string)) {
	t.Helper()
	ctx, cancel := context.WithCancel(context.Background())
	done := make(chan error, 1)
	go func() { done <- guard.Run(ctx, in, report) }()
	t.Cleanup(func() {
		cancel()
		if err := <-done; err != nil {
			t.Errorf("guard: %v", err)
		}
	})
}
