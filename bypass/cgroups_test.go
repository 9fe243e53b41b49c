package bypass_test

import (
	"os"
	"path/filepath"
	"strings"
	"testing"

	"github.com/shunt-project/shunt/bypass"
	"github.com/shunt-project/shunt/host"
	"github.com/shunt-project/shunt/internal/testenv"
)

// TestCgroupTraffic: each cgroup's bypassed sockets count what they sent by
// TCP (before the peer's reader was seen) and by redirect, each in its own
// cgroup, and the counts outlive the connection.
func TestCgroupTraffic(t *testing.T) {
	in, cgClient := mustInstall(t)
	cgServer := testenv.MustCgroup(t)
	if _, err := in.Attach(cgServer); err != nil {
		t.Fatal(err)
	}
	ns := testenv.MustNetNS(t)
	c, s := testenv.ConnPair(t, "tcp4", testenv.Side{NS: ns, CG: cgServer}, "127.0.0.1:0", testenv.Side{NS: ns, CG: cgClient}, "127.0.0.1:0")
	exchange(t, c, s, "w") // the readers are unseen: by TCP
	exchange(t, s, c, "w")
	up, down := strings.Repeat("ping", 1000), strings.Repeat("pong!", 7)
	for range 10 {
		exchange(t, c, s, up)
		exchange(t, s, c, down)
	}
	want := map[string]bypass.CgroupTraffic{
		cgClient.Path: {Path: cgClient.Path, ID: cgClient.ID, TCPBytes: 1, TCPSends: 1, RedirectedBytes: uint64(10 * len(up)), RedirectedSends: 10},
		cgServer.Path: {Path: cgServer.Path, ID: cgServer.ID, TCPBytes: 1, TCPSends: 1, RedirectedBytes: uint64(10 * len(down)), RedirectedSends: 10},
	}
	check := func(when string) {
		t.Helper()
		got, err := in.CgroupTraffic()
		if err != nil {
			t.Fatal(err)
		}
		seen := 0
		for _, g := range got {
			if w, ok := want[g.Path]; ok {
				seen++
				if g != w {
					t.Errorf("%s: %+v, want %+v", when, g, w)
				}
			}
		}
		if seen != len(want) {
			t.Errorf("%s: %d of the 2 cgroups listed: %+v", when, seen, got)
		}
	}
	check("connection open")
	c.Close()
	s.Close()
	check("connection closed")
}

// TestCgroupTrafficLeavesOutGoneCgroups: a cgroup (here one below an
// enabled one, as a pod's below its QoS slice) is listed while it exists and
// left out once removed.
func TestCgroupTrafficLeavesOutGoneCgroups(t *testing.T) {
	in, parent := mustInstall(t)
	path := filepath.Join(parent.Path, "shunt-test-gone")
	if err := os.Mkdir(path, 0o755); err != nil {
		t.Fatal(err)
	}
	t.Cleanup(func() { os.Remove(path) })
	cg, err := host.ResolveCgroup(path)
	if err != nil {
		t.Fatal(err)
	}
	c, s := warmPair(t, cg)
	exchange(t, c, s, "x")
	before, err := in.Totals()
	if err != nil {
		t.Fatal(err)
	}
	listed := func() bool {
		got, err := in.CgroupTraffic()
		if err != nil {
			t.Fatal(err)
		}
		for _, g := range got {
			if g.ID == cg.ID && g.Path == cg.Path {
				return true
			}
		}
		return false
	}
	if !listed() || !in.CgroupCounted(cg.ID) {
		t.Fatal("the cgroup is not listed while its connection is open")
	}
	c.Close()
	s.Close()
	if err := os.Remove(path); err != nil {
		t.Fatal(err)
	}
	if listed() {
		t.Error("a removed cgroup is still listed")
	}
	if in.CgroupCounted(cg.ID) {
		t.Error("the removed cgroup's counts are still in the map after a listing")
	}
	after, err := in.Totals()
	if err != nil {
		t.Fatal(err)
	}
	if after != before || after.RedirectedBytes == 0 {
		t.Errorf("totals %+v after the cgroup went, %+v before: a gone cgroup's counts must stay in the totals", after, before)
	}
}
