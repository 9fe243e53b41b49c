package bypass_test

import (
	"fmt"
	"io"
	"net"
	"strings"
	"testing"
	"time"

	"golang.org/x/sys/unix"

	"github.com/shunt-project/shunt/bypass"
	"github.com/shunt-project/shunt/bypass/bypasstest"
	"github.com/shunt-project/shunt/host"
	"github.com/shunt-project/shunt/internal/testenv"
)

// blockingReader reads a connection with blocking recv (MSG_WAITALL or 0 for
// flags), as a C program would: Go's own sockets are non-blocking, where
// MSG_WAITALL has no effect.
type blockingReader struct {
	t     *testing.T
	c     *net.TCPConn
	flags int
}

func (r blockingReader) Read(b []byte) (n int, err error) {
	rawFD(r.t, r.c, func(fd int) {
		unix.SetNonblock(fd, false)
		defer unix.SetNonblock(fd, true)
		unix.SetsockoptTimeval(fd, unix.SOL_SOCKET, unix.SO_RCVTIMEO, &unix.Timeval{Sec: 10})
		for {
			n, _, err = unix.Recvfrom(fd, b, r.flags)
			// A blocking read on a sockhash socket gives EAGAIN where TCP
			// restarts (the "signal" row of docs/TRANSPARENCY.md).
			if err != unix.EAGAIN && err != unix.EINTR {
				break
			}
		}
	})
	if n == 0 && err == nil {
		return 0, fmt.Errorf("EOF")
	}
	return max(n, 0), err
}

// waitLeft waits until no socket of the install is left in the sockhash. A
// leave waits out the redirect settle; the bound is for a guest under qemu
// without KVM, where that took over 2 s.
func waitLeft(t *testing.T, in *bypass.Install) {
	t.Helper()
	const within = 10 * time.Second
	deadline := time.Now().Add(within)
	for n := mapEntries(t, in, "sock_hash"); n != 0; n = mapEntries(t, in, "sock_hash") {
		if time.Now().After(deadline) {
			t.Fatalf("%d socket(s) still in the sockhash after %v", n, within)
		}
		time.Sleep(10 * time.Millisecond)
	}
}

// A reader that blocks in recv, or asks for MSG_WAITALL, from its first read:
// its direction never takes a redirect, and the connection leaves the
// sockhash at once, so what the kernel gives a sockhash socket differently
// (FIONREAD of bytes that came by TCP, here) is TCP's own again.
func TestBlockingReaderLeaves(t *testing.T) {
	for _, tc := range []struct {
		name  string
		flags int
	}{{"recv", 0}, {"MSG_WAITALL", unix.MSG_WAITALL}} {
		t.Run(tc.name, func(t *testing.T) {
			in, cg := mustInstall(t)
			c, s := connPair(t, cg)
			before, _ := in.Stats()

			go c.Write([]byte("hello"))
			b := make([]byte, 5)
			if n, err := (blockingReader{t, s, tc.flags}).Read(b); n != 5 || err != nil || string(b) != "hello" {
				t.Fatalf("blocking read %q %v", b[:n], err)
			}
			waitLeft(t, in)
			after, _ := in.Stats()
			if after.Counters.TCPReaders-before.Counters.TCPReaders != 1 || after.Counters.Left-before.Counters.Left != 2 {
				t.Errorf("counters: %d TCP readers, %d sockets left; want 1 and 2",
					after.Counters.TCPReaders-before.Counters.TCPReaders, after.Counters.Left-before.Counters.Left)
			}

			c.Write([]byte("twelve bytes"))
			if q := waitQueued(t, s, 12); q != 12 {
				t.Errorf("FIONREAD %d after leaving, want 12 (a sockhash socket counts only redirected bytes)", q)
			}
			if _, err := io.ReadFull(s, make([]byte, 12)); err != nil {
				t.Fatal(err)
			}
			testenv.Warm(t, c, s)
			exchange(t, s, c, "and back")
			if f := flowOf(t, in, testenv.Cookie(t, c)); f != nil {
				t.Errorf("connection paired again after it left: %+v", f)
			}
		})
	}
}

