package guard_test

import (
	"errors"
	"fmt"
	"io"
	"net"
	"os"
	"path/filepath"
	"strings"
	"syscall"
	"testing"
	"time"

	"golang.org/x/sys/unix"

	"github.com/shunt-project/shunt/bypass"
	"github.com/shunt-project/shunt/bypass/bypasstest"
	"github.com/shunt-project/shunt/internal/testenv"
)

// installed installs bypass on a cgroup of its own, with no guard yet.
func installed(t *testing.T) (*bypass.Install, testenv.Side) {
	t.Helper()
	return installedWith(t, bypass.Options{})
}

// installedWith is installed with install options, and no probation:
// these tests catch what a program past it (one that read by recv a while
// before it spliced) meets; TestConcurrentSplicerIsNeverCaught installs as
// a user does.
func installedWith(t *testing.T, opts bypass.Options) (*bypass.Install, testenv.Side) {
	t.Helper()
	opts.NoProbation = true
	return installedAsIs(t, opts)
}

// installedAsIs is installedWith with opts as they are.
func installedAsIs(t *testing.T, opts bypass.Options) (*bypass.Install, testenv.Side) {
	t.Helper()
	testenv.RequireRoot(t)
	pin := bypasstest.MustPinDir(t)
	cg := testenv.MustCgroup(t)
	in, err := bypass.Create(pin, opts)
	if err != nil {
		t.Fatal(err)
	}
	t.Cleanup(func() { in.Close() })
	if _, err := in.Attach(cg); err != nil {
		t.Fatal(err)
	}
	return in, testenv.Side{NS: testenv.MustNetNS(t), CG: cg}
}

// guarded is installed with the guard running until the test ends; what
// it reports comes on the channel.
func guarded(t *testing.T) (*bypass.Install, testenv.Side, <-chan string) {
	t.Helper()
	in, side := installed(t)
	return in, side, runGuard(t, in)
}

func runGuard(t *testing.T, in *bypass.Install) <-chan string {
	t.Helper()
	reports := make(chan string, 16)
	bypasstest.RunGuard(t, in, func(s string) {
		select {
		case reports <- s:
		default: // past 16 unread: a test that failed already; the guard goes on
			t.Logf("guard (not read by the test): %s", s)
		}
	})
	return reports
}

// The ways a program splices from a socket: splice(2), and io_uring's
// IORING_OP_SPLICE, which runs in an io_uring worker thread.
var splicers = []struct {
	name  string
	serve func(*net.TCPConn) (int64, error) // a header by recv, then splices
	echo  func(*net.TCPConn) (int64, error) // splices only
}{
	{"splice", testenv.HeaderThenSplice, func(s *net.TCPConn) (int64, error) { return io.Copy(s, s) }},
	{"io_uring", testenv.HeaderThenIOUringSplice, testenv.IOUringEcho},
}

// A reader that splices after recv, with redirected bytes queued that
// splice cannot read, must not wait for them for ever: the connection ends
// with an error on both sides, it is counted and reported, and the
// program's next connection stays on TCP and works. An io_uring splice was
// not seen before 2026-11-29 (the watch knew a splice by the system call's
// number): it waited with 65,000 redirected bytes queued until the test
// gave up, and a splice after the peer's end got that end at once, the
// bytes before it lost without a word.
func TestSpliceAfterRecvIsCaughtThenLearned(t *testing.T) {
	for _, sp := range splicers {
		t.Run(sp.name, func(t *testing.T) { spliceCaughtThenLearned(t, sp.serve) })
	}
}

