package runlock_test

import (
	"errors"
	"os"
	"os/exec"
	"path/filepath"
	"strconv"
	"strings"
	"syscall"
	"testing"
	"time"

	"github.com/shunt-project/shunt/internal/runlock"
	"github.com/shunt-project/shunt/internal/testenv"
)

// nobody is the unprivileged user the tests act as.
const nobody = 65534

// asNobody runs argv as an unprivileged user and returns its output and
// whether it succeeded.
func asNobody(t *testing.T, argv ...string) (string, bool) {
	t.Helper()
	cmd := exec.Command(argv[0], argv[1:]...)
	cmd.SysProcAttr = &syscall.SysProcAttr{Credential: &syscall.Credential{Uid: nobody, Gid: nobody}}
	out, err := cmd.CombinedOutput()
	return string(out), err == nil
}

// pinDir is a pin directory name of the test's own, so its lock files are
// its own.
func pinDir(t *testing.T) string {
	dir := "/sys/fs/bpf/" + testenv.Name()
	t.Cleanup(func() {
		for _, purpose := range []string{"test", "test-legacy"} {
			os.Remove(runlock.Path(purpose, dir))
		}
	})
	return dir
}

// No other user can open a lock file, so none can hold a lock: flock(2)
// needs only a read-only descriptor. Before, the files were 0644 in a 0755
// directory, and `flock -n FILE sleep` as nobody held root's commands up.
func TestOtherUsersCannotHoldLocks(t *testing.T) {
	testenv.RequireRoot(t)
	testenv.NeedProgram(t, "flock")
	pin := pinDir(t)
	release, err := runlock.Lock("test", pin, 0, nil)
	if err != nil {
		t.Fatal(err)
	}
	release()
	for path, want := range map[string]os.FileMode{runlock.Dir: 0o700, runlock.Path("test", pin): 0o600} {
		fi, err := os.Stat(path)
		if err != nil {
			t.Fatal(err)
		}
		if fi.Mode().Perm() != want {
			t.Errorf("%s has mode %v, want %v", path, fi.Mode().Perm(), want)
		}
	}
	if out, ok := asNobody(t, "flock", "-n", "-s", runlock.Path("test", pin), "true"); ok {
		t.Errorf("an unprivileged user took the lock: %s", out)
	}
}

// A directory and a file an older shunt left open to all are closed on the
// next lock.
func TestLegacyModesClosed(t *testing.T) {
	testenv.RequireRoot(t)
	pin := pinDir(t)
	if err := os.MkdirAll(runlock.Dir, 0o700); err != nil {
		t.Fatal(err)
	}
	if err := os.Chmod(runlock.Dir, 0o755); err != nil {
		t.Fatal(err)
	}
	path := runlock.Path("test-legacy", pin)
	if err := os.WriteFile(path, nil, 0o644); err != nil {
		t.Fatal(err)
	}
	if err := os.Chmod(path, 0o644); err != nil {
		t.Fatal(err)
	}
	release, err := runlock.Lock("test-legacy", pin, 0, nil)
	if err != nil {
		t.Fatal(err)
	}
	defer release()
	for p, want := range map[string]os.FileMode{runlock.Dir: 0o700, path: 0o600} {
		if fi, err := os.Stat(p); err != nil || fi.Mode().Perm() != want {
			t.Errorf("%s: %v %v, want mode %v", p, fi.Mode(), err, want)
		}
	}
}

// A lock held elsewhere is refused with ErrHeld, and its holder is named.
func TestHolderNamed(t *testing.T) {
	testenv.RequireRoot(t)
	pin := pinDir(t)
	release, err := runlock.Lock("test", pin, 0, nil)
	if err != nil {
		t.Fatal(err)
	}
	defer release()
	if _, err := runlock.Lock("test", pin, 0, nil); err != runlock.ErrHeld {
		t.Fatalf("second lock: %v, want ErrHeld", err)
	}
	h := runlock.Holders("test", pin)
	want := "pid " + strconv.Itoa(os.Getpid()) + " ("
	if len(h) != 1 || !strings.HasPrefix(h[0], want) || !strings.HasSuffix(h[0], "uid 0)") {
		t.Errorf("holders %q, want one starting %q and naming uid 0", h, want)
	}
	if filepath.Dir(runlock.Path("test", pin)) != runlock.Dir {
		t.Errorf("lock file outside %s", runlock.Dir)
	}
}

