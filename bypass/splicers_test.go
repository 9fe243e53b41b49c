package bypass_test

import (
	"bytes"
	"errors"
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
	"github.com/shunt-project/shunt/host"
	"github.com/shunt-project/shunt/internal/testenv"
)

// thisCommand is the command name the kernel gives this test binary.
func thisCommand() string {
	c := filepath.Base(os.Args[0])
	return c[:min(len(c), 15)]
}

// A program taught as a splicer (enable --splicer) has its readers kept on
// TCP from their first recv: nothing is ever redirected to them and their
// connections leave the sockhash.
func TestTaughtSplicerStaysOnTCP(t *testing.T) {
	in, cg := mustInstall(t)
	if err := in.Learn(thisCommand()); err != nil {
		t.Fatal(err)
	}
	c, s := warmPair(t, cg)
	waitLeft(t, in)
	for i := 0; i < 10; i++ {
		exchange(t, c, s, "over TCP")
		exchange(t, s, c, "and back")
	}
	st, err := in.Stats()
	if err != nil {
		t.Fatal(err)
	}
	if st.Counters.LearnedReaders != 2 || st.Counters.Paired != 1 {
		t.Errorf("counters %+v: want 1 paired connection whose 2 readers were kept on TCP", st.Counters)
	}
	// Its splices count on what it was taught by: one entry, not a second
	// one for its command line that status would show beside it.
	served := make(chan error, 1)
	go func() {
		_, err := testenv.HeaderThenSplice(s)
		served <- err
	}()
	if _, err := c.Write([]byte("HEADspliced")); err != nil {
		t.Fatal(err)
	}
	c.CloseWrite()
	c.SetReadDeadline(time.Now().Add(5 * time.Second))
	if got, err := io.ReadAll(c); string(got) != "spliced" || err != nil {
		t.Fatalf("the splicing server echoed %q, %v", got, err)
	}
	if err := <-served; err != nil {
		t.Fatal(err)
	}
	progs, err := in.SplicePrograms()
	if err != nil {
		t.Fatal(err)
	}
	if len(progs) != 1 || !progs[0].ByName || progs[0].Splices != 1 || progs[0].Caught != 0 {
		t.Errorf("learned %+v: want the program taught by name, with its 1 splice", progs)
	}
	if n, err := in.Forget(thisCommand()); n != 1 || err != nil {
		t.Errorf("forget: %d, %v", n, err)
	}
	if _, err := in.Forget(thisCommand()); !errors.Is(err, bypass.ErrUnknownProgram) {
		t.Errorf("forgetting it twice: %v, want ErrUnknownProgram", err)
	}
}