func spliceCaughtThenLearned(t *testing.T, serve func(*net.TCPConn) (int64, error)) {
	in, side, reports := guarded(t)
	body := strings.Repeat("spliced body ", 5000)

	// A bound on liveness, not a speed claim: under qemu without KVM
	// (the kernel matrix, -short) everything runs 5 to 20 times slower;
	// there it took 3.2 s once, beside a loaded host.
	bound := 3 * time.Second
	if testing.Short() {
		bound = 10 * time.Second
	}
	c, s, caught := testenv.CaughtSpliceBy(t, side, serve)
	var r testenv.SpliceResult
	select {
	case r = <-caught:
	case <-time.After(bound + 5*time.Second):
		s.CloseRead() // ends a splice that waits for TCP bytes
		r = <-caught
		t.Fatalf("the splicing server still waited after %v with redirected bytes queued (then: %d bytes, %v)", bound+5*time.Second, r.N, r.Err)
	}
	if !errors.Is(r.Err, syscall.ECONNABORTED) {
		t.Fatalf("the splicing server got %d bytes, err %v after %v; want ECONNABORTED", r.N, r.Err, r.At)
	}
	t.Logf("caught connection ended after %v", r.At)
	if r.At > bound {
		t.Errorf("the caught connection took %v to end, want about a second at most (%v here)", r.At, bound)
	}
	if _, err := io.ReadAll(c); !errors.Is(err, syscall.ECONNRESET) {
		t.Errorf("the client read %v, want ECONNRESET", err)
	}
	select {
	case msg := <-reports:
		comm := filepath.Base(os.Args[0])
		if len(comm) > 15 {
			comm = comm[:15]
		}
		if !strings.Contains(msg, "("+comm+")") || !strings.Contains(msg, "connection reset") {
			t.Errorf("guard report %q does not name %s and the reset", msg, comm)
		}
	case <-time.After(5 * time.Second):
		t.Fatal("the guard reported nothing")
	}
	st, err := in.Stats()
	if err != nil {
		t.Fatal(err)
	}
	if st.Counters.SpliceCaught != 1 || len(st.SplicePrograms) != 1 || st.SplicePrograms[0].Caught != 1 {
		t.Fatalf("caught %d, programs %+v; want 1 caught, by the one program", st.Counters.SpliceCaught, st.SplicePrograms)
	}

	// The same program's next connection: its reader stays on TCP from its
	// first recv, so the splice sees every byte.
	c, s = testenv.ConnPair(t, "tcp4", side, "127.0.0.1:0", side, "127.0.0.1:0")
	for _, conn := range []*net.TCPConn{c, s} {
		conn.SetDeadline(time.Now().Add(20 * time.Second))
	}
	testenv.Warm(t, c, s)
	served := make(chan testenv.SpliceResult, 1)
	go func() {
		n, err := serve(s)
		served <- testenv.SpliceResult{N: n, Err: err}
	}()
	if _, err := c.Write([]byte("HEAD" + body)); err != nil {
		t.Fatal(err)
	}
	c.CloseWrite()
	got, err := io.ReadAll(c)
	if r := <-served; r.Err != nil || string(got) != body || err != nil {
		t.Fatalf("learned program: server copied %d (%v), client read %d bytes intact=%v (%v)", r.N, r.Err, len(got), string(got) == body, err)
	}
	if st, err = in.Stats(); err != nil || st.Counters.LearnedReaders == 0 || st.Counters.SpliceCaught != 1 {
		t.Fatalf("after a learned connection: %+v %v", st.Counters, err)
	}
}

// A program new to the install that reads a header and then splices, with
// many connections at once (HAProxy with 20 concurrent clients): it reads
// by TCP while on probation, so its first splice finds nothing it cannot
// read, and is learned there; no connection is caught, every byte arrives.
// Seen failing without the probation (ProbationReads 0): 7, 15, 18 and 20
// of 20 caught.
//
// The probation's time limit is a minute here: under qemu (6.1, CI) setting
// up the 20 connections outlasted ProbationTime, which proved the program
// before it spliced and 15 of 20 were caught.
func TestConcurrentSplicerIsNeverCaught(t *testing.T) {
	in, side := installedAsIs(t, bypass.Options{ProbationLimit: time.Minute})
	reports := runGuard(t, in)
	const n = 20
	body := strings.Repeat("spliced body ", 5000)
	type pair struct{ c, s *net.TCPConn }
	pairs := make([]pair, n)
	for i := range pairs {
		c, s := testenv.ConnPair(t, "tcp4", side, "127.0.0.1:0", side, "127.0.0.1:0")
		for _, conn := range []*net.TCPConn{c, s} {
			conn.SetDeadline(time.Now().Add(20 * time.Second))
		}
		testenv.Warm(t, c, s) // each server's reader seen in recv
		pairs[i] = pair{c, s}
	}
	results := make(chan error, n)
	for _, p := range pairs {
		go func() { _, err := testenv.HeaderThenSplice(p.s); results <- err }()
		go func() {
			if _, err := p.c.Write([]byte("HEAD" + body)); err != nil {
				results <- err
				return
			}
			// The end after the echo: a splice caught with the end
			// queued returns it first (cut short, another test's).
			got := make([]byte, len(body))
			n, err := io.ReadFull(p.c, got)
			got = got[:n]
			p.c.CloseWrite()
			switch {
			case errors.Is(err, syscall.ECONNRESET):
				results <- err
			case err != nil || string(got) != body:
				results <- fmt.Errorf("read %d of %d bytes back, intact %v: %v", len(got), len(body), string(got) == body, err)
			default:
				results <- nil
			}
		}()
	}
	var aborted, reset int
	for range 2 * n {
		switch err := <-results; {
		case errors.Is(err, syscall.ECONNABORTED):
			aborted++
		case errors.Is(err, syscall.ECONNRESET):
			reset++
		case err != nil:
			t.Error(err)
		}
	}
	st, err := in.Stats()
	if err != nil {
		t.Fatal(err)
	}
	t.Logf("%d connections: %d caught, %d readers held on probation, %d programs learned", n, st.Counters.SpliceCaught, st.Counters.ReaderHeld, len(st.SplicePrograms))
	if st.Counters.SpliceCaught != 0 || aborted != 0 || reset != 0 {
		t.Fatalf("caught %d (splices aborted %d, clients reset %d); want none", st.Counters.SpliceCaught, aborted, reset)
	}
	learnedQuietly(t, st, reports)
}

