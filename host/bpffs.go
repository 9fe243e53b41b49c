package host

import (
	"errors"
	"fmt"
	"os"
	"path/filepath"

	"golang.org/x/sys/unix"
)

// BPFFSRoot is where bpffs is normally mounted.
const BPFFSRoot = "/sys/fs/bpf"

// IsBPFFS reports whether path lies on a bpf filesystem.
func IsBPFFS(path string) bool {
	var fs unix.Statfs_t
	return unix.Statfs(path, &fs) == nil && fs.Type == unix.BPF_FS_MAGIC
}

// EnsureBPFFS makes sure the parent of pinDir is on bpffs, mounting bpffs at
// /sys/fs/bpf when nothing is mounted there yet (it is not at boot on some
// distributions).
func EnsureBPFFS(pinDir string) error {
	parent := filepath.Dir(filepath.Clean(pinDir))
	if IsBPFFS(parent) {
		return nil
	}
	if parent != BPFFSRoot {
		return fmt.Errorf("pin directory %s is not on bpffs: choose a directory under %s", pinDir, BPFFSRoot)
	}
	if err := os.MkdirAll(BPFFSRoot, 0o755); err != nil {
		return fmt.Errorf("cannot mount bpffs at %s: %v: mount it with 'mount -t bpf bpf %s'", BPFFSRoot, err, BPFFSRoot)
	}
	if err := unix.Mount("bpf", BPFFSRoot, "bpf", 0, "mode=0700"); err != nil {
		if errors.Is(err, unix.EPERM) {
			return fmt.Errorf("cannot mount bpffs at %s: permission denied: run as root", BPFFSRoot)
		}
		return fmt.Errorf("cannot mount bpffs at %s: %v: mount it with 'mount -t bpf bpf %s'", BPFFSRoot, err, BPFFSRoot)
	}
	if !IsBPFFS(BPFFSRoot) {
		return fmt.Errorf("cannot mount bpffs at %s: mount it with 'mount -t bpf bpf %s'", BPFFSRoot, BPFFSRoot)
	}
	return nil
}