// A reader that switches to MSG_WAITALL in the middle of a redirected stream:
// every byte arrives in order across the switch, and the connection leaves the
// sockhash once nothing redirected is left unread.
func TestWaitAllSwitchMidStream(t *testing.T) {
	in, cg := mustInstall(t)
	c, s := warmPair(t, cg)
	for _, conn := range []*net.TCPConn{c, s} {
		conn.SetDeadline(time.Now().Add(30 * time.Second))
	}

	stream := testenv.Stream{Seed: 11, Size: 16 << 20, MaxChunk: 64 << 10}
	wrote := make(chan error, 1)
	go func() { wrote <- stream.Write(c) }()
	if err := stream.Check(&switchingReader{plain: s, waitAll: blockingReader{t, s, unix.MSG_WAITALL}, switchAt: 4 << 20}, false); err != nil {
		t.Fatal(err)
	}
	if err := <-wrote; err != nil {
		t.Fatal(err)
	}
	waitLeft(t, in)
	st, _ := in.Stats()
	if st.Counters.TCPReaders == 0 {
		t.Error("the MSG_WAITALL reader was not counted")
	}
}

// switchingReader reads plainly up to switchAt bytes, then with MSG_WAITALL.
type switchingReader struct {
	plain    *net.TCPConn
	waitAll  blockingReader
	switchAt int
	read     int
}

func (r *switchingReader) Read(b []byte) (int, error) {
	var n int
	var err error
	if r.read < r.switchAt {
		n, err = r.plain.Read(b[:min(len(b), r.switchAt-r.read)])
	} else {
		n, err = r.waitAll.Read(b)
	}
	r.read += n
	return n, err
}

// Leaving never drops redirected bytes: the peer of a socket that left keeps
// its place in the sockhash until its reader has read what was redirected to
// it, and only then follows.
func TestLeaveWaitsForUnreadBytes(t *testing.T) {
	in, cg := mustInstall(t)
	c, s := warmPair(t, cg)
	c.SetDeadline(time.Now().Add(10 * time.Second))

	unread := strings.Repeat("redirected, not read yet ", 40)
	if _, err := s.Write([]byte(unread)); err != nil {
		t.Fatal(err)
	}
	go c.Write([]byte("1234"))
	if n, err := (blockingReader{t, s, unix.MSG_WAITALL}).Read(make([]byte, 4)); n != 4 || err != nil {
		t.Fatalf("MSG_WAITALL read: %d %v", n, err)
	}
	// The server leaves; the client, holding unread redirected bytes, stays
	// for as long as they are unread (here several times the settle delay).
	deadline := time.Now().Add(2 * time.Second)
	for mapEntries(t, in, "sock_hash") > 1 && time.Now().Before(deadline) {
		time.Sleep(10 * time.Millisecond)
	}
	time.Sleep(500 * time.Millisecond)
	if n := mapEntries(t, in, "sock_hash"); n != 1 {
		t.Fatalf("%d sockets in the sockhash, want 1: the client, holding %d unread redirected bytes", n, len(unread))
	}
	got := make([]byte, len(unread))
	if _, err := io.ReadFull(c, got); err != nil || string(got) != unread {
		t.Fatalf("client read %q %v", got, err)
	}
	waitLeft(t, in)
	exchange(t, s, c, "after both left")
	exchange(t, c, s, "both ways")
}