// learnedQuietly fails unless this program was learned, alone, with
// nothing reported by the guard: its first splice caught nothing.
func learnedQuietly(t *testing.T, st bypass.Stats, reports <-chan string) {
	t.Helper()
	if len(st.SplicePrograms) != 1 {
		t.Fatalf("programs learned: %+v; want this one", st.SplicePrograms)
	}
	select {
	case msg := <-reports:
		t.Fatalf("the guard reported %q", msg)
	default:
	}
}

// A splice reader caught after its peer's end of stream came (by TCP, as
// FIN always does) gets that end of stream from the splice at once, before
// the redirected bytes it cannot read: a short stream that ends cleanly.
// No hook before the splice runs on these kernels to prevent it (with
// --refuse-splice, where BPF LSM runs, the splice is refused before it
// reads); it must not be silent: counted, and reported as cut short.
func TestCaughtAfterThePeersEndIsToldCutShort(t *testing.T) {
	for _, sp := range splicers {
		t.Run(sp.name, func(t *testing.T) { caughtAfterThePeersEnd(t, sp.echo) })
	}
}

func caughtAfterThePeersEnd(t *testing.T, echo func(*net.TCPConn) (int64, error)) {
	in, side, reports := guarded(t)
	body := strings.Repeat("spliced body ", 5000)
	c, s := testenv.ConnPair(t, "tcp4", side, "127.0.0.1:0", side, "127.0.0.1:0")
	for _, conn := range []*net.TCPConn{c, s} {
		conn.SetDeadline(time.Now().Add(20 * time.Second))
	}
	testenv.Warm(t, c, s)
	// A server that closes once it has sent (HTTP/1.0's), before its peer
	// first splices.
	if _, err := c.Write([]byte("HEAD" + body)); err != nil {
		t.Fatal(err)
	}
	if err := c.CloseWrite(); err != nil {
		t.Fatal(err)
	}
	head := make([]byte, 4)
	if _, err := io.ReadFull(s, head); err != nil {
		t.Fatal(err)
	}
	waitState(t, s, 8 /* TCP_CLOSE_WAIT: the FIN is queued */)
	n, err := echo(s)
	st, serr := in.Stats()
	if serr != nil {
		t.Fatal(serr)
	}
	cn := st.Counters
	t.Logf("the splice copied %d of %d bytes (%v); caught %d, cut short %d", n, len(body), err, cn.SpliceCaught, cn.SpliceTruncated)
	if err != nil || n == int64(len(body)) {
		// Loud (an error), or whole: nothing cut short to tell.
		if cn.SpliceTruncated != 0 {
			t.Errorf("counted %d cut short, but the splice got %d bytes, %v", cn.SpliceTruncated, n, err)
		}
		return
	}
	if cn.SpliceCaught != 1 || cn.SpliceTruncated != 1 {
		t.Fatalf("the splice ended cleanly after %d of %d bytes; caught %d, cut short %d, want 1 and 1", n, len(body), cn.SpliceCaught, cn.SpliceTruncated)
	}
	select {
	case msg := <-reports:
		if !strings.Contains(msg, "end of stream") || !strings.Contains(msg, "cut short") {
			t.Errorf("guard report %q does not say the stream was cut short", msg)
		}
	case <-time.After(5 * time.Second):
		t.Fatal("the guard reported nothing")
	}
}