// While a caught splice reader has redirected bytes it cannot read, its
// peer's sends never take TCP (the splice would read them first, out of
// order): they queue behind the others, and past --max-backlog they fail
// with EACCES. No guard runs here, so nothing resets the connection: the
// splice must have delivered nothing at all.
func TestCaughtSplicerGetsNothingOutOfOrder(t *testing.T) {
	in, cg := mustInstallWith(t, bypass.Options{MaxBacklog: 256 << 10})
	c, s := warmPair(t, cg)
	served := make(chan error, 1)
	go func() {
		_, err := testenv.HeaderThenSplice(s)
		served <- err
	}()
	chunk := []byte(strings.Repeat("x", 64<<10))
	if _, err := c.Write(append([]byte("HEAD"), chunk...)); err != nil {
		t.Fatal(err)
	}
	// Wait until the reader is caught, then keep sending.
	for deadline := time.Now().Add(5 * time.Second); ; time.Sleep(time.Millisecond) {
		if st, _ := in.Stats(); st.Counters.SpliceCaught == 1 {
			break
		}
		if time.Now().After(deadline) {
			t.Fatal("the splice reader was not caught")
		}
	}
	// Past the redirect settle: whatever the catch set off (the program
	// is learned, its other sockets, this sender among them, sent back)
	// has run. The sender must still not leave the sockhash, or its sends
	// would take TCP, which the splice reads first (seen under qemu).
	time.Sleep(3 * bypass.RedirectSettle)
	var sent int
	var err error
	c.SetWriteDeadline(time.Now().Add(10 * time.Second))
	for sent < 64<<20 && err == nil {
		var n int
		n, err = c.Write(chunk)
		sent += n
	}
	if !errors.Is(err, syscall.EACCES) {
		t.Fatalf("after %d more bytes the sender got %v, want EACCES once the backlog passed 256 KiB", sent, err)
	}
	if sent > 1<<20 {
		t.Errorf("the sender queued %d bytes behind a splice that cannot read them, want about 256 KiB", sent)
	}
	// What the splice read it echoes: nothing, or bytes out of order.
	c.SetReadDeadline(time.Now().Add(300 * time.Millisecond))
	if n, err := io.ReadFull(c, make([]byte, 1)); n != 0 {
		t.Errorf("the splicing server echoed bytes (%v): they took TCP past the ones it cannot read", err)
	}
	st, err := in.Stats()
	if err != nil {
		t.Fatal(err)
	}
	if st.Counters.RefusedSends == 0 {
		t.Errorf("counters %+v: refused sends not counted", st.Counters)
	}
	// End the stuck splice (the guard's job in production).
	s.SetDeadline(time.Now())
	select {
	case <-served:
	case <-time.After(5 * time.Second):
		t.Fatal("the splicing server did not end")
	}
}

// TestSpliceAfterRecvOnThisKernel: installed with RefuseSplice where the
// kernel runs BPF LSM programs, a splice from a bypassed socket is refused
// with EINVAL before it reads, and a Go server that reads a header and then
// io.Copy's (splice(2) underneath) goes back to read/write without knowing:
// every byte comes back in order, by redirect, and nothing is caught or
// reset. Elsewhere asking for it fails and installs nothing.
func TestSpliceAfterRecvOnThisKernel(t *testing.T) {
	if !host.CanRefuseSplice() {
		testenv.RequireRoot(t)
		pin := bypasstest.MustPinDir(t)
		if in, err := bypass.Create(pin, bypass.Options{RefuseSplice: true}); !errors.Is(err, bypass.ErrNoSpliceRefusal) {
			if in != nil {
				in.Close()
			}
			t.Fatalf("RefuseSplice on a kernel without BPF LSM: %v, want ErrNoSpliceRefusal", err)
		}
		if _, err := os.Stat(pin); !os.IsNotExist(err) {
			t.Fatalf("a refused install left %s behind", pin)
		}
		t.Logf("kernel %s runs no BPF LSM programs: RefuseSplice refused, nothing installed", host.Probe().Kernel)
		return
	}
	in, cg := mustInstallWith(t, bypass.Options{RefuseSplice: true})
	if o, err := in.Options(); err != nil || !o.RefuseSplice {
		t.Fatalf("options read back %+v, %v; want RefuseSplice", o, err)
	}
	side := testenv.Side{NS: testenv.MustNetNS(t), CG: cg}
	c, s := testenv.ConnPair(t, "tcp4", side, "127.0.0.1:0", side, "127.0.0.1:0")
	for _, conn := range []net.Conn{c, s} {
		conn.SetDeadline(time.Now().Add(60 * time.Second))
	}
	testenv.Warm(t, c, s) // both readers seen in recv: sends are redirected
	type result struct {
		n   int64
		err error
	}
	served := make(chan result, 1)
	go func() {
		n, err := testenv.HeaderThenSplice(s)
		served <- result{n, err}
	}()
	body := testenv.Stream{Seed: 31, Size: 4 << 20, MaxChunk: 64 << 10}
	errs := make(chan error, 1)
	go func() {
		if _, err := c.Write([]byte("HEAD")); err != nil {
			errs <- err
			return
		}
		errs <- body.WriteAndClose(c)
	}()
	if err := body.Check(c, true); err != nil {
		t.Fatalf("echo through the header-then-io.Copy server: %v", err)
	}
	if err := <-errs; err != nil {
		t.Fatal(err)
	}
	if r := <-served; r.err != nil || r.n != body.Size {
		t.Fatalf("server copied %d bytes, %v; want %d", r.n, r.err, body.Size)
	}
	f := flowOf(t, in, testenv.Cookie(t, c))
	st, err := in.Stats()
	if err != nil {
		t.Fatal(err)
	}
	cn := st.Counters
	t.Logf("splices refused %d, caught %d, sent back %d; flow %+v %+v", cn.SplicesRefused, cn.SpliceCaught, cn.SpliceReaders, f.Client, f.Server)
	if cn.SplicesRefused == 0 || cn.SpliceCaught != 0 || cn.SpliceReaders != 0 {
		t.Fatalf("splices refused %d, caught %d, sockets sent back to TCP %d; want refusals only", cn.SplicesRefused, cn.SpliceCaught, cn.SpliceReaders)
	}
	if f == nil || f.Client == nil || f.Client.TxBytes < uint64(body.Size) {
		t.Fatalf("the upload was not redirected: %+v", f)
	}
	spliceRetriedWithoutReading(t, in, side)
}

