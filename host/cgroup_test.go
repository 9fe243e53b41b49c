package host

import (
	"errors"
	"os"
	"path/filepath"
	"testing"
)

func TestCgroup2RootFromMountinfo(t *testing.T) {
	for _, tc := range []struct {
		name, mountinfo, want string
		err                   error
	}{
		{"hybrid", `25 30 0:22 / /sys/fs/cgroup ro,nosuid - tmpfs tmpfs ro,mode=755
27 25 0:24 / /sys/fs/cgroup/unified rw,nosuid,nodev shared:9 - cgroup2 cgroup2 rw,nsdelegate
28 25 0:25 / /sys/fs/cgroup/cpu rw - cgroup cgroup rw,cpu
`, "/sys/fs/cgroup/unified", nil},
		{"unified", `35 24 0:30 / /sys/fs/cgroup rw,nosuid,nodev,noexec,relatime shared:9 - cgroup2 cgroup2 rw
`, "/sys/fs/cgroup", nil},
		{"escaped", `35 24 0:30 / /mnt/my\040cgroups rw - cgroup2 none rw
`, "/mnt/my cgroups", nil},
		{"v1-only", `28 25 0:25 / /sys/fs/cgroup/cpu rw - cgroup cgroup rw,cpu
`, "", ErrNoCgroup2},
	} {
		t.Run(tc.name, func(t *testing.T) {
			p := filepath.Join(t.TempDir(), "mountinfo")
			if err := os.WriteFile(p, []byte(tc.mountinfo), 0o644); err != nil {
				t.Fatal(err)
			}
			got, err := cgroup2RootFrom(p)
			if !errors.Is(err, tc.err) || got != tc.want {
				t.Errorf("got %q, %v; want %q, %v", got, err, tc.want, tc.err)
			}
		})
	}
}

func TestKernelVersion(t *testing.T) {
	for rel, want := range map[string][2]int{"6.18.44-fc-v657": {6, 18}, "6.1.0-28-amd64": {6, 1}, "5.10": {5, 10}, "junk": {0, 0}} {
		if maj, min := kernelVersion(rel); maj != want[0] || min != want[1] {
			t.Errorf("%s: got %d.%d", rel, maj, min)
		}
	}
}
