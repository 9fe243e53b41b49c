// Package pin installs a directory of pinned BPF objects atomically: it is
// built under a temporary name beside its final path and renamed into place,
// so a crash never leaves half an install where readers look for one.
package pin

import (
	"fmt"
	"os"
	"path/filepath"

	"golang.org/x/sys/unix"
)

// Install builds a new directory with build and renames it to dir. If dir
// appears meanwhile (a concurrent install), that one wins and Install
// returns nil: the caller opens whatever is at dir.
func Install(dir string, build func(tmp string) error) error {
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
