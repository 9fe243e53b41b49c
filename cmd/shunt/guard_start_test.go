package main

import (
	"context"
	"errors"
	"os"
	"os/exec"
	"strings"
	"syscall"
	"testing"
	"time"

	"github.com/shunt-project/shunt/bypass"
	"github.com/shunt-project/shunt/bypass/bypasstest"
	"github.com/shunt-project/shunt/guard"
	"github.com/shunt-project/shunt/internal/runlock"
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

// `disable --all` then `enable` at once: enable finds the guard of the old
// install still running and starts none, so that guard must guard the new
// install. Before, it kept reading the removed install's events, and a
// splice reader caught on the new one waited for ever.
func TestGuardFollowsAReplacedInstall(t *testing.T) {
	testenv.RequireRoot(t)
	pin := bypasstest.MustPinDir(t)
	side := testenv.Side{NS: testenv.MustNetNS(t), CG: testenv.MustCgroup(t)}
	install := func() *bypass.Install {
		in, err := bypass.Create(pin, bypass.Options{NoProbation: true})
		if err != nil {
			t.Fatal(err)
		}
		if _, err := in.Attach(side.CG); err != nil {
			t.Fatal(err)
		}
		return in
	}
	// Each change under the install lock, as the commands make it: the
	// guard sees the removal and the new install as one change.
	replace := func(in *bypass.Install, again bool) *bypass.Install {
		release, err := runlock.Lock("install", pin, 10*time.Second, nil)
		if err != nil {
			t.Fatal(err)
		}
		defer release()
		ctx, cancel := context.WithTimeout(context.Background(), 10*time.Second)
		defer cancel()
		if err := in.Remove(ctx); err != nil {
			t.Fatal(err)
		}
		in.Close()
		if again {
			return install()
		}
		return nil
	}

	release, err := guard.Lock(pin)
	if err != nil {
		t.Fatal(err)
	}
	defer release()
	ctx, cancel := context.WithCancel(context.Background())
	defer cancel()
	out := &testenv.SyncBuffer{}
	e := &env{stdout: out, stderr: out}
	first := install()
	watched, err := bypass.Open(pin)
	if err != nil {
		t.Fatal(err)
	}
	done := make(chan error, 1)
	go func() { done <- guardInstalls(ctx, e, pin, watched) }()

	second := replace(first, true)
	defer second.Close()
	c, s, caught := testenv.CaughtSplice(t, side)
	if r := <-caught; !errors.Is(r.Err, syscall.ECONNABORTED) {
		t.Fatalf("a splice reader caught on the new install got %v, want ECONNABORTED from the guard's reset; the guard said:\n%s", r.Err, out)
	}
	if !strings.Contains(out.String(), "replaced: guarding the new one") {
		t.Errorf("the guard did not say it guards the new install:\n%s", out)
	}

	c.Close()
	s.Close()
	replace(second, false)
	select {
	case err := <-done:
		if err != nil {
			t.Fatalf("guard after the removal: %v", err)
		}
	case <-time.After(10 * time.Second):
		t.Fatal("the guard still runs 10 s after its install was removed")
	}
	for _, purpose := range []string{"guard", "install"} {
		if _, err := os.Stat(runlock.Path(purpose, pin)); !os.IsNotExist(err) {
			t.Errorf("the %s lock file after the install was removed: %v", purpose, err)
		}
	}
}
