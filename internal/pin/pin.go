// Package pin installs a directory of pinned BPF objects atomically: it is
// built under a temporary name beside its final path and renamed into place,
// so a crash never leaves half an install where readers look for one.
package pin

import (
	"errors"
	"fmt"
	"os"
	"path/filepath"
	"syscall"

	"golang.org/x/sys/unix"

	"github.com/shunt-project/shunt/internal/owned"
)

// Claim makes sure a pin directory shunt is about to use is its own: if it
// exists, it must be a directory of the user shunt runs as that no one else
// may write to. bpffs is mounted world-writable (1777) by default, so any
// user can make a name first; root's maps pinned in a directory another
// user owns could be unlinked or replaced by that user. An empty directory
// of shunt's own that is not an install (a leftover, or made by hand) is
// removed, so the install can take its place.
func Claim(dir string) error {
	fi, err := owned.Dir(dir)
	if fi == nil || err != nil {
		return err
	}
	if fi.Mode().Perm()&0o022 != 0 {
		return fmt.Errorf("%s is writable by other users (mode %v): remove it", dir, fi.Mode().Perm())
	}
	if err := os.Remove(dir); err != nil && !errors.Is(err, syscall.ENOTEMPTY) && !errors.Is(err, syscall.EEXIST) {
		return err
	}
	return nil
}

// Install builds a new directory with build and renames it to dir. If dir
// appears meanwhile (a concurrent install), that one wins and Install
// returns nil: the caller opens whatever is at dir. A dir that is there
// already must pass Claim.
func Install(dir string, build func(tmp string) error) error {
	if err := Claim(dir); err != nil {
		return err
	}
	// bpffs refuses names with a dot, so temporaries are marked by suffix.
	tmp, err := os.MkdirTemp(filepath.Dir(dir), filepath.Base(dir)+"-new-")
	if err != nil {
		return fmt.Errorf("create pin directory: %w", err)
	}
	if err := build(tmp); err != nil {
		os.RemoveAll(tmp)
		return err
	}
	if err := RenameNoReplace(tmp, dir); err != nil {
		os.RemoveAll(tmp)
		if _, serr := os.Stat(dir); serr != nil {
			return fmt.Errorf("install %s: %w", dir, err)
		}
	}
	return nil
}

// RenameNoReplace renames atomically and fails with EEXIST rather than
// replacing what is already there.
func RenameNoReplace(from, to string) error {
	return unix.Renameat2(unix.AT_FDCWD, from, unix.AT_FDCWD, to, unix.RENAME_NOREPLACE)
}
