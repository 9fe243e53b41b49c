// Package runlock keeps shunt's lock files under /run/shunt: one per pin
// directory and purpose, held with flock(2) while a process works on that
// install, released by the kernel when it exits, however it exits.
package runlock

import (
	"errors"
	"fmt"
	"os"
	"path/filepath"
	"strings"
	"time"

	"golang.org/x/sys/unix"
)

// Dir holds the lock files (and the guard's logs beside them).
const Dir = "/run/shunt"

// Path is the lock file of a purpose ("install", "guard") for pinDir.
func Path(purpose, pinDir string) string {
	name := strings.ReplaceAll(strings.Trim(filepath.Clean(pinDir), "/"), "/", "_")
	return filepath.Join(Dir, purpose+"-"+name+".lock")
}

// ErrHeld means another process holds the lock.
var ErrHeld = errors.New("held by another process")

// Lock takes the lock, waiting up to wait for it (0: not at all; then
// ErrHeld). waiting, if not nil, is called once if it has to wait.
func Lock(purpose, pinDir string, wait time.Duration, waiting func()) (release func(), err error) {
	if err := os.MkdirAll(Dir, 0o755); err != nil {
		return nil, err
	}
	f, err := os.OpenFile(Path(purpose, pinDir), os.O_CREATE|os.O_RDWR, 0o644)
	if err != nil {
		return nil, err
	}
	deadline := time.Now().Add(wait)
	for told := false; ; {
		err := unix.Flock(int(f.Fd()), unix.LOCK_EX|unix.LOCK_NB)
		if err == nil {
			return func() { f.Close() }, nil
		}
		if !errors.Is(err, unix.EWOULDBLOCK) {
			f.Close()
			return nil, fmt.Errorf("lock %s: %w", f.Name(), err)
		}
		if time.Now().After(deadline) {
			f.Close()
			return nil, ErrHeld
		}
		if !told && waiting != nil {
			waiting()
			told = true
		}
		time.Sleep(20 * time.Millisecond)
	}
}

// Held says whether some process holds the lock.
func Held(purpose, pinDir string) bool {
	f, err := os.Open(Path(purpose, pinDir))
	if err != nil {
		return false
	}
	defer f.Close()
	if err := unix.Flock(int(f.Fd()), unix.LOCK_SH|unix.LOCK_NB); err != nil {
		return errors.Is(err, unix.EWOULDBLOCK)
	}
	unix.Flock(int(f.Fd()), unix.LOCK_UN)
	return false
}
