package main

import (
	"errors"
	"os"
	"os/exec"
	"strings"
	"syscall"
	"testing"
	"time"

	"github.com/shunt-project/shunt/bypass/bypasstest"
	"github.com/shunt-project/shunt/guard"
	"github.com/shunt-project/shunt/internal/testenv"
)

// startGuardWith runs startGuard with e.shunt replaced by a command line of
// the test's choosing, and returns the command it started.
func startGuardWith(t *testing.T, argv ...string) (*exec.Cmd, error) {
	t.Helper()
	testenv.RequireRoot(t) // the guard's log lives under /run/shunt
	pinDir := bypasstest.MustPinDir(t)
	t.Cleanup(func() { os.Remove(guard.LogPath(pinDir)) })
	var started *exec.Cmd
	e := defaultEnv()
	e.shunt = func(...string) *exec.Cmd {
		started = exec.Command(argv[0], argv[1:]...)
		return started
	}
	_, err := startGuard(e, pinDir)
	if started == nil {
		t.Fatal("startGuard started nothing")
	}
	return started, err
}

// A guard that exits before it takes its lock: enable says so at once, with
// how it ended. (Before, a goroutine's Wait raced the loop's read of the
// process state: go test -race flagged it.)
func TestStartGuardThatExits(t *testing.T) {
	start := time.Now()
	_, err := startGuardWith(t, "sh", "-c", "exit 3")
	if err == nil || !strings.Contains(err.Error(), "exit status 3") {
		t.Fatalf("startGuard: %v, want the guard's exit status 3", err)
	}
	if d := time.Since(start); d > 3*time.Second {
		t.Errorf("took %v to see the guard exit", d)
	}
}

// A guard that never takes its lock is stopped when enable gives up on it,
// not left running beside the next one (it was, before).
func TestStartGuardThatHangsIsStopped(t *testing.T) {
	cmd, err := startGuardWith(t, "sleep", "60")
	if err == nil {
		t.Fatal("startGuard succeeded with a guard that never took its lock")
	}
	if !strings.Contains(err.Error(), "did not start within") {
		t.Errorf("error %q does not say it timed out", err)
	}
	if err := cmd.Process.Signal(syscall.Signal(0)); !errors.Is(err, os.ErrProcessDone) {
		cmd.Process.Kill()
		t.Fatalf("the guard that never started still runs (signal 0: %v)", err)
	}
}
