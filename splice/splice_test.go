package splice_test

import (
	"errors"
	"io"
	"net"
	"os"
	"os/exec"

	"strings"
	"syscall"
	"testing"
	"time"

	"golang.org/x/sys/unix"

	"github.com/shunt-project/shunt/host"
	"github.com/shunt-project/shunt/internal/lab"
	"github.com/shunt-project/shunt/internal/testenv"
	"github.com/shunt-project/shunt/splice"
)

// mustSplicer loads a Splicer for the test and checks at the end that no
// pair, socket or cookie entry is left in it.
// mechanisms are what the splicers a test makes use (the zero value: this
// kernel's newest); TestJoinAsOnOlderKernels sets them for the tests it runs.
var mechanisms host.Mechanisms

// useMechanisms makes the rest of t's splicers use m.
func useMechanisms(t *testing.T, m host.Mechanisms) {
	old := mechanisms
	mechanisms = m
	t.Cleanup(func() { mechanisms = old })
}

func mustSplicer(t *testing.T, opts splice.Options) *splice.Splicer {
	t.Helper()
	testenv.RequireRoot(t)
	opts.Mechanisms = mechanisms
	s, err := splice.New(opts)
	if err != nil {
		t.Fatal(err)
	}
	t.Cleanup(func() {
		if err := s.Close(); err != nil {
			t.Error(err)
		}
	})
	return s
}

// proxied is a client and a server with a proxy's two sockets between
// them: client <-> front ... back <-> server.
type proxied struct {
	client, front, back, server *net.TCPConn
	pair                        *splice.Pair
}

var families = []struct{ name, network, addr string }{
	{"ipv4", "tcp4", "127.0.0.1:0"},
	{"ipv6", "tcp6", "[::1]:0"},
}

// mustSockets connects client to front and back to server in ns.
func mustSockets(t *testing.T, ns *testenv.NetNS, network, addr string) *proxied {
	t.Helper()
	side := testenv.Side{NS: ns}
	p := &proxied{}
	p.client, p.front = testenv.ConnPair(t, network, side, addr, side, addr)
	p.back, p.server = testenv.ConnPair(t, network, side, addr, side, addr)
	return p
}

// join splices front and back.
func (p *proxied) join(t *testing.T, s *splice.Splicer) *proxied {
	t.Helper()
	var err error
	if p.pair, err = s.Join(p.front, p.back); err != nil {
		t.Fatal(err)
	}
	return p
}

// mustProxied is mustSockets, joined.
func mustProxied(t *testing.T, s *splice.Splicer, ns *testenv.NetNS, network, addr string) *proxied {
	t.Helper()
	return mustSockets(t, ns, network, addr).join(t, s)
}

// waitKernel waits until the kernel forwards both directions.
func (p *proxied) waitKernel(t *testing.T) {
	t.Helper()
	for deadline := time.Now().Add(5 * time.Second); ; time.Sleep(time.Millisecond) {
		if ab, ba := p.pair.Stats(); ab.KernelNow && ba.KernelNow {
			return
		}
		if time.Now().After(deadline) {
			t.Fatal("an idle pair was not handed to the kernel within 5 s")
		}
	}
}

// streamBothWays sends up from client to server and down the other way at
// once, each closed after its last byte, and checks both arrive whole.
func (p *proxied) streamBothWays(t *testing.T, up, down testenv.Stream) {
	t.Helper()
	if err := testenv.BothWays(p.client, p.server, up, down)(); err != nil {
		t.Fatal(err)
	}
}

// waitDone waits for the pair to end.
func (p *proxied) waitDone(t *testing.T) {
	t.Helper()
	select {
	case <-p.pair.Done():
	case <-time.After(10 * time.Second):
		t.Fatal("pair did not end within 10 s")
	}
}

