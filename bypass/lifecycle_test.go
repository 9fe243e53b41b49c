package bypass_test

import (
	"context"
	"errors"
	"io"
	"net"
	"os"
	"path/filepath"
	"strings"
	"sync"
	"syscall"
	"testing"
	"time"

	"github.com/cilium/ebpf"
	"github.com/cilium/ebpf/link"

	"github.com/shunt-project/shunt/bypass"
	"github.com/shunt-project/shunt/bypass/bypasstest"
	"github.com/shunt-project/shunt/host"
	"github.com/shunt-project/shunt/internal/testenv"
)

// paced slows a writer so a stream lasts long enough to live through an
// enable and a disable.
type paced struct {
	w     io.Writer
	pause time.Duration
}

func (p paced) Write(b []byte) (int, error) {
	time.Sleep(p.pause)
	return p.w.Write(b)
}

// gated holds a reader back until its gate opens, so redirected bytes sit
// unread in the receive queue meanwhile.
type gated struct {
	r    io.Reader
	gate <-chan struct{}
}

func (g gated) Read(b []byte) (int, error) {
	<-g.gate
	return g.r.Read(b)
}

// streamBoth runs one stream each way over c/s and reports into errs; the
// readers start reading when gate opens.
func streamBoth(wg *sync.WaitGroup, errs chan<- error, c, s *net.TCPConn, seed uint64, gate <-chan struct{}) {
	up := testenv.Stream{Seed: seed, Size: 4 << 20, MaxChunk: 32 << 10}
	down := testenv.Stream{Seed: seed + 1, Size: 4 << 20, MaxChunk: 32 << 10}
	wg.Add(4)
	go func() { defer wg.Done(); defer c.CloseWrite(); errs <- up.Write(paced{c, 2 * time.Millisecond}) }()
	go func() { defer wg.Done(); errs <- up.Check(gated{s, gate}, true) }()
	go func() { defer wg.Done(); defer s.CloseWrite(); errs <- down.Write(paced{s, 2 * time.Millisecond}) }()
	go func() { defer wg.Done(); errs <- down.Check(gated{c, gate}, true) }()
}

// Requirement 5: enable and then remove shunt while 50 connections stream:
// no byte lost, duplicated or reordered, nothing left pinned or attached, no
// kernel warning. The readers of the bypassed half pause across the removal,
// so it meets redirected bytes nobody has read yet: deleting those sockets
// from the sockhash then would drop the bytes (kernel-notes.md).
func TestEnableDisableUnderTraffic(t *testing.T) {
	testenv.RequireRoot(t)
	testenv.WatchKernelLog(t)
	pin := bypasstest.MustPinDir(t)
	cg := testenv.MustCgroup(t)
	ns := testenv.MustNetNS(t)
	side := testenv.Side{NS: ns, CG: cg}
	ln := testenv.Listen(t, side, "tcp4", "127.0.0.1:0")
	addr := ln.Addr().String()

	const n = 50
	errs := make(chan error, 4*n)
	var wg sync.WaitGroup
	open := func(seed uint64, gate <-chan struct{}) (*net.TCPConn, *net.TCPConn) {
		c := testenv.Dial(t, side, "tcp4", addr, nil)
		s := testenv.Accept(t, ln)
		testenv.Warm(t, c, s)
		streamBoth(&wg, errs, c, s, seed, gate)
		return c, s
	}
	opened := make(chan struct{})
	close(opened)
	for i := 0; i < n/2; i++ { // before enable: these stay on TCP
		open(uint64(2*i), opened)
	}
	// Every connection here is this process's: one program, whose many
	// connections a new install would admit one by one (its probation).
	in, err := bypass.Create(pin, bypass.Options{NoProbation: true})
	if err != nil {
		t.Fatal(err)
	}
	defer in.Close()
	if _, err := in.Attach(cg); err != nil {
		t.Fatal(err)
	}
	var late []*net.TCPConn
	paused := make(chan struct{})
	for i := n / 2; i < n; i++ { // after enable: these are bypassed
		c, _ := open(uint64(2*i), paused)
		late = append(late, c)
	}
	time.Sleep(150 * time.Millisecond)
	for _, c := range late {
		if f := flowOf(t, in, testenv.Cookie(t, c)); f == nil || f.Client == nil || f.Client.TxBytes == 0 {
			t.Fatalf("connection opened after enable is not bypassed: %+v", f)
		}
	}

	ctx, cancel := context.WithTimeout(context.Background(), 10*time.Second)
	defer cancel()
	removed := make(chan error, 1)
	go func() { removed <- in.Remove(ctx) }()
	select {
	case err := <-removed:
		t.Fatalf("remove finished while readers held unread redirected bytes (err %v)", err)
	case <-time.After(300 * time.Millisecond):
	}
	close(paused)
	if err := <-removed; err != nil {
		t.Fatalf("remove under traffic: %v", err)
	}
	wg.Wait()
	close(errs)
	for err := range errs {
		if err != nil {
			t.Error(err)
		}
	}
	if _, err := os.Stat(pin); !os.IsNotExist(err) {
		t.Errorf("pin dir %s still exists after remove (%v)", pin, err)
	}
	assertNothingAttached(t, cg)
}

