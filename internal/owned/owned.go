// Package owned checks that a directory shunt is about to use, in a place
// other users may write to or name first (bpffs, /run), is shunt's own.
package owned

import (
	"errors"
	"fmt"
	"os"
	"syscall"
)

// Dir returns what path is, or nil if it does not exist; an error, one line
// saying what to do, if it is not a directory (a symbolic link included) or
// belongs to another user than the one shunt runs as.
func Dir(path string) (os.FileInfo, error) {
	fi, err := os.Lstat(path)
	if errors.Is(err, os.ErrNotExist) {
		return nil, nil
	}
	if err != nil {
		return nil, err
	}
	if !fi.IsDir() {
		return nil, fmt.Errorf("%s exists and is not a directory: remove it", path)
	}
	if st, ok := fi.Sys().(*syscall.Stat_t); ok && int(st.Uid) != os.Geteuid() {
		return nil, fmt.Errorf("%s belongs to uid %d, not to uid %d that shunt runs as (whoever owns it could replace what shunt keeps there): remove it", path, st.Uid, os.Geteuid())
	}
	return fi, nil
}