// Without a reader seen in recv the first bytes take TCP; TrustReaders
// redirects them too, keeps a blocking reader's connection, and still moves a
// MSG_WAITALL reader's connection back to plain TCP.
func TestTrustReaders(t *testing.T) {
	for _, trust := range []bool{false, true} {
		t.Run(fmt.Sprintf("trust=%v", trust), func(t *testing.T) {
			in, cg := mustInstallWith(t, bypass.Options{TrustReaders: trust})
			c, s := connPair(t, cg)
			exchange(t, c, s, "first")
			f := flowOf(t, in, testenv.Cookie(t, c))
			if f == nil || f.Client == nil {
				t.Fatalf("not paired: %+v", f)
			}
			if redirected := f.Client.TxMsgs == 1; redirected != trust {
				t.Errorf("first send redirected: %v, want %v (%+v)", redirected, trust, f.Client)
			}

			go c.Write([]byte("1234"))
			if n, err := (blockingReader{t, s, 0}).Read(make([]byte, 4)); n != 4 || err != nil {
				t.Fatalf("blocking read: %d %v", n, err)
			}
			if !trust {
				waitLeft(t, in)
				return
			}
			time.Sleep(3 * bypass.RedirectSettle)
			if n := mapEntries(t, in, "sock_hash"); n != 2 {
				t.Fatalf("%d sockets in the sockhash after a blocking read, want both", n)
			}
			go c.Write([]byte("1234"))
			if n, err := (blockingReader{t, s, unix.MSG_WAITALL}).Read(make([]byte, 4)); n != 4 || err != nil {
				t.Fatalf("MSG_WAITALL read: %d %v", n, err)
			}
			waitLeft(t, in)
		})
	}
}

// Both directions stream while the server's reader switches to MSG_WAITALL:
// the connection leaves the sockhash under traffic each way, and neither
// stream loses, repeats or reorders a byte.
func TestLeaveUnderTrafficBothWays(t *testing.T) {
	in, cg := mustInstall(t)
	c, s := warmPair(t, cg)
	for _, conn := range []*net.TCPConn{c, s} {
		conn.SetDeadline(time.Now().Add(60 * time.Second))
	}
	up := testenv.Stream{Seed: 21, Size: 32 << 20, MaxChunk: 64 << 10}
	down := testenv.Stream{Seed: 22, Size: 32 << 20, MaxChunk: 64 << 10}
	errs := make(chan error, 4)
	go func() { errs <- up.Write(c) }()
	go func() { errs <- down.Write(s) }()
	go func() { errs <- down.Check(c, false) }()
	go func() {
		errs <- up.Check(&switchingReader{plain: s, waitAll: blockingReader{t, s, unix.MSG_WAITALL}, switchAt: 8 << 20}, false)
	}()
	for range 4 {
		if err := <-errs; err != nil {
			t.Fatal(err)
		}
	}
	waitLeft(t, in)
	exchange(t, c, s, "plain TCP now")
	exchange(t, s, c, "both ways")
}

// An install reports the options it was created with, also through a handle
// opened later from the pins.
func TestOptionsReadBack(t *testing.T) {
	for _, want := range []bypass.Options{{MaxBacklog: bypass.DefaultMaxBacklog}, {MaxBacklog: 1 << 20, TrustReaders: true}, {MaxBacklog: bypass.DefaultMaxBacklog, NoProbation: true}, {MaxBacklog: bypass.DefaultMaxBacklog, NoFIONREADWatch: true}} {
		in, _ := bypasstest.MustEnabled(t, want)
		again, err := bypass.Open(in.Dir())
		if err != nil {
			t.Fatal(err)
		}
		got, err := again.Options()
		again.Close()
		if err != nil || got != want {
			t.Errorf("options %+v (%v), want %+v", got, err, want)
		}
	}
}

// A connection's first bytes come by TCP (its reader has not read yet), into
// a socket in the sockhash, where FIONREAD counts them only on kernels with
// the fix (04af4efde58a), or where shunt corrects the answer (no lockdown).
// status reports both; this holds them to what an installed shunt gives a
// reader, on every kernel.
func TestFIONREADOfTCPBytesAsProbed(t *testing.T) {
	in, cg := mustInstall(t)
	c, s := connPair(t, cg)
	if f := flowOf(t, in, testenv.Cookie(t, s)); f == nil {
		t.Fatal("the server socket is not in the sockhash")
	}
	if _, err := c.Write([]byte("0123456789")); err != nil {
		t.Fatal(err)
	}
	waitReadable(t, s)
	want := 0
	if host.Probe().FionreadCountsTCP || in.FionreadCorrected() {
		want = 10
	}
	if got := testenv.InQueue(t, s); got != want {
		t.Errorf("FIONREAD %d, the probe says %d", got, want)
	}
	got := make([]byte, 10)
	if _, err := io.ReadFull(s, got); err != nil || string(got) != "0123456789" {
		t.Errorf("read %q, %v", got, err)
	}
}

