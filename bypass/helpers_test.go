package bypass_test

import (
	"context"
	"fmt"
	"io"
	"net"
	"reflect"
	"strings"
	"testing"
	"time"

	"github.com/cilium/ebpf"
	"golang.org/x/sys/unix"

	"github.com/shunt-project/shunt/bypass"
	"github.com/shunt-project/shunt/bypass/bypasstest"
	"github.com/shunt-project/shunt/host"
	"github.com/shunt-project/shunt/internal/testenv"
)

// mustInstall makes a pin dir and a cgroup, installs bypass there and enables
// the cgroup. It watches the kernel log for the whole test.
func mustInstall(t *testing.T) (*bypass.Install, host.Cgroup) {
	t.Helper()
	return mustInstallWith(t, bypass.Options{})
}

// mustInstallWith is mustInstall with install options, and no probation:
// every end in these tests is this one process, whose readers a new install
// keeps on TCP until one of them read 16 times (ProbationReads). The
// probation's own tests install with mustInstallNew.
func mustInstallWith(t *testing.T, opts bypass.Options) (*bypass.Install, host.Cgroup) {
	t.Helper()
	opts.NoProbation = true
	return bypasstest.MustEnabled(t, opts)
}

// mustInstallNew is mustInstallWith as a user's install is: programs new
// to it on probation.
func mustInstallNew(t *testing.T, opts bypass.Options) (*bypass.Install, host.Cgroup) {
	t.Helper()
	return bypasstest.MustEnabled(t, opts)
}

// flowOf finds the flow whose client or server socket has the cookie.
func flowOf(t *testing.T, in *bypass.Install, cookie uint64) *bypass.Flow {
	t.Helper()
	flows, err := in.Flows()
	if err != nil {
		t.Fatal(err)
	}
	for i, f := range flows {
		if (f.Client != nil && f.Client.Cookie == cookie) || (f.Server != nil && f.Server.Cookie == cookie) {
			return &flows[i]
		}
	}
	return nil
}

// exchange sends msg from a to b and checks it arrives whole.
func exchange(t *testing.T, a, b net.Conn, msg string) {
	t.Helper()
	if _, err := a.Write([]byte(msg)); err != nil {
		t.Fatalf("write: %v", err)
	}
	got := make([]byte, len(msg))
	if _, err := io.ReadFull(b, got); err != nil {
		t.Fatalf("read: %v", err)
	}
	if string(got) != msg {
		t.Fatalf("got %q, want %q", got, msg)
	}
}

// mapEntries returns the entry count of one of the install's maps.
func mapEntries(t *testing.T, in *bypass.Install, name string) int {
	t.Helper()
	st, err := in.Stats()
	if err != nil {
		t.Fatal(err)
	}
	for _, m := range st.Maps {
		if m.Name == name {
			return m.Entries
		}
	}
	t.Fatalf("no map %s", name)
	return 0
}

// connPair connects a client and a server over loopback in a new namespace,
// both in cg.
func connPair(t *testing.T, cg host.Cgroup) (c, s *net.TCPConn) {
	t.Helper()
	return connPairOver(t, "tcp4", cg)
}

// connPairOver is connPair over network: tcp4 (127.0.0.1) or tcp6 (::1).
func connPairOver(t *testing.T, network string, cg host.Cgroup) (c, s *net.TCPConn) {
	t.Helper()
	side := testenv.Side{NS: testenv.MustNetNS(t), CG: cg}
	addr := map[string]string{"tcp4": "127.0.0.1:0", "tcp6": "[::1]:0"}[network]
	return testenv.ConnPair(t, network, side, addr, side, addr)
}

// warmPair is connPair after one round trip: both readers have been seen in
// recv, so shunt redirects from here on.
func warmPair(t *testing.T, cg host.Cgroup) (c, s *net.TCPConn) {
	t.Helper()
	c, s = connPair(t, cg)
	testenv.Warm(t, c, s)
	return c, s
}