// spliceRetriedWithoutReading: a reader told EINVAL that reads before its
// next splice is refused again (lighttpd); one that splices again without
// reading does not read instead (HAProxy 2.6 waits for its splice for good),
// so that splice is let through and caught as without --refuse-splice: the
// reader is never left waiting on a splice that can only fail.
func spliceRetriedWithoutReading(t *testing.T, in *bypass.Install, side testenv.Side) {
	c, s := testenv.ConnPair(t, "tcp4", side, "127.0.0.1:0", side, "127.0.0.1:0")
	testenv.Warm(t, c, s)
	before, err := in.Stats()
	if err != nil {
		t.Fatal(err)
	}
	sent := testenv.Stream{Seed: 37, Size: 64 << 10, MaxChunk: 4 << 10}
	if err := sent.Write(c); err != nil {
		t.Fatal(err)
	}
	waitReadable(t, s)
	p := mustPipe(t)
	splice := func() error {
		var err error
		rawFD(t, s, func(fd int) { _, err = unix.Splice(fd, nil, p[1], nil, 64<<10, unix.SPLICE_F_NONBLOCK) })
		return err
	}
	if err := splice(); !errors.Is(err, unix.EINVAL) {
		t.Fatalf("first splice: %v, want EINVAL", err)
	}
	head := make([]byte, 1<<10)
	if _, err := io.ReadFull(s, head); err != nil {
		t.Fatal(err)
	}
	if err := splice(); !errors.Is(err, unix.EINVAL) {
		t.Fatalf("a splice after a read: %v, want EINVAL (the reader reads instead)", err)
	}
	// Redirected bytes wait in the psock, none on TCP: the splice finds
	// nothing to read, as HAProxy's would, and is caught.
	if err := splice(); !errors.Is(err, unix.EAGAIN) {
		t.Fatalf("a splice right after a refused one: %v, want it let through (EAGAIN: nothing on TCP)", err)
	}
	after, err := in.Stats()
	if err != nil {
		t.Fatal(err)
	}
	b, a := before.Counters, after.Counters
	t.Logf("refused %d, let through %d, sent back %d, caught %d", a.SplicesRefused-b.SplicesRefused, a.SplicesRetried-b.SplicesRetried, a.SpliceReaders-b.SpliceReaders, a.SpliceCaught-b.SpliceCaught)
	if a.SplicesRefused-b.SplicesRefused != 2 || a.SplicesRetried-b.SplicesRetried != 1 || a.SpliceCaught-b.SpliceCaught != 1 {
		t.Errorf("want 2 refused, 1 let through and caught")
	}
	// What recv still reads is the stream, in order.
	if err := sent.Check(io.MultiReader(bytes.NewReader(head), s), false); err != nil {
		t.Error(err)
	}
}