// The peer's end of stream may also come after the catch, while the
// splice waits for the guard's reset: the splice returns it, and the
// stream is cut short all the same. No guard runs here, so the end comes
// before any reset.
func TestPeersEndAfterTheCatchIsCountedCutShort(t *testing.T) {
	in, side := installed(t)
	c, _, served := testenv.CaughtSplice(t, side)
	for deadline := time.Now().Add(5 * time.Second); ; time.Sleep(5 * time.Millisecond) {
		st, err := in.Stats()
		if err != nil {
			t.Fatal(err)
		}
		if st.Counters.SpliceCaught == 1 {
			break
		}
		if time.Now().After(deadline) {
			t.Fatal("the splice reader was not caught")
		}
	}
	if err := c.CloseWrite(); err != nil {
		t.Fatal(err)
	}
	r := <-served
	st, err := in.Stats()
	if err != nil {
		t.Fatal(err)
	}
	t.Logf("the splice copied %d bytes (%v); caught %d, cut short %d", r.N, r.Err, st.Counters.SpliceCaught, st.Counters.SpliceTruncated)
	if r.Err != nil || r.N != 0 {
		t.Fatalf("the splice got %d bytes, %v; want the peer's end of stream at once (nothing redirected can be spliced)", r.N, r.Err)
	}
	if st.Counters.SpliceTruncated != 1 {
		t.Errorf("cut short %d, want 1", st.Counters.SpliceTruncated)
	}
}

// waitState waits until the socket's TCP state is state.
func waitState(t *testing.T, c *net.TCPConn, state uint8) {
	t.Helper()
	raw, err := c.SyscallConn()
	if err != nil {
		t.Fatal(err)
	}
	for deadline := time.Now().Add(5 * time.Second); ; time.Sleep(time.Millisecond) {
		var info *unix.TCPInfo
		var ierr error
		if err := raw.Control(func(fd uintptr) { info, ierr = unix.GetsockoptTCPInfo(int(fd), unix.IPPROTO_TCP, unix.TCP_INFO) }); err != nil || ierr != nil {
			t.Fatal(err, ierr)
		}
		if info.State == state {
			return
		}
		if time.Now().After(deadline) {
			t.Fatalf("the socket stayed in TCP state %d, want %d", info.State, state)
		}
	}
}

// A caught connection whose report finds no room in the guard's ring (no
// guard ran yet, or it fell behind) is reported again once there is room:
// the splicer is reset, not left waiting for ever with the catch counted
// and nobody told.
func TestCaughtWithTheRingFullIsReportedLater(t *testing.T) {
	in, side := installed(t)
	bypasstest.FillGuardRing(t, in.Dir())
	_, _, caught := testenv.CaughtSplice(t, side)
	var lost uint64
	for deadline := time.Now().Add(5 * time.Second); lost == 0 && time.Now().Before(deadline); time.Sleep(20 * time.Millisecond) {
		st, err := in.Stats()
		if err != nil {
			t.Fatal(err)
		}
		lost = st.Counters.EventsLost
	}
	if lost == 0 {
		t.Fatal("guard_events_lost stayed 0 with the ring full: the catch went nowhere or was never made")
	}
	reports := runGuard(t, in)
	r := <-caught
	if !errors.Is(r.Err, syscall.ECONNABORTED) {
		t.Fatalf("the splicing server got %d bytes, err %v after %v; want ECONNABORTED once the guard ran", r.N, r.Err, r.At)
	}
	select {
	case msg := <-reports:
		if !strings.Contains(msg, "connection reset") {
			t.Errorf("guard report %q does not say the connection was reset", msg)
		}
	case <-time.After(5 * time.Second):
		t.Fatal("the guard reported nothing")
	}
	st, err := in.Stats()
	if err != nil {
		t.Fatal(err)
	}
	if st.Counters.SpliceCaught != 1 {
		t.Errorf("caught %d, want 1 (counted once, when reported)", st.Counters.SpliceCaught)
	}
	t.Logf("%d guard events lost while the ring was full; caught connection ended after %v", st.Counters.EventsLost, r.At)
}