// Redirected bytes are counted by FIONREAD only where the kernel's psock
// counts its queue (msg_tot_len; not on 6.1), or where shunt corrects the
// answer (6.1 without lockdown): held to what status reports.
func TestFIONREADOfRedirectedBytesAsProbed(t *testing.T) {
	in, cg := mustInstall(t)
	c, s := connPair(t, cg)
	testenv.Warm(t, c, s)
	before := flowOf(t, in, testenv.Cookie(t, c))
	if _, err := c.Write([]byte("twelve bytes")); err != nil {
		t.Fatal(err)
	}
	waitReadable(t, s)
	after := flowOf(t, in, testenv.Cookie(t, c))
	if before == nil || after == nil || after.Client.TxBytes-before.Client.TxBytes != 12 {
		t.Fatalf("the 12 bytes were not redirected: %+v -> %+v", before, after)
	}
	want := 0
	if host.PsockCountsQueue() || in.FionreadCorrected() {
		want = 12
	}
	if got := testenv.InQueue(t, s); got != want {
		t.Errorf("FIONREAD %d, want %d on this kernel", got, want)
	}
	got := make([]byte, 12)
	if _, err := io.ReadFull(s, got); err != nil || string(got) != "twelve bytes" {
		t.Errorf("read %q, %v", got, err)
	}
}

// FIONREAD is never told less than is queued, also past the 4,096
// messages the correction adds up one by one (6.1) for a reader whose
// SO_RCVBUF lets it hold more than --max-backlog: past its walk the
// correction adds the larger bound. Before it added --max-backlog alone,
// and told such a reader 24 MiB of the 28 queued here.
func TestFIONREADPastTheWalkCountsEverything(t *testing.T) {
	in, cg := mustInstall(t)
	if !host.PsockCountsQueue() && !in.FionreadCorrected() {
		t.Skip("FIONREAD does not count redirected bytes on this kernel and is not corrected (lockdown)")
	}
	c, s := connPair(t, cg)
	testenv.Warm(t, c, s)
	const sends, size = 7000, 4 << 10 // 28 MiB in more messages than the walk's 4,096
	rawFD(t, s, func(fd int) {
		if err := unix.SetsockoptInt(fd, unix.SOL_SOCKET, unix.SO_RCVBUFFORCE, 64<<20); err != nil {
			t.Fatal(err)
		}
	})
	before := flowOf(t, in, testenv.Cookie(t, c))
	msg := make([]byte, size)
	for i := 0; i < sends; i++ {
		if _, err := c.Write(msg); err != nil {
			t.Fatal(err)
		}
	}
	after := flowOf(t, in, testenv.Cookie(t, c))
	if before == nil || after == nil || after.Client.TxBytes-before.Client.TxBytes != sends*size {
		t.Fatalf("not every send was redirected: %+v -> %+v", before, after)
	}
	got := testenv.InQueue(t, s)
	if got < sends*size || (host.PsockCountsQueue() && got != sends*size) {
		t.Errorf("FIONREAD %d with %d bytes queued", got, sends*size)
	}
	if _, err := io.CopyN(io.Discard, s, sends*size); err != nil {
		t.Fatal(err)
	}
}

// waitReadable waits up to 2 s for bytes to read on c; the test fails
// without them.
func waitReadable(t *testing.T, c *net.TCPConn) {
	t.Helper()
	rawFD(t, c, func(fd int) {
		if n, err := unix.Poll([]unix.PollFd{{Fd: int32(fd), Events: unix.POLLIN}}, 2000); n != 1 || err != nil {
			t.Fatalf("the bytes did not arrive: poll %d, %v", n, err)
		}
	})
}
