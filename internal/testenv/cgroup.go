package testenv

import (
	"bytes"
	"os"
	"path/filepath"
	"strconv"
	"strings"
	"sync"
	"testing"
	"time"

	"github.com/shunt-project/shunt/host"
)

// MustCgroup creates a cgroup v2 directory below the hierarchy's root.
func MustCgroup(t testing.TB) host.Cgroup {
	t.Helper()
	root, err := host.Cgroup2Root()
	if err != nil {
		t.Fatal(err)
	}
	p := filepath.Join(root, Name())
	if err := os.Mkdir(p, 0o755); err != nil {
		t.Fatalf("create cgroup: %v", err)
	}
	t.Cleanup(func() {
		// A process that was moved here may take a moment to leave.
		for i := 0; i < 50; i++ {
			if err := os.Remove(p); err == nil || os.IsNotExist(err) {
				return
			}
			time.Sleep(20 * time.Millisecond)
		}
		t.Errorf("cgroup %s left behind", p)
	})
	cg, err := host.ResolveCgroup(p)
	if err != nil {
		t.Fatal(err)
	}
	return cg
}

// cgroupMu serializes InCgroup: the whole process moves, so two callers at
// once would put each other's sockets in the wrong cgroup.
var cgroupMu sync.Mutex

// InCgroup runs fn with the test process moved into cg. A socket belongs to
// the cgroup its creator was in when it was made (accepted sockets to their
// listener's), so sockets made by fn stay in cg afterwards. fn must not wait
// for another InCgroup caller. An empty cgroup runs fn where the process
// already is.
func InCgroup(t testing.TB, cg host.Cgroup, fn func()) {
	t.Helper()
	if cg.Path == "" {
		fn()
		return
	}
	cgroupMu.Lock()
	defer cgroupMu.Unlock()
	orig := ownCgroup(t)
	move(t, cg.Path)
	defer move(t, orig)
	fn()
}

func ownCgroup(t testing.TB) string {
	t.Helper()
	root, err := host.Cgroup2Root()
	if err != nil {
		t.Fatal(err)
	}
	b, err := os.ReadFile("/proc/self/cgroup")
	if err != nil {
		t.Fatal(err)
	}
	for _, line := range strings.Split(string(bytes.TrimSpace(b)), "\n") {
		if rest, ok := strings.CutPrefix(line, "0::"); ok {
			return filepath.Join(root, rest)
		}
	}
	t.Fatal("no cgroup v2 line in /proc/self/cgroup")
	return ""
}

func move(t testing.TB, cgPath string) {
	t.Helper()
	pid := strconv.Itoa(os.Getpid())
	if err := os.WriteFile(filepath.Join(cgPath, "cgroup.procs"), []byte(pid), 0); err != nil {
		t.Fatalf("move process to %s: %v", cgPath, err)
	}
}