// TestStreamBothWays: random-sized writes both ways at once arrive intact,
// then each side's FIN arrives after its last byte and the pair ends.
func TestStreamBothWays(t *testing.T) {
	for _, f := range families {
		t.Run(f.name, func(t *testing.T) {
			s := mustSplicer(t, splice.Options{})
			p := mustProxied(t, s, testenv.MustNetNS(t), f.network, f.addr)
			// Joined directions start in user space and hand over to the
			// kernel once idle; wait for that, so the streams' first bytes
			// take the kernel path however busy the machine is.
			p.waitKernel(t)
			up := testenv.Stream{Seed: 1, Size: 256 << 20, MaxChunk: 200 << 10}
			down := testenv.Stream{Seed: 2, Size: 256 << 20, MaxChunk: 200 << 10}
			p.streamBothWays(t, up, down)
			p.waitDone(t)
			if err := p.pair.Err(); err != nil {
				t.Fatal(err)
			}
			ab, ba := p.pair.Stats()
			t.Logf("a->b %+v, b->a %+v", ab, ba)
			if ab.Bytes != uint64(up.Size) || ba.Bytes != uint64(down.Size) {
				t.Fatalf("stats count %d and %d bytes, want %d and %d", ab.Bytes, ba.Bytes, up.Size, down.Size)
			}
			if ab.Kernel == 0 || ba.Kernel == 0 {
				t.Fatalf("the kernel forwarded nothing (a->b %d, b->a %d bytes)", ab.Kernel, ba.Kernel)
			}
		})
	}
}

// TestHalfCloseEachWay: a FIN from either end reaches the other after every
// byte, while the other direction keeps working.
func TestHalfCloseEachWay(t *testing.T) {
	s := mustSplicer(t, splice.Options{})
	ns := testenv.MustNetNS(t)
	for _, clientFirst := range []bool{true, false} {
		p := mustProxied(t, s, ns, "tcp4", "127.0.0.1:0")
		first, second := p.client, p.server
		if !clientFirst {
			first, second = second, first
		}
		// The FIN must meet the kernel path, not user space: bytes
		// first, read to the end, then FIN once the kernel forwards.
		a := testenv.Stream{Seed: 3, Size: 1 << 20, MaxChunk: 4096}
		if err := a.Write(first); err != nil {
			t.Fatal(err)
		}
		if err := a.Check(second, false); err != nil {
			t.Fatalf("%v (pair: %v)", err, p.pair.Err())
		}
		p.waitKernel(t)
		tail := strings.Repeat("through the kernel ", 1000)
		if _, err := io.WriteString(first, tail); err != nil {
			t.Fatal(err)
		}
		got := make([]byte, len(tail))
		if _, err := io.ReadFull(second, got); err != nil || string(got) != tail {
			t.Fatalf("after the hand-back: %v", err)
		}
		dir := func() splice.Stats {
			ab, ba := p.pair.Stats()
			if clientFirst {
				return ab
			}
			return ba
		}
		if st := dir(); st.Kernel < uint64(len(tail)) || !st.KernelNow {
			t.Fatalf("the bytes before the FIN did not go through the kernel: %+v", st)
		}
		first.CloseWrite()
		second.SetReadDeadline(time.Now().Add(5 * time.Second))
		if rest, err := io.ReadAll(second); err != nil || len(rest) != 0 {
			t.Fatalf("after the FIN the far end read %d more bytes, %v; want EOF", len(rest), err)
		}
		// The half-closed side still receives.
		b := testenv.Stream{Seed: 4, Size: 1 << 20, MaxChunk: 4096}
		if err := b.WriteAndClose(second); err != nil {
			t.Fatal(err)
		}
		if err := b.Check(first, true); err != nil {
			t.Fatal(err)
		}
		p.waitDone(t)
		if err := p.pair.Err(); err != nil {
			t.Fatal(err)
		}
	}
}

// TestResetPropagates: an RST from either end resets the other end too.
func TestResetPropagates(t *testing.T) {
	s := mustSplicer(t, splice.Options{})
	ns := testenv.MustNetNS(t)
	for _, clientResets := range []bool{true, false} {
		p := mustProxied(t, s, ns, "tcp4", "127.0.0.1:0")
		resetter, other := p.client, p.server
		if !clientResets {
			resetter, other = other, resetter
		}
		if _, err := resetter.Write([]byte("hello")); err != nil {
			t.Fatal(err)
		}
		buf := make([]byte, 5)
		if _, err := io.ReadFull(other, buf); err != nil {
			t.Fatal(err)
		}
		// The RST must meet the kernel path, not user space.
		p.waitKernel(t)
		resetter.SetLinger(0)
		resetter.Close()
		other.SetReadDeadline(time.Now().Add(5 * time.Second))
		_, err := other.Read(buf)
		if !errors.Is(err, syscall.ECONNRESET) {
			t.Fatalf("the far end read %v, want ECONNRESET", err)
		}
		p.waitDone(t)
		if p.pair.Err() == nil {
			t.Fatal("pair ended without an error after a reset")
		}
	}
}

