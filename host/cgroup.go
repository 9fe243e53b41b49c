package host

import (
	"bufio"
	"errors"
	"fmt"
	"os"
	"path/filepath"
	"strings"

	"golang.org/x/sys/unix"
)

// ErrNoCgroup2 means no cgroup v2 hierarchy is mounted.
var ErrNoCgroup2 = errors.New("no cgroup v2 hierarchy is mounted: mount one with 'mount -t cgroup2 none /sys/fs/cgroup/unified' (or boot with systemd.unified_cgroup_hierarchy=1)")

// Cgroup2Root returns the mount point of the cgroup v2 hierarchy, read from
// /proc/self/mountinfo: hybrid hosts mount it beside the v1 controllers
// (e.g. /sys/fs/cgroup/unified), so it is never assumed.
func Cgroup2Root() (string, error) {
	return cgroup2RootFrom("/proc/self/mountinfo")
}

func cgroup2RootFrom(mountinfo string) (string, error) {
	f, err := os.Open(mountinfo)
	if err != nil {
		return "", fmt.Errorf("read mounts: %w", err)
	}
	defer f.Close()
	sc := bufio.NewScanner(f)
	for sc.Scan() {
		// Fields: id parent major:minor root mountpoint options [optional...] - fstype source superopts
		fields := strings.Fields(sc.Text())
		sep := -1
		for i, f := range fields {
			if f == "-" {
				sep = i
				break
			}
		}
		if sep < 0 || sep+1 >= len(fields) || len(fields) < 5 {
			continue
		}
		if fields[sep+1] == "cgroup2" {
			return unescapeMount(fields[4]), nil
		}
	}
	if err := sc.Err(); err != nil {
		return "", fmt.Errorf("read mounts: %w", err)
	}
	return "", ErrNoCgroup2
}

// unescapeMount undoes the octal escapes mountinfo uses for spaces and such.
func unescapeMount(s string) string {
	if !strings.Contains(s, `\`) {
		return s
	}
	var b strings.Builder
	for i := 0; i < len(s); i++ {
		if s[i] == '\\' && i+3 < len(s) {
			var v byte
			ok := true
			for _, c := range s[i+1 : i+4] {
				if c < '0' || c > '7' {
					ok = false
					break
				}
				v = v*8 + byte(c-'0')
			}
			if ok {
				b.WriteByte(v)
				i += 3
				continue
			}
		}
		b.WriteByte(s[i])
	}
	return b.String()
}

// Cgroup is a cgroup v2 directory.
type Cgroup struct {
	Path string // absolute, cleaned
	ID   uint64 // the cgroup id, which is the directory's inode number on v2
}

// CgroupPathError: the path given is not a cgroup v2 directory (missing,
// or on another file system); the caller's input, not the host, is wrong.
type CgroupPathError struct{ error }

func (e CgroupPathError) Unwrap() error { return e.error }

// ResolveCgroup checks that path is a directory of the cgroup v2 hierarchy.
// An empty path means the root of the hierarchy.
func ResolveCgroup(path string) (Cgroup, error) {
	if path == "" {
		root, err := Cgroup2Root()
		if err != nil {
			return Cgroup{}, err
		}
		path = root
	}
	abs, err := filepath.Abs(path)
	if err != nil {
		return Cgroup{}, err
	}
	var fs unix.Statfs_t
	if err := unix.Statfs(abs, &fs); err != nil {
		if errors.Is(err, unix.ENOENT) {
			return Cgroup{}, CgroupPathError{fmt.Errorf("cgroup %s does not exist: give a directory of the cgroup v2 hierarchy", abs)}
		}
		return Cgroup{}, fmt.Errorf("cgroup %s: %w", abs, err)
	}
	if fs.Type != unix.CGROUP2_SUPER_MAGIC {
		root, rerr := Cgroup2Root()
		hint := "mount cgroup2 first"
		if rerr == nil {
			hint = "cgroup v2 is mounted at " + root
		}
		return Cgroup{}, CgroupPathError{fmt.Errorf("%s is not a cgroup v2 directory (%s)", abs, hint)}
	}
	var st unix.Stat_t
	if err := unix.Stat(abs, &st); err != nil {
		return Cgroup{}, fmt.Errorf("cgroup %s: %w", abs, err)
	}
	if st.Mode&unix.S_IFMT != unix.S_IFDIR {
		return Cgroup{}, fmt.Errorf("%s is not a cgroup v2 directory", abs)
	}
	return Cgroup{Path: abs, ID: st.Ino}, nil
}

// CgroupPathByID finds the directory of a cgroup v2 id by walking the
// hierarchy. It returns "" when the cgroup no longer exists.
func CgroupPathByID(id uint64) string {
	return CgroupPathsByID([]uint64{id})[id]
}

// CgroupPathsByID finds the directories of several cgroup v2 ids in one walk
// of the hierarchy; ids of cgroups that no longer exist are left out.
func CgroupPathsByID(ids []uint64) map[uint64]string {
	found := map[uint64]string{}
	want := map[uint64]bool{}
	for _, id := range ids {
		want[id] = true
	}
	root, err := Cgroup2Root()
	if err != nil || len(want) == 0 {
		return found
	}
	errStop := errors.New("stop")
	_ = filepath.WalkDir(root, func(p string, d os.DirEntry, err error) error {
		if err != nil || !d.IsDir() {
			return nil
		}
		var st unix.Stat_t
		if unix.Stat(p, &st) == nil && want[st.Ino] {
			found[st.Ino] = p
			if len(found) == len(want) {
				return errStop
			}
		}
		return nil
	})
	return found
}

// Level is the cgroup's depth below the root of the hierarchy (0 for the
// root), as the kernel counts it in struct cgroup.
func (c Cgroup) Level() int {
	root, err := Cgroup2Root()
	if err != nil {
		return 0
	}
	rel, err := filepath.Rel(root, c.Path)
	if err != nil || rel == "." {
		return 0
	}
	return len(strings.Split(rel, string(filepath.Separator)))
}
