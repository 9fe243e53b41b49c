package sockindex_test

import (
	"net"
	"net/netip"
	"runtime"
	"syscall"
	"testing"
	"time"

	"golang.org/x/sys/unix"

	"github.com/shunt-project/shunt/host"
	"github.com/shunt-project/shunt/internal/testenv"
	"github.com/shunt-project/shunt/sockindex"
)

func mustIndex(t *testing.T, cg host.Cgroup) *sockindex.Index {
	t.Helper()
	ix, _, err := sockindex.Create(testenv.MustPinDir(t), cg)
	if err != nil {
		t.Fatal(err)
	}
	t.Cleanup(func() { ix.Close() })
	return ix
}

func entries(t *testing.T, ix *sockindex.Index) []sockindex.Socket {
	t.Helper()
	all, err := ix.List()
	if err != nil {
		t.Fatal(err)
	}
	return all
}

func udpDial(t *testing.T, side testenv.Side, addr string) *net.UDPConn {
	t.Helper()
	var c *net.UDPConn
	var err error
	side.Make(t, func() { c, err = net.DialUDP("udp", nil, net.UDPAddrFromAddrPort(netip.MustParseAddrPort(addr))) })
	if err != nil {
		t.Fatal(err)
	}
	t.Cleanup(func() { c.Close() })
	return c
}

// Sockets connected before the index existed are found by the sweep, and
// only those in the index's cgroup.
func TestSweepIndexesExistingSockets(t *testing.T) {
	testenv.RequireRoot(t)
	cg := testenv.MustCgroup(t)
	side := testenv.Side{NS: testenv.MustNetNS(t), CG: cg}
	outside := testenv.Side{NS: side.NS}
	c, s := testenv.ConnPair(t, "tcp", side, "127.0.0.1:0", side, "127.0.0.1:0")
	u := udpDial(t, side, "127.0.0.1:9")
	testenv.ConnPair(t, "tcp", outside, "127.0.0.1:0", outside, "127.0.0.1:0")

	ix, seeded, err := sockindex.Create(testenv.MustPinDir(t), cg)
	if err != nil {
		t.Fatal(err)
	}
	defer ix.Close()
	// The client and the UDP socket; not the accepted socket (its remote
	// is a client, not a backend), nor the pair outside the cgroup.
	if seeded != 2 {
		t.Errorf("sweep added %d sockets, want 2", seeded)
	}
	want := map[uint64]bool{testenv.Cookie(t, c): true, testenv.Cookie(t, u): true}
	for _, e := range entries(t, ix) {
		if !want[e.Cookie] || !e.Seeded || !e.LocalKnown {
			t.Errorf("unexpected entry %+v", e)
		}
		delete(want, e.Cookie)
	}
	if len(want) != 0 {
		t.Errorf("not indexed: %v", want)
	}
	c.Close()
	s.Close()
	u.Close()
	waitEmpty(t, ix)
}

func waitEmpty(t *testing.T, ix *sockindex.Index) {
	t.Helper()
	deadline := time.Now().Add(5 * time.Second)
	for {
		left := entries(t, ix)
		if len(left) == 0 {
			return
		}
		if time.Now().After(deadline) {
			c, _ := ix.Counters()
			t.Fatalf("%d entries left for closed sockets, first %+v; counters %+v", len(left), left[0], c)
		}
		time.Sleep(10 * time.Millisecond)
	}
}