// TestEOFWaitsForPassedBytes: EOF can reach user space before bytes the
// verdict passed just ahead of the FIN (they wait in the psock's backlog
// while it sends for the other direction). The count of bytes seen is made
// to claim bytes that have not arrived: the FIN must wait for them, go on
// once the count agrees, and if they never come both ends are reset: a
// clean FIN would end the stream short without anyone knowing.
func TestEOFWaitsForPassedBytes(t *testing.T) {
	testenv.RequireRoot(t)
	s := mustSplicer(t, splice.Options{LostAfter: time.Second})
	ns := testenv.MustNetNS(t)
	start := func(t *testing.T) *proxied {
		p := mustProxied(t, s, ns, "tcp4", "127.0.0.1:0")
		if _, err := p.client.Write([]byte("hello")); err != nil {
			t.Fatal(err)
		}
		if _, err := io.ReadFull(p.server, make([]byte, 5)); err != nil {
			t.Fatal(err)
		}
		p.waitKernel(t)
		p.pair.ClaimSeen(100)
		p.client.CloseWrite()
		return p
	}
	t.Run("late", func(t *testing.T) {
		p := start(t)
		p.server.SetReadDeadline(time.Now().Add(300 * time.Millisecond))
		if n, err := p.server.Read(make([]byte, 1)); !errors.Is(err, os.ErrDeadlineExceeded) {
			t.Fatalf("with bytes missing the far end read %d bytes, %v; want nothing yet", n, err)
		}
		p.pair.ClaimSeen(-100) // they came
		p.server.SetReadDeadline(time.Now().Add(5 * time.Second))
		if rest, err := io.ReadAll(p.server); err != nil || len(rest) != 0 {
			t.Fatalf("read %d bytes, %v; want EOF", len(rest), err)
		}
		p.server.Close()
		p.waitDone(t)
		if err := p.pair.Err(); err != nil {
			t.Fatal(err)
		}
	})
	t.Run("never", func(t *testing.T) {
		p := start(t)
		for _, c := range []*net.TCPConn{p.server, p.client} {
			c.SetReadDeadline(time.Now().Add(10 * time.Second))
			if _, err := io.ReadAll(c); !errors.Is(err, syscall.ECONNRESET) {
				t.Fatalf("%v read %v, want a reset", c.LocalAddr(), err)
			}
		}
		p.waitDone(t)
		if err := p.pair.Err(); err == nil || !strings.Contains(err.Error(), "never arrived") {
			t.Fatalf("pair error %v, want the missing bytes named", err)
		}
	})
}

// TestHandOffAfterFirstBytes: the proxy reads the first bytes itself, writes
// its own header and those bytes to the server, then joins while the client
// keeps sending; the server sees header, then the whole stream in order.
func TestHandOffAfterFirstBytes(t *testing.T) {
	s := mustSplicer(t, splice.Options{})
	ns := testenv.MustNetNS(t)
	header := []byte("PROXY TCP4 192.0.2.1 192.0.2.2 1000 2000\r\n")
	for _, first := range []int{1, 1000, 100000} {
		p := mustSockets(t, ns, "tcp4", "127.0.0.1:0")
		stream := testenv.Stream{Seed: uint64(first), Size: 16 << 20, MaxChunk: 3000}
		sent := make(chan error, 1)
		go func() { sent <- stream.WriteAndClose(p.client) }()

		buf := make([]byte, first)
		if _, err := io.ReadFull(p.front, buf); err != nil {
			t.Fatal(err)
		}
		if _, err := p.back.Write(append(append([]byte{}, header...), buf...)); err != nil {
			t.Fatal(err)
		}
		p.join(t, s)

		got := make([]byte, len(header))
		if _, err := io.ReadFull(p.server, got); err != nil || string(got) != string(header) {
			t.Fatalf("header: %q, %v", got, err)
		}
		if err := stream.Check(p.server, true); err != nil {
			t.Fatalf("first %d bytes read by the proxy: %v", first, err)
		}
		if err := <-sent; err != nil {
			t.Fatal(err)
		}
		p.server.CloseWrite()
		p.waitDone(t)
	}
}

