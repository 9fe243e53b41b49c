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
	if err := EnsureDir(); err != nil {
		return nil, err
	}
	f, err := os.OpenFile(Path(purpose, pinDir), os.O_CREATE|os.O_RDWR|unix.O_NOFOLLOW, 0o600)
	if err != nil {
		return nil, err
	}
	if fi, err := f.Stat(); err == nil && fi.Mode().Perm() != 0o600 {
		if err := f.Chmod(0o600); err != nil {
			f.Close()
			return nil, err
		}
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