// Detaching one of two cgroups stops new bypass there but keeps the
// connections already bypassed working, still by redirect.
func TestDetachKeepsExistingFlows(t *testing.T) {
	in, cg := mustInstall(t)
	other := testenv.MustCgroup(t)
	if _, err := in.Attach(other); err != nil {
		t.Fatal(err)
	}
	ns := testenv.MustNetNS(t)
	side := testenv.Side{NS: ns, CG: cg}
	c, s := testenv.ConnPair(t, "tcp4", side, "127.0.0.1:0", side, "127.0.0.1:0")
	testenv.Warm(t, c, s)
	exchange(t, c, s, "before")
	if ok, err := in.Detach(cg.ID); err != nil || !ok {
		t.Fatalf("detach: %v %v", ok, err)
	}
	exchange(t, c, s, "after detach")
	exchange(t, s, c, "reply")
	f := flowOf(t, in, testenv.Cookie(t, c))
	if f == nil || f.Client == nil || f.Client.TxMsgs != 2 || f.Server.TxMsgs != 1 {
		t.Fatalf("existing flow stopped being redirected after detach: %+v", f)
	}
	// New connections of the detached cgroup take the TCP path.
	c2, s2 := testenv.ConnPair(t, "tcp4", side, "127.0.0.1:0", side, "127.0.0.1:0")
	exchange(t, c2, s2, "new")
	if f := flowOf(t, in, testenv.Cookie(t, c2)); f != nil {
		t.Fatalf("connection of a detached cgroup was bypassed: %+v", f)
	}
	assertNothingAttached(t, cg)

	// Closed with no program left to see it, the flow's published refs
	// stay until the next attach or detach sweeps them, and their timer
	// slots go back to the pool.
	c.Close()
	s.Close()
	if _, err := in.Detach(other.ID); err != nil {
		t.Fatal(err)
	}
	st, err := in.Stats()
	if err != nil {
		t.Fatal(err)
	}
	for _, m := range st.Maps {
		if m.Name == "peer_refs" && m.Entries != 0 {
			t.Errorf("peer_refs holds %d entries after the sweep", m.Entries)
		}
	}
	taken, free, err := in.TimerSlots()
	if err != nil {
		t.Fatal(err)
	}
	if taken != 2 || free != 2 {
		t.Errorf("timer slots: %d handed out, %d back in the pool; want 2 and 2", taken, free)
	}
}

// assertNothingAttached fails if any sockops program is attached to cg.
func assertNothingAttached(t *testing.T, cg host.Cgroup) {
	t.Helper()
	res, err := link.QueryPrograms(link.QueryOptions{Target: cgroupFD(t, cg), Attach: ebpf.AttachCGroupSockOps})
	if err != nil {
		t.Fatal(err)
	}
	if len(res.Programs) != 0 {
		t.Errorf("%d sockops program(s) still attached to %s", len(res.Programs), cg.Path)
	}
}

func cgroupFD(t *testing.T, cg host.Cgroup) int {
	f, err := os.Open(cg.Path)
	if err != nil {
		t.Fatal(err)
	}
	t.Cleanup(func() { f.Close() })
	return int(f.Fd())
}