// TestSlowReaderHoldsSender: a server that stops reading stops the client,
// as through a plain proxy: a non-blocking writer gets EAGAIN once the
// buffers along the way are full, and every byte arrives once the server
// reads again. Without flow control the kernel would queue without bound.
func TestSlowReaderHoldsSender(t *testing.T) {
	s := mustSplicer(t, splice.Options{})
	p := mustProxied(t, s, testenv.MustNetNS(t), "tcp4", "127.0.0.1:0")
	const limit = 256 << 20
	stream := testenv.Stream{Seed: 5, Size: limit, MaxChunk: 64 << 10}
	n, err := stream.WriteUntilStalled(p.client, 500*time.Millisecond)
	if !errors.Is(err, testenv.ErrStalled) {
		t.Fatalf("the writer was never held back: %d bytes accepted (%v)", n, err)
	}
	t.Logf("accepted %d bytes before the writer was held", n)
	if n > 64<<20 {
		t.Fatalf("accepted %d bytes with nobody reading; plain TCP through a proxy holds about 10-20 MiB", n)
	}
	// Everything accepted arrives, in order.
	accepted := testenv.Stream{Seed: 5, Size: n, MaxChunk: 64 << 10}
	p.client.CloseWrite()
	if err := accepted.Check(p.server, true); err != nil {
		t.Fatal(err)
	}
	ab, _ := p.pair.Stats()
	t.Logf("a->b %+v", ab)
	p.server.CloseWrite()
	p.waitDone(t)
}

// TestDropRepeated: the bytes the verdict marks as repeats are cut out of
// what user space reads, also when a repeat spans two reads.
func TestDropRepeated(t *testing.T) {
	in := []byte("0123456789")
	for _, c := range []struct {
		name    string
		pos     uint64
		repeats [][2]uint64
		want    string
		left    int
	}{
		{"none", 100, nil, "0123456789", 0},
		{"head", 100, [][2]uint64{{100, 3}}, "3456789", 0},
		{"middle and tail", 100, [][2]uint64{{102, 2}, {108, 2}}, "014567", 0},
		{"runs past the read", 100, [][2]uint64{{107, 5}}, "0123456", 1},
		{"rest of a repeat from the last read", 105, [][2]uint64{{103, 4}}, "23456789", 0},
		{"later read", 100, [][2]uint64{{200, 4}}, "0123456789", 1},
		{"all", 100, [][2]uint64{{100, 10}}, "", 0},
	} {
		b := append([]byte{}, in...)
		got, left := splice.DropRepeated(b, c.pos, c.repeats...)
		if string(got) != c.want || left != c.left {
			t.Errorf("%s: kept %q with %d repeats pending, want %q and %d", c.name, got, left, c.want, c.left)
		}
	}
}

// TestJoinAfterFIN: a socket that already received FIN cannot join a
// sockmap; the pair is then copied in user space, with the same result.
func TestJoinAfterFIN(t *testing.T) {
	s := mustSplicer(t, splice.Options{})
	p := mustSockets(t, testenv.MustNetNS(t), "tcp4", "127.0.0.1:0")
	io.WriteString(p.server, "bye")
	p.server.CloseWrite()
	testenv.WaitTCPState(t, p.back, unix.BPF_TCP_CLOSE_WAIT) // the FIN arrived
	p.join(t, s)
	if p.pair.InKernel() {
		t.Fatal("a socket in CLOSE_WAIT joined the kernel map")
	}
	stream := testenv.Stream{Seed: 9, Size: 4 << 20, MaxChunk: 10000}
	errs := make(chan error, 1)
	go func() { errs <- stream.WriteAndClose(p.client) }()
	if got, err := io.ReadAll(p.client); err != nil || string(got) != "bye" {
		t.Fatalf("client read %q, %v", got, err)
	}
	if err := stream.Check(p.server, true); err != nil {
		t.Fatal(err)
	}
	if err := <-errs; err != nil {
		t.Fatal(err)
	}
	p.waitDone(t)
	if err := p.pair.Err(); err != nil {
		t.Fatal(err)
	}
}