// Removing the lock file under a waiter: the waiter, once the holder
// releases, takes the new file at the path, not the removed one; a third
// process locking meanwhile must not hold it at the same time.
func TestRemoveUnderAWaiter(t *testing.T) {
	testenv.RequireRoot(t)
	pin := pinDir(t)
	release, err := runlock.Lock("test", pin, 0, nil)
	if err != nil {
		t.Fatal(err)
	}
	got := make(chan func(), 1)
	go func() {
		r, err := runlock.Lock("test", pin, 10*time.Second, nil)
		if err != nil {
			t.Error(err)
			r = func() {}
		}
		got <- r
	}()
	time.Sleep(100 * time.Millisecond) // the waiter has opened the old file
	if err := runlock.Remove("test", pin); err != nil {
		t.Fatal(err)
	}
	// A newcomer makes the new file and holds it: the waiter must wait on.
	newcomer, err := runlock.Lock("test", pin, 0, nil)
	if err != nil {
		t.Fatalf("a newcomer after the removal: %v", err)
	}
	release()
	select {
	case r := <-got:
		r()
		t.Fatal("the waiter took the removed file's lock while a newcomer held the new one")
	case <-time.After(300 * time.Millisecond):
	}
	newcomer()
	select {
	case r := <-got:
		defer r()
	case <-time.After(5 * time.Second):
		t.Fatal("the waiter never took the lock")
	}
	if runlock.Holders("test", pin) == nil {
		t.Error("the waiter holds no lock on the file at the path")
	}
	if err := runlock.Remove("test", pin); err != nil {
		t.Fatal(err)
	}
	if _, err := os.Stat(runlock.Path("test", pin)); !os.IsNotExist(err) {
		t.Errorf("lock file after Remove: %v", err)
	}
}

// RemoveIfFree leaves a held lock's file alone and removes a free one's.
func TestRemoveIfFree(t *testing.T) {
	testenv.RequireRoot(t)
	pin := pinDir(t)
	release, err := runlock.Lock("test", pin, 0, nil)
	if err != nil {
		t.Fatal(err)
	}
	if err := runlock.RemoveIfFree("test", pin); err != nil {
		t.Fatal(err)
	}
	if _, err := os.Stat(runlock.Path("test", pin)); err != nil {
		t.Fatalf("a held lock's file was removed: %v", err)
	}
	release()
	if err := runlock.RemoveIfFree("test", pin); err != nil {
		t.Fatal(err)
	}
	if _, err := os.Stat(runlock.Path("test", pin)); !os.IsNotExist(err) {
		t.Errorf("a free lock's file is still there: %v", err)
	}
}

// A directory removed between its making and a bind in it (removing shunt
// removes an empty Dir while a daemon starts) is made again and the bind
// retried.
func TestInDirMakesTheDirectoryAgain(t *testing.T) {
	dir := filepath.Join(t.TempDir(), "run")
	tries := 0
	err := runlock.InDir(dir, 0o700, func() error {
		tries++
		if tries == 1 {
			if err := os.Remove(dir); err != nil {
				t.Fatal(err)
			}
		}
		return syscall.Mkfifo(filepath.Join(dir, "sock"), 0o600)
	})
	if err != nil || tries != 2 {
		t.Fatalf("InDir: %v after %d tries, want success on the second", err, tries)
	}
	tries = 0
	err = runlock.InDir(dir, 0o700, func() error { tries++; return syscall.EACCES })
	if !errors.Is(err, syscall.EACCES) || tries != 1 {
		t.Fatalf("InDir with another error: %v after %d tries, want it at once", err, tries)
	}
}

// Only the last directory is made: a socket path whose parent is missing
// (a typo in --socket) is reported, and no directory is left behind.
func TestInDirMakesNoTree(t *testing.T) {
	top := filepath.Join(t.TempDir(), "missing")
	called := false
	err := runlock.InDir(filepath.Join(top, "run"), 0o700, func() error { called = true; return nil })
	if err == nil || called || !strings.Contains(err.Error(), top+" does not exist") {
		t.Fatalf("InDir under a missing directory: %v (create called: %v), want an error naming %s", err, called, top)
	}
	if _, err := os.Stat(top); !os.IsNotExist(err) {
		t.Errorf("%s was made: %v", top, err)
	}
}