// A connected UDP socket is indexed at connect, learns its local address on
// its first send, and moves when it reconnects.
func TestUDPLifecycle(t *testing.T) {
	testenv.RequireRoot(t)
	cg := testenv.MustCgroup(t)
	ix := mustIndex(t, cg)
	side := testenv.Side{NS: testenv.MustNetNS(t), CG: cg}
	u := udpDial(t, side, "127.0.0.1:9")

	b9 := sockindex.Backend{Addr: netip.MustParseAddr("127.0.0.1"), Port: 9, Proto: sockindex.UDP}
	got, err := ix.Lookup(b9)
	if err != nil || len(got) != 1 || got[0].LocalKnown {
		t.Fatalf("after connect: %+v %v, want one entry without a local address", got, err)
	}
	if got[0].Owner != unix.Getpid() {
		t.Errorf("owner %d, want %d", got[0].Owner, unix.Getpid())
	}
	u.Write([]byte("x"))
	got, _ = ix.Lookup(b9)
	if len(got) != 1 || !got[0].LocalKnown || got[0].Local != u.LocalAddr().(*net.UDPAddr).AddrPort() {
		t.Fatalf("after send: %+v, want local %v", got, u.LocalAddr())
	}

	// Reconnect through the raw fd: the entry moves to the new backend.
	raw, _ := u.SyscallConn()
	raw.Control(func(fd uintptr) {
		if err := unix.Connect(int(fd), &unix.SockaddrInet4{Port: 10, Addr: [4]byte{127, 0, 0, 1}}); err != nil {
			t.Fatal(err)
		}
	})
	if got, _ := ix.Lookup(b9); len(got) != 0 {
		t.Errorf("old backend still holds %+v", got)
	}
	b10 := b9
	b10.Port = 10
	if got, _ := ix.Lookup(b10); len(got) != 1 {
		t.Errorf("new backend holds %d entries, want 1", len(got))
	}
	// Its first send to the new backend tells the index the local address
	// again (the port stays, a reconnect keeps it).
	raw.Control(func(fd uintptr) {
		// The port-9 send drew a port-unreachable: clear that error, or
		// this send would report it instead of sending.
		unix.GetsockoptInt(int(fd), unix.SOL_SOCKET, unix.SO_ERROR)
		if _, err := unix.Write(int(fd), []byte("y")); err != nil {
			t.Fatal(err)
		}
	})
	if got, _ := ix.Lookup(b10); len(got) != 1 || !got[0].LocalKnown || got[0].Local != u.LocalAddr().(*net.UDPAddr).AddrPort() {
		t.Errorf("after reconnect and send: %+v, want local %v", got, u.LocalAddr())
	}
	u.Close()
	waitEmpty(t, ix)
}

// No entry outlives its socket: many open/close cycles of each protocol,
// TCP closed both gracefully and by reset, leave the index empty, and the
// slots a backend needs follow its live sockets, not its history.
func TestNoEntriesLeftAfterCycles(t *testing.T) {
	testenv.RequireRoot(t)
	cycles := 100_000
	if testing.Short() {
		cycles = 2_000
	}
	cg := testenv.MustCgroup(t)
	ix := mustIndex(t, cg)
	side := testenv.Side{NS: testenv.MustNetNS(t), CG: cg}
	tcpAddr := closingServer(t, side)

	start := time.Now()
	tcpOK := 0
	side.Make(t, func() {
		for i := range cycles {
			fd, err := unix.Socket(unix.AF_INET, unix.SOCK_STREAM|unix.SOCK_CLOEXEC, 0)
			if err != nil {
				t.Fatal(err)
			}
			if i%2 == 0 {
				// Reset instead of FIN: no TIME_WAIT, and the other path
				// out of the index.
				unix.SetsockoptLinger(fd, unix.SOL_SOCKET, unix.SO_LINGER, &unix.Linger{Onoff: 1, Linger: 0})
			}
			err = unix.Connect(fd, &unix.SockaddrInet4{Port: int(tcpAddr.Port()), Addr: tcpAddr.Addr().As4()})
			switch err {
			case nil:
				tcpOK++
			case syscall.EADDRNOTAVAIL: // ports in TIME_WAIT: no socket to index
			default:
				unix.Close(fd)
				t.Fatalf("connect %d: %v", i, err)
			}
			unix.Close(fd)

			u, err := unix.Socket(unix.AF_INET, unix.SOCK_DGRAM|unix.SOCK_CLOEXEC, 0)
			if err != nil {
				t.Fatal(err)
			}
			if err := unix.Connect(u, &unix.SockaddrInet4{Port: 9, Addr: [4]byte{127, 0, 0, 1}}); err != nil {
				t.Fatal(err)
			}
			if i%2 == 0 {
				unix.Write(u, []byte("x"))
			}
			unix.Close(u)
		}
	})
	t.Logf("%d TCP (%d connected) and %d UDP cycles in %v", cycles, tcpOK, cycles, time.Since(start))
	if tcpOK < cycles*9/10 {
		t.Fatalf("only %d of %d TCP connects succeeded", tcpOK, cycles)
	}
	waitEmpty(t, ix)

	c, err := ix.Counters()
	if err != nil {
		t.Fatal(err)
	}
	if c.Added != uint64(tcpOK+cycles) || c.Added != c.Removed || c.Full != 0 {
		t.Errorf("counters %+v: want added == %d, removed == added, none full", c, tcpOK+cycles)
	}
	bs, err := ix.Backends()
	if err != nil {
		t.Fatal(err)
	}
	for _, b := range bs {
		if b.Live != 0 || b.Slots > 64 {
			t.Errorf("backend %+v: want 0 live and a few slots after one-at-a-time use", b)
		}
	}
}