// TestHandOverMidStream: a Splicer is frozen in the middle of two streams,
// its objects and sockets move to a new one (as descriptors passed to a new
// process would), and the streams finish intact, with FIN after the last
// byte, ten times over.
func TestHandOverMidStream(t *testing.T) {
	s := mustSplicer(t, splice.Options{})
	p := mustProxied(t, s, testenv.MustNetNS(t), "tcp4", "127.0.0.1:0")
	up := testenv.Stream{Seed: 71, Size: 256 << 20, MaxChunk: 100 << 10}
	down := testenv.Stream{Seed: 72, Size: 64 << 20, MaxChunk: 10 << 10}
	wait := testenv.BothWays(p.client, p.server, up, down)

	var pair *splice.Pair
	for range 10 {
		time.Sleep(10 * time.Millisecond)
		objs, states := s.Freeze()
		if len(states) != 1 {
			t.Fatalf("froze %d pairs, want 1", len(states))
		}
		var dup splice.Objects
		copy(dup[:], dupFDs(t, objs[:]...))
		states[0].A, states[0].B = dupConn(t, states[0].A), dupConn(t, states[0].B)
		s.Release()
		next, pairs, err := splice.Resume(dup, splice.Options{}, states)
		if err != nil || len(pairs) != 1 {
			t.Fatalf("resume: %d pairs, %v", len(pairs), err)
		}
		next.Thaw()
		s, pair = next, pairs[0]
		t.Cleanup(func() { s.Close() })
	}
	if err := wait(); err != nil {
		t.Fatal(err)
	}
	select {
	case <-pair.Done():
	case <-time.After(10 * time.Second):
		t.Fatal("pair did not end")
	}
	if err := pair.Err(); err != nil {
		t.Fatal(err)
	}
	ab, ba := pair.Stats()
	if ab.Bytes != uint64(up.Size) || ba.Bytes != uint64(down.Size) {
		t.Fatalf("stats after hand-overs: %+v %+v", ab, ba)
	}
}

// TestSplice: the one-call form moves both streams and returns nil after
// FIN each way.
func TestSplice(t *testing.T) {
	testenv.RequireRoot(t)
	p := mustSockets(t, testenv.MustNetNS(t), "tcp6", "[::1]:0")
	done := make(chan error, 1)
	go func() { done <- splice.Splice(p.front, p.back) }()
	up := testenv.Stream{Seed: 91, Size: 8 << 20, MaxChunk: 50000}
	down := testenv.Stream{Seed: 92, Size: 8 << 20, MaxChunk: 50000}
	errs := make(chan error, 1)
	go func() { errs <- down.Through(p.server, p.client) }()
	if err := up.Through(p.client, p.server); err != nil {
		t.Fatal(err)
	}
	if err := <-errs; err != nil {
		t.Fatal(err)
	}
	select {
	case err := <-done:
		if err != nil {
			t.Fatal(err)
		}
	case <-time.After(10 * time.Second):
		t.Fatal("Splice did not return")
	}
}

// TestCloseAfterFailedHandOver: a Splicer frozen for a hand-over that never
// happened still closes, resetting its pairs.
func TestCloseAfterFailedHandOver(t *testing.T) {
	testenv.RequireRoot(t)
	s, err := splice.New(splice.Options{})
	if err != nil {
		t.Fatal(err)
	}
	p := mustProxied(t, s, testenv.MustNetNS(t), "tcp4", "127.0.0.1:0")
	s.Freeze()
	done := make(chan error, 1)
	go func() { done <- s.Close() }()
	select {
	case err := <-done:
		if err != nil {
			t.Fatal(err)
		}
	case <-time.After(5 * time.Second):
		t.Fatal("Close hung on frozen pairs")
	}
	p.client.SetReadDeadline(time.Now().Add(5 * time.Second))
	if _, err := p.client.Read(make([]byte, 1)); !errors.Is(err, syscall.ECONNRESET) {
		t.Fatalf("client read %v, want a reset", err)
	}
}

// dupFDs duplicates descriptors, as passing them to another process would.
func dupFDs(t *testing.T, fds ...int) []int {
	t.Helper()
	out := make([]int, len(fds))
	for i, fd := range fds {
		nfd, err := unix.Dup(fd)
		if err != nil {
			t.Fatal(err)
		}
		out[i] = nfd
	}
	return out
}