// Requirement 6: 10,000 short connections, closed every way TCP allows,
// leave no entry in any of shunt's maps. Each is paired (PairBrief: else
// all but one in BriefSample after the first BriefStreak are left unpaired).
func TestShortConnectionsLeaveNoState(t *testing.T) {
	in, cg := mustInstallWith(t, bypass.Options{PairBrief: true})
	ns := testenv.MustNetNS(t)
	side := testenv.Side{NS: ns, CG: cg}
	ln := testenv.Listen(t, side, "tcp4", "127.0.0.1:0")
	addr := ln.Addr().String()

	const n = 10000
	var d net.Dialer
	buf := make([]byte, 1)
	side.Make(t, func() {
		for i := 0; i < n; i++ {
			cc, err := d.Dial("tcp4", addr)
			if err != nil {
				t.Fatalf("connection %d: %v", i, err)
			}
			c := cc.(*net.TCPConn)
			s, err := ln.AcceptTCP()
			if err != nil {
				t.Fatal(err)
			}
			if _, err := c.Write([]byte{'x'}); err != nil {
				t.Fatal(err)
			}
			if _, err := io.ReadFull(s, buf); err != nil {
				t.Fatal(err)
			}
			if _, err := s.Write([]byte{'y'}); err != nil {
				t.Fatal(err)
			}
			if _, err := io.ReadFull(c, buf); err != nil {
				t.Fatal(err)
			}
			switch i % 3 {
			case 0: // client closes first
				c.Close()
				s.Close()
			case 1: // server closes first
				s.Close()
				c.Close()
			case 2: // reset
				_ = c.SetLinger(0)
				c.Close()
				s.Close()
			}
		}
	})
	st, err := in.Stats()
	if err != nil {
		t.Fatal(err)
	}
	if st.Counters.Paired != n {
		t.Errorf("%d connections paired, want %d", st.Counters.Paired, n)
	}
	for _, m := range st.Maps {
		if m.Entries != 0 {
			t.Errorf("map %s holds %d stale entries", m.Name, m.Entries)
		}
	}
	// Each socket's timer slot came back, and was used again: a
	// connection at a time needs a few.
	taken, free, err := in.TimerSlots()
	if err != nil {
		t.Fatal(err)
	}
	t.Logf("timer slots: %d handed out for %d connections", taken, n)
	if free != taken || taken > 8 {
		t.Errorf("timer slots: %d handed out, %d back in the pool; want all back, at most 8", taken, free)
	}
}

// TestRemoveWaitsForUnacceptedSocket: a server socket its listener has not
// accepted is open in no process, so removal cannot look into its queue.
// With --trust-readers bytes are redirected to it from the first send; it
// must stay in the sockhash (deleting it would drop them) until accepted.
func TestRemoveWaitsForUnacceptedSocket(t *testing.T) {
	in, cg := mustInstallWith(t, bypass.Options{TrustReaders: true})
	side := testenv.Side{NS: testenv.MustNetNS(t), CG: cg}
	ln := testenv.Listen(t, side, "tcp4", "127.0.0.1:0")
	c := testenv.Dial(t, side, "tcp4", ln.Addr().String(), nil)
	const msg = "sent before accept"
	if _, err := c.Write([]byte(msg)); err != nil {
		t.Fatal(err)
	}
	if st, err := in.Stats(); err != nil || st.Counters.Paired != 1 {
		t.Fatalf("connection not paired: %+v %v", st.Counters, err)
	}

	ctx, cancel := context.WithTimeout(context.Background(), 300*time.Millisecond)
	defer cancel()
	var busy bypass.ErrBusy
	if err := in.Remove(ctx); !errors.As(err, &busy) || busy.Unheld != 1 {
		t.Fatalf("remove with an unaccepted paired socket: %v, want ErrBusy with 1 not accepted", err)
	}

	s := testenv.Accept(t, ln)
	s.SetDeadline(time.Now().Add(5 * time.Second))
	got := make([]byte, len(msg))
	if _, err := io.ReadFull(s, got); err != nil || string(got) != msg {
		t.Fatalf("once accepted the server read %q, %v; want %q", got, err, msg)
	}
	ctx, cancel = context.WithTimeout(context.Background(), 10*time.Second)
	defer cancel()
	if err := in.Remove(ctx); err != nil {
		t.Fatalf("remove after the server read: %v", err)
	}
}

// bpffs is mounted world-writable by default, so another user can make the
// install's names first. enable refuses a learned directory (or pin
// directory) that user owns, with what to do, and leaves nothing behind;
// before, root's map was pinned into the user's directory, and once the
// user unlinked it status, flows and disable --all failed. A non-empty
// directory that holds no install is named as such.
func TestSquattedPinDirectoriesRefused(t *testing.T) {
	testenv.RequireRoot(t)
	for _, c := range []struct {
		name string
		make func(dir string) string // returns what it made
		want string
	}{
		{"learned dir of another user", func(dir string) string {
			d := bypass.LearnedDir(dir)
			os.Mkdir(d, 0o755)
			os.Chown(d, 65534, 65534)
			return d
		}, "belongs to uid 65534"},
		{"pin dir of another user", func(dir string) string {
			os.Mkdir(dir, 0o755)
			os.Chown(dir, 65534, 65534)
			return dir
		}, "belongs to uid 65534"},
		{"pin dir holding something else", func(dir string) string {
			os.MkdirAll(filepath.Join(dir, "other"), 0o700)
			return dir
		}, "exists and holds no shunt install"},
	} {
		t.Run(c.name, func(t *testing.T) {
			dir := bypasstest.MustPinDir(t)
			made := c.make(dir)
			_, err := bypass.Create(dir, bypass.Options{})
			if err == nil || !strings.Contains(err.Error(), c.want) || !strings.Contains(err.Error(), "remove it") {
				t.Fatalf("Create: %v, want an error saying %q and what to do", err, c.want)
			}
			if _, err := bypass.Open(dir); err == nil {
				t.Errorf("an install is at %s", dir)
			}
			if made != bypass.LearnedDir(dir) {
				if _, err := os.Stat(filepath.Join(bypass.LearnedDir(dir), "splice_programs")); err == nil {
					t.Errorf("the refused enable left %s", bypass.LearnedDir(dir))
				}
			}
		})
	}
}