// A lookup reads a backend's slots in runs of 32: a backend with more
// sockets than that is read whole, and each socket once.
func TestLookupManySockets(t *testing.T) {
	testenv.RequireRoot(t)
	cg := testenv.MustCgroup(t)
	ix := mustIndex(t, cg)
	side := testenv.Side{NS: testenv.MustNetNS(t), CG: cg}
	want := map[uint64]bool{}
	for range 75 {
		want[testenv.Cookie(t, udpDial(t, side, "127.0.0.1:9"))] = true
	}
	got, err := ix.Lookup(sockindex.Backend{Addr: netip.MustParseAddr("127.0.0.1"), Port: 9, Proto: sockindex.UDP})
	if err != nil {
		t.Fatal(err)
	}
	if len(got) != len(want) {
		t.Errorf("lookup found %d sockets, want %d", len(got), len(want))
	}
	for _, s := range got {
		if !want[s.Cookie] {
			t.Errorf("unexpected or repeated socket %+v", s)
		}
		delete(want, s.Cookie)
	}
}

// An insert and a close of one socket racing on two CPUs remove its entry
// exactly once: connect (non-blocking) on one CPU, whose handshake ends in
// softirq there and inserts, while a thread on the other CPU closes the
// socket at once, half of them with a reset.
func TestInsertCloseRaceAcrossCPUs(t *testing.T) {
	testenv.RequireRoot(t)
	if runtime.NumCPU() < 2 {
		t.Skip("needs two CPUs")
	}
	cycles := 20_000
	if testing.Short() {
		cycles = 2_000
	}
	cg := testenv.MustCgroup(t)
	ix := mustIndex(t, cg)
	side := testenv.Side{NS: testenv.MustNetNS(t), CG: cg}
	to := closingServer(t, side)
	pin := func(cpu int) {
		runtime.LockOSThread()
		var set unix.CPUSet
		set.Set(cpu)
		if err := unix.SchedSetaffinity(0, &set); err != nil {
			t.Error(err)
		}
	}
	fds := make(chan int, 64)
	closed := make(chan struct{})
	go func() {
		defer close(closed)
		pin(1)
		i := 0
		for fd := range fds {
			if i++; i%2 == 0 {
				unix.SetsockoptLinger(fd, unix.SOL_SOCKET, unix.SO_LINGER, &unix.Linger{Onoff: 1, Linger: 0})
			}
			unix.Close(fd)
		}
	}()
	side.Make(t, func() {
		var set, old unix.CPUSet
		unix.SchedGetaffinity(0, &old)
		set.Set(0)
		unix.SchedSetaffinity(0, &set)
		defer unix.SchedSetaffinity(0, &old)
		for range cycles {
			fd, err := unix.Socket(unix.AF_INET, unix.SOCK_STREAM|unix.SOCK_NONBLOCK|unix.SOCK_CLOEXEC, 0)
			if err != nil {
				t.Fatal(err)
			}
			err = unix.Connect(fd, &unix.SockaddrInet4{Port: int(to.Port()), Addr: to.Addr().As4()})
			if err != nil && err != unix.EINPROGRESS && err != unix.EADDRNOTAVAIL {
				t.Fatalf("connect: %v", err)
			}
			fds <- fd
		}
	})
	close(fds)
	<-closed
	waitEmpty(t, ix)
	c, err := ix.Counters()
	if err != nil {
		t.Fatal(err)
	}
	t.Logf("%d cycles: %+v", cycles, c)
	if c.Added == 0 || c.Added != c.Removed || c.Full != 0 {
		t.Errorf("counters %+v: want some added, each removed once, none full", c)
	}
}

// closingServer accepts on 127.0.0.1 in side and closes each connection at
// once; it returns where.
func closingServer(t *testing.T, side testenv.Side) netip.AddrPort {
	t.Helper()
	ln := testenv.Listen(t, side, "tcp", "127.0.0.1:0")
	go func() {
		for {
			c, err := ln.Accept()
			if err != nil {
				return
			}
			c.Close()
		}
	}()
	return ln.Addr().(*net.TCPAddr).AddrPort()
}