// dupConn is a new connection on c's socket, as another process would get.
func dupConn[T net.Conn](t *testing.T, c T) T {
	t.Helper()
	f, err := any(c).(interface{ File() (*os.File, error) }).File()
	if err != nil {
		t.Fatal(err)
	}
	defer f.Close()
	nc, err := net.FileConn(f)
	if err != nil {
		t.Fatal(err)
	}
	return nc.(T)
}

// TestRetransmissionsThroughTheKernel: real losses make real
// retransmissions, some overlapping bytes already received (which a verdict
// must not forward twice). The client reaches the proxy over a veth whose
// queues drop (tbf with a small limit, both ways); both streams arrive
// intact, and the stats say how many retransmissions the verdict saw.
func TestRetransmissionsThroughTheKernel(t *testing.T) {
	s := mustSplicer(t, splice.Options{})
	a, b := testenv.MustNetNS(t), testenv.MustNetNS(t)
	testenv.Veth(t, a, b)
	for _, dev := range []struct {
		ns  *testenv.NetNS
		ifc string
	}{{a, "veth-a"}, {b, "veth-b"}} {
		// 200 Mbit/s with room for 16 KiB: a stream outruns it and loses
		// segments, as a congested link does, also on a machine so busy
		// that it sends at a fraction of its usual rate (at 1 Gbit/s a
		// loaded CI machine never filled the queue: no loss, no test).
		out, err := exec.Command("tc", "-n", dev.ns.Name, "qdisc", "add", "dev", dev.ifc, "root", "tbf", "rate", "200mbit", "burst", "16kb", "limit", "16kb").CombinedOutput()
		if err != nil {
			t.Fatalf("tc: %v: %s", err, out)
		}
	}
	p := &proxied{}
	p.client, p.front = testenv.ConnPair(t, "tcp4", testenv.Side{NS: b}, lab.VethIPv4B+":0", testenv.Side{NS: a}, lab.VethIPv4B+":0")
	p.back, p.server = testenv.ConnPair(t, "tcp4", testenv.Side{NS: b}, "127.0.0.1:0", testenv.Side{NS: b}, "127.0.0.1:0")
	p.join(t, s)
	p.waitKernel(t)
	retrans := func() uint32 {
		var n uint32
		for _, c := range []*net.TCPConn{p.client, p.front} {
			raw, _ := c.SyscallConn()
			raw.Control(func(fd uintptr) {
				if info, err := unix.GetsockoptTCPInfo(int(fd), unix.IPPROTO_TCP, unix.TCP_INFO); err == nil {
					n += info.Total_retrans
				}
			})
		}
		return n
	}
	up := testenv.Stream{Seed: 31, Size: 64 << 20, MaxChunk: 256 << 10}
	down := testenv.Stream{Seed: 32, Size: 64 << 20, MaxChunk: 256 << 10}
	p.streamBothWays(t, up, down)
	n := retrans()
	p.waitDone(t)
	ab, ba := p.pair.Stats()
	t.Logf("%d segments retransmitted; a->b %+v, b->a %+v", n, ab, ba)
	if n == 0 {
		t.Fatal("no segment was retransmitted: the lossy link is not lossy, and the test proves nothing")
	}
	if ab.Kernel == 0 {
		t.Fatalf("the kernel forwarded nothing of the lossy direction: %+v", ab)
	}
}

// A pair bound out of range is refused before anything is loaded, by the
// TCP and the UDP splicer alike.
func TestMaxPairsOutOfRange(t *testing.T) {
	for _, n := range []int{-1, 1<<20 + 1} {
		if s, err := splice.New(splice.Options{MaxPairs: n}); err == nil || !strings.Contains(err.Error(), "out of range") {
			if s != nil {
				s.Close()
			}
			t.Errorf("New with %d pairs: %v, want out of range", n, err)
		}
		if s, err := splice.NewUDP(splice.UDPOptions{MaxPairs: n}); err == nil || !strings.Contains(err.Error(), "out of range") {
			if s != nil {
				s.Close()
			}
			t.Errorf("NewUDP with %d pairs: %v, want out of range", n, err)
		}
	}
}