// TestForceRemoveResetsUnreadConnections: a reader that never reads keeps a
// plain removal waiting; a forced one resets that connection (its reader
// gets an error, not a stream with the redirected bytes missing), names
// it, and leaves nothing installed.
func TestForceRemoveResetsUnreadConnections(t *testing.T) {
	for _, network := range []string{"tcp4", "tcp6"} {
		t.Run(network, func(t *testing.T) {
			in, cg := mustInstall(t)
			side := testenv.Side{NS: testenv.MustNetNS(t), CG: cg}
			addr := map[string]string{"tcp4": "127.0.0.1:0", "tcp6": "[::1]:0"}[network]
			c, s := testenv.ConnPair(t, network, side, addr, side, addr)
			testenv.Warm(t, c, s)
			if _, err := c.Write(make([]byte, 256<<10)); err != nil { // redirected; s does not read
				t.Fatal(err)
			}
			dir := in.Dir()
			ctx, cancel := context.WithTimeout(context.Background(), 200*time.Millisecond)
			defer cancel()
			stuck, err := in.ForceRemove(ctx)
			if err != nil {
				t.Fatalf("forced removal: %v", err)
			}
			if _, err := os.Stat(dir); !os.IsNotExist(err) {
				t.Fatalf("install still at %s after a forced removal", dir)
			}
			if len(stuck) != 1 || !stuck[0].Unread || stuck[0].Err != nil ||
				stuck[0].Local.String() != s.LocalAddr().String() || stuck[0].Remote.String() != s.RemoteAddr().String() {
				t.Fatalf("reset %+v, want the server's socket %s (unread, reset)", stuck, s.LocalAddr())
			}
			mustFailRead(t, s, "the reset reader")
			mustFailRead(t, c, "its peer")
		})
	}
}

// TestForceRemoveWithoutTheDrain: on a kernel that refuses the drain's
// iterator, removal says so and what --force does, drops nothing and keeps
// the install; forced, it resets every connection still bypassed.
func TestForceRemoveWithoutTheDrain(t *testing.T) {
	in, cg := mustInstall(t)
	side := testenv.Side{NS: testenv.MustNetNS(t), CG: cg}
	c, s := testenv.ConnPair(t, "tcp4", side, "127.0.0.1:0", side, "127.0.0.1:0")
	testenv.Warm(t, c, s)
	in.RefuseIterators()
	ctx, cancel := context.WithTimeout(context.Background(), 200*time.Millisecond)
	defer cancel()
	if err := in.Remove(ctx); err == nil || !strings.Contains(err.Error(), "--force resets the connections still bypassed") {
		t.Fatalf("removal without the drain: %v, want it to name --force", err)
	}
	if _, err := os.Stat(in.Dir()); err != nil {
		t.Fatalf("install gone after a removal that could not drain: %v", err)
	}
	exchange(t, c, s, "still connected") // nothing dropped, sends on TCP
	stuck, err := in.ForceRemove(ctx)
	if err != nil {
		t.Fatalf("forced removal: %v", err)
	}
	if len(stuck) != 2 {
		t.Fatalf("reset %+v, want both ends", stuck)
	}
	// The first reset closes its peer: one reset, one closed already.
	reset := 0
	for _, x := range stuck {
		if x.Unread || (x.Err != nil && !errors.Is(x.Err, os.ErrNotExist)) {
			t.Errorf("socket %s: unread %v, reset error %v; want not looked into, reset", x.Local, x.Unread, x.Err)
		}
		if x.Err == nil {
			reset++
		}
	}
	if reset == 0 {
		t.Errorf("no socket reset: %+v", stuck)
	}
	mustFailRead(t, s, "the server")
	mustFailRead(t, c, "the client")
}

// mustFailRead checks that a read on conn fails at once with the error a
// reset connection gives, and returns no bytes.
func mustFailRead(t *testing.T, conn net.Conn, who string) {
	t.Helper()
	conn.SetReadDeadline(time.Now().Add(5 * time.Second))
	n, err := conn.Read(make([]byte, 1<<20))
	reset := errors.Is(err, syscall.ECONNABORTED) || errors.Is(err, syscall.ECONNRESET)
	if n != 0 || !reset {
		t.Errorf("%s read %d bytes, %v; want a reset connection's error", who, n, err)
	}
}
