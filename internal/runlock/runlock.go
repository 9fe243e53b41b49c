// Package runlock keeps shunt's lock files under /run/shunt: one per pin
// directory and purpose, held with flock(2) while a process works on that
// install, released by the kernel when it exits, however it exits.
//
// flock needs only a read-only descriptor, so a lock file another user can
// open is a lock another user can hold: shunt's commands would wait on it
// and a guard would not start while status said one runs. The directory is
// root's alone (0700) and the files 0600; a directory or file an older shunt
// left open to all is closed on the next lock.
package runlock

import (
	"bufio"
	"errors"
	"fmt"
	"io/fs"
	"os"
	"path/filepath"
	"strconv"
	"strings"
	"time"

	"golang.org/x/sys/unix"

	"github.com/shunt-project/shunt/internal/owned"
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

// EnsureDir makes Dir, private to the user shunt runs as (root): refused if
// it is not a directory or belongs to another user.
func EnsureDir() error {
	if err := os.MkdirAll(Dir, 0o700); err != nil {
		return err
	}
	fi, err := owned.Dir(Dir)
	if err != nil {
		return err
	}
	if fi == nil {
		return fmt.Errorf("%s went away while shunt made it", Dir)
	}
	if fi.Mode().Perm() != 0o700 {
		return os.Chmod(Dir, 0o700)
	}
	return nil
}

// Lock takes the lock, waiting up to wait for it (0: not at all; then
// ErrHeld). waiting, if not nil, is called once if it has to wait.
func Lock(purpose, pinDir string, wait time.Duration, waiting func()) (release func(), err error) {
	deadline := time.Now().Add(wait)
	told := false
	for {
		f, err := open(Path(purpose, pinDir))
		if err != nil {
			return nil, err
		}
		for {
			err := unix.Flock(int(f.Fd()), unix.LOCK_EX|unix.LOCK_NB)
			if err == nil {
				break
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
		if current(f) {
			return func() { f.Close() }, nil
		}
		// Its holder removed the file (Remove) while we waited on it: the
		// lock is the file now at the path, made anew.
		f.Close()
	}
}

// open opens (making it if need be) the lock file at path, 0600 in Dir.
func open(path string) (*os.File, error) {
	if err := EnsureDir(); err != nil {
		return nil, err
	}
	f, err := os.OpenFile(path, os.O_CREATE|os.O_RDWR|unix.O_NOFOLLOW, 0o600)
	if errors.Is(err, os.ErrNotExist) {
		// Dir removed by Remove between the two calls.
		if err := EnsureDir(); err != nil {
			return nil, err
		}
		f, err = os.OpenFile(path, os.O_CREATE|os.O_RDWR|unix.O_NOFOLLOW, 0o600)
	}
	if err != nil {
		return nil, err
	}
	if fi, err := f.Stat(); err == nil && fi.Mode().Perm() != 0o600 {
		if err := f.Chmod(0o600); err != nil {
			f.Close()
			return nil, err
		}
	}
	return f, nil
}

// current says whether f is still the file at its path.
func current(f *os.File) bool {
	var held, now unix.Stat_t
	if unix.Fstat(int(f.Fd()), &held) != nil || unix.Lstat(f.Name(), &now) != nil {
		return false
	}
	return held.Dev == now.Dev && held.Ino == now.Ino
}

// Remove deletes the lock file, and Dir if nothing else is left in it, so
// that removing shunt leaves nothing behind. Only the lock's holder may
// call it, before it releases: a process waiting on the removed file finds
// it gone once it gets the lock and takes a new one, so two never hold it.
func Remove(purpose, pinDir string) error {
	if err := os.Remove(Path(purpose, pinDir)); err != nil && !errors.Is(err, os.ErrNotExist) {
		return err
	}
	_ = os.Remove(Dir) // fails while other files are in it
	return nil
}

// RemoveIfFree removes the lock file if no process holds the lock.
func RemoveIfFree(purpose, pinDir string) error {
	if _, err := os.Lstat(Path(purpose, pinDir)); errors.Is(err, os.ErrNotExist) {
		return nil
	}
	release, err := Lock(purpose, pinDir, 0, nil)
	if errors.Is(err, ErrHeld) {
		return nil
	}
	if err != nil {
		return err
	}
	defer release()
	return Remove(purpose, pinDir)
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
	_ = unix.Flock(int(f.Fd()), unix.LOCK_UN)
	return false
}

// Holders names the processes that hold the lock ("pid 12 (shunt, uid
// 0)"), from /proc/locks; empty if none or unknown. A lock held by
// something other than shunt (a descriptor opened while the file was open
// to all) is found this way.
func Holders(purpose, pinDir string) []string {
	var st unix.Stat_t
	if err := unix.Stat(Path(purpose, pinDir), &st); err != nil {
		return nil
	}
	f, err := os.Open("/proc/locks")
	if err != nil {
		return nil
	}
	defer f.Close()
	var out []string
	sc := bufio.NewScanner(f)
	for sc.Scan() {
		// "1: FLOCK  ADVISORY  WRITE 1234 00:19:5678 0 EOF"
		fields := strings.Fields(sc.Text())
		if len(fields) < 6 || fields[1] != "FLOCK" {
			continue
		}
		dev := strings.Split(fields[5], ":")
		if len(dev) != 3 || dev[2] != strconv.FormatUint(st.Ino, 10) {
			continue
		}
		pid, err := strconv.Atoi(fields[4])
		if err != nil {
			continue
		}
		out = append(out, describe(pid))
	}
	return out
}

func describe(pid int) string {
	comm, _ := os.ReadFile(fmt.Sprintf("/proc/%d/comm", pid))
	var st unix.Stat_t
	if unix.Stat(fmt.Sprintf("/proc/%d", pid), &st) != nil {
		return fmt.Sprintf("pid %d", pid)
	}
	return fmt.Sprintf("pid %d (%s, uid %d)", pid, strings.TrimSpace(string(comm)), st.Uid)
}

// InDir makes dir and then runs create, which makes a file in it (binds a
// socket there); again if dir went away in between: removing shunt removes
// an empty Dir (Remove), which a daemon starting at that moment would
// otherwise meet as ENOENT. Only dir itself is made: a path whose parent is
// missing is a mistake to report (a typo would otherwise leave a tree of
// directories behind).
func InDir(dir string, perm os.FileMode, create func() error) error {
	for try := 1; ; try++ {
		if err := os.Mkdir(dir, perm); err != nil && !errors.Is(err, fs.ErrExist) {
			if errors.Is(err, fs.ErrNotExist) {
				return fmt.Errorf("directory %s does not exist", filepath.Dir(dir))
			}
			return err
		}
		err := create()
		if err == nil || !errors.Is(err, unix.ENOENT) || try == 3 {
			return err
		}
	}
}
