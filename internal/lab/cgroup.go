package lab

import (
	"bytes"
	"fmt"
	"os"
	"path/filepath"
	"strconv"
	"strings"
	"sync"
	"time"

	"github.com/shunt-project/shunt/host"
)

// NewCgroup creates a cgroup v2 directory named name below the hierarchy's
// root. The returned remove function deletes it.
func NewCgroup(name string) (host.Cgroup, func() error, error) {
	root, err := host.Cgroup2Root()
	if err != nil {
		return host.Cgroup{}, nil, err
	}
	p := filepath.Join(root, name)
	if err := os.Mkdir(p, 0o755); err != nil {
		return host.Cgroup{}, nil, fmt.Errorf("create cgroup: %w", err)
	}
	remove := func() error {
		// A process moved out a moment ago may still be leaving.
		var err error
		for i := 0; i < 50; i++ {
			if err = os.Remove(p); err == nil || os.IsNotExist(err) {
				return nil
			}
			time.Sleep(20 * time.Millisecond)
		}
		return fmt.Errorf("remove cgroup %s: %w", p, err)
	}
	cg, err := host.ResolveCgroup(p)
	if err != nil {
		_ = remove()
		return host.Cgroup{}, nil, err
	}
	return cg, remove, nil
}

// cgroupMu serializes InCgroup: the whole process moves, so two callers at
// once would put each other's sockets in the wrong cgroup.
var cgroupMu sync.Mutex

// InCgroup runs fn with this process moved into cg, then moves it back, also
// when fn exits its goroutine (a test's t.Fatal): a process left there would
// keep the cgroup from being removed. A socket belongs to the cgroup its
// creator was in when it was made (accepted sockets to their listener's), so
// sockets fn makes stay in cg. fn must not wait for another InCgroup caller.
// A zero cg runs fn in place.
func InCgroup(cg host.Cgroup, fn func() error) (err error) {
	if cg.Path == "" {
		return fn()
	}
	cgroupMu.Lock()
	defer cgroupMu.Unlock()
	orig, err := ownCgroup()
	if err != nil {
		return err
	}
	if err := moveTo(cg.Path); err != nil {
		return err
	}
	defer func() {
		if merr := moveTo(orig); merr != nil {
			err = merr
		}
	}()
	return fn()
}

func ownCgroup() (string, error) {
	root, err := host.Cgroup2Root()
	if err != nil {
		return "", err
	}
	b, err := os.ReadFile("/proc/self/cgroup")
	if err != nil {
		return "", err
	}
	for _, line := range strings.Split(string(bytes.TrimSpace(b)), "\n") {
		if rest, ok := strings.CutPrefix(line, "0::"); ok {
			return filepath.Join(root, rest), nil
		}
	}
	return "", fmt.Errorf("no cgroup v2 line in /proc/self/cgroup")
}

func moveTo(cgPath string) error {
	pid := strconv.Itoa(os.Getpid())
	if err := os.WriteFile(filepath.Join(cgPath, "cgroup.procs"), []byte(pid), 0); err != nil {
		return fmt.Errorf("move process to %s: %w", cgPath, err)
	}
	return nil
}