// spliceNothing calls splice(2) once, non-blocking, from s into a pipe while
// nothing is queued: the program is seen splicing (and learned) without a
// byte at stake.
func spliceNothing(t *testing.T, s *net.TCPConn) {
	t.Helper()
	p := mustPipe(t)
	var serr error
	rawFD(t, s, func(fd int) { _, serr = unix.Splice(fd, nil, p[1], nil, 4096, unix.SPLICE_F_NONBLOCK) })
	if !errors.Is(serr, unix.EAGAIN) {
		t.Fatalf("splice from an empty socket: %v, want EAGAIN", serr)
	}
}

// When a program is first seen splicing, its other bypassed sockets go back
// to TCP before their peers' next bytes: a program serving many connections
// at once (HAProxy) loses none of them to its later splices. One that holds
// redirected bytes at that moment keeps getting its peer's bytes behind
// them until its reader has read them, then TCP's, which a splice reads in
// order. On the old code each idle connection's first splice was caught
// (and, with no guard here, hung until its deadline).
func TestLearningSendsTheProgramsOtherSocketsBack(t *testing.T) {
	in, cg := mustInstall(t)
	const idle = 3
	type pair struct{ c, s *net.TCPConn }
	var pairs []pair
	for i := 0; i < idle+2; i++ {
		c, s := warmPair(t, cg)
		for _, conn := range []net.Conn{c, s} {
			conn.SetDeadline(time.Now().Add(20 * time.Second))
		}
		pairs = append(pairs, pair{c, s})
	}
	// The last pair holds redirected bytes its reader has not read.
	held := pairs[idle+1]
	if _, err := held.c.Write([]byte("before")); err != nil {
		t.Fatal(err)
	}
	// (a redirect lands inside the sender's write)
	spliceNothing(t, pairs[0].s)
	waitCounter(t, in, "the program to be learned", func(c bypass.Counters) bool { return c.SpliceReaders == 1 })

	// The held pair: redirected behind the unread bytes, read by recv, then
	// the next bytes by TCP, which a splice reads.
	if _, err := held.c.Write([]byte(" and after")); err != nil {
		t.Fatal(err)
	}
	got := make([]byte, len("before and after"))
	if _, err := io.ReadFull(held.s, got); err != nil || string(got) != "before and after" {
		t.Fatalf("held pair read %q, %v", got, err)
	}
	// Each connection's first bytes are queued before its server reads:
	// redirected, a splice could not read them.
	for i, p := range append(pairs[1:idle+1], held) {
		body := bytes.Repeat([]byte{byte('a' + i)}, 1<<20)
		if _, err := p.c.Write(append([]byte("HEAD"), body[:64<<10]...)); err != nil {
			t.Fatal(err)
		}
		served := make(chan error, 1)
		go func() {
			_, err := testenv.HeaderThenSplice(p.s)
			served <- err
		}()
		go func() {
			p.c.Write(body[64<<10:])
			p.c.CloseWrite()
		}()
		echo, err := io.ReadAll(p.c)
		if err != nil || !bytes.Equal(echo, body) {
			t.Fatalf("pair %d: echoed %d bytes (%v) through a header-then-splice server after its program was learned, want %d intact",
				i+1, len(echo), err, len(body))
		}
		if err := <-served; err != nil {
			t.Fatalf("pair %d: server: %v", i+1, err)
		}
	}
	st, err := in.Stats()
	if err != nil {
		t.Fatal(err)
	}
	if st.Counters.SpliceCaught != 0 {
		t.Errorf("counters %+v: a connection was caught after its program was learned", st.Counters)
	}
	// Every proven socket of this program but the splicing one: both ends
	// of every pair.
	if want := uint64(2*len(pairs) - 1); st.Counters.PresumedSplicers != want || st.Counters.PresumedQueued != 1 {
		t.Errorf("counters %+v: want %d sockets sent back, 1 of them with bytes queued", st.Counters, want)
	}
}