// waitCounter waits up to 5 s until the install's counters satisfy ok.
func waitCounter(t *testing.T, in *bypass.Install, what string, ok func(bypass.Counters) bool) {
	t.Helper()
	var last bypass.Counters
	for deadline := time.Now().Add(5 * time.Second); time.Now().Before(deadline); time.Sleep(5 * time.Millisecond) {
		st, err := in.Stats()
		if err != nil {
			t.Fatal(err)
		}
		if last = st.Counters; ok(last) {
			return
		}
	}
	t.Fatalf("waited 5 s for %s; counters %+v", what, last)
}

// onDiagonal says whether case (a, b) of a table of two dimensions runs:
// every case normally; under -short (the kernels under qemu, where a case
// costs 5 to 20 times more) only those whose indexes have the same parity,
// so each row and each column still runs at least once.
func onDiagonal(a, b int) bool {
	return !testing.Short() || a%2 == b%2
}

// mustPipe makes a pipe closed when the test ends: [0] reads, [1] writes.
func mustPipe(t *testing.T) [2]int {
	t.Helper()
	var p [2]int
	if err := unix.Pipe2(p[:], unix.O_CLOEXEC); err != nil {
		t.Fatal(err)
	}
	t.Cleanup(func() {
		unix.Close(p[0])
		unix.Close(p[1])
	})
	return p
}

// removeLeavesNoProgram removes the install and waits up to 5 s for its
// program id (what names it) to be gone from the kernel: a link's release
// or a map's last reference puts the program a moment later.
func removeLeavesNoProgram(t *testing.T, in *bypass.Install, id uint32, what string) {
	t.Helper()
	ctx, cancel := context.WithTimeout(context.Background(), 10*time.Second)
	defer cancel()
	if err := in.Remove(ctx); err != nil {
		t.Fatal(err)
	}
	for deadline := time.Now().Add(5 * time.Second); ; time.Sleep(10 * time.Millisecond) {
		p, err := ebpf.NewProgramFromID(ebpf.ProgramID(id))
		if err != nil {
			return
		}
		p.Close()
		if time.Now().After(deadline) {
			t.Fatalf("%s (program %d) still exists 5 s after the install was removed", what, id)
		}
	}
}

// requireSentBack fails unless a rule that sends connections back to TCP
// (count reads its counter) sent c's back when sentBack, and otherwise kept
// it, its writer's end (writer picks it) still redirecting; then both ends
// still talk.
func requireSentBack(t *testing.T, in *bypass.Install, c, s *net.TCPConn, before bypass.Counters, rule string,
	count func(bypass.Counters) uint64, sentBack bool, writer func(*bypass.Flow) *bypass.Endpoint) {
	t.Helper()
	after, err := in.Counters()
	if err != nil {
		t.Fatal(err)
	}
	want := uint64(0)
	if sentBack {
		want = 1
	}
	if got := count(after) - count(before); got != want {
		t.Fatalf("connections sent back %s: %d, want %d", rule, got, want)
	}
	if sentBack {
		waitLeft(t, in)
	} else if f := flowOf(t, in, testenv.Cookie(t, c)); f == nil || !writer(f).Redirecting || writer(f).TxMsgs == 0 {
		// The stall watch may take it first: a slow reader that slept
		// 20 ms with bytes hidden behind a drained psock (a loaded host).
		// The rule under test did not fire; that is what is asserted.
		if after.StallsRescued == before.StallsRescued {
			if f != nil && writer(f).Redirecting {
				t.Fatalf("the connection kept the bypass but redirected no send (counters that moved: %s)", countersMoved(before, after))
			}
			t.Fatalf("the connection left the bypass: %+v (counters that moved: %s)", f, countersMoved(before, after))
		}
		t.Logf("the stall watch sent the connection back (counters that moved: %s)", countersMoved(before, after))
	}
	exchange(t, c, s, "after")
	exchange(t, s, c, "and back")
}

// countersMoved names the counters that differ between two reads, for a
// failure to say which rule acted.
func countersMoved(before, after bypass.Counters) string {
	var moved []string
	b, a := reflect.ValueOf(before), reflect.ValueOf(after)
	for i := range a.NumField() {
		if x, y := b.Field(i), a.Field(i); x.CanUint() && x.Uint() != y.Uint() {
			moved = append(moved, fmt.Sprintf("%s +%d", a.Type().Field(i).Name, y.Uint()-x.Uint()))
		}
	}
	return strings.Join(moved, ", ")
}
