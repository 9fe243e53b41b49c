package fanout_test

import (
	"bufio"
	"context"
	"encoding/binary"
	"errors"
	"fmt"
	"io"
	"net"
	"net/netip"
	"os"
	"os/exec"
	"path/filepath"
	"runtime"
	"strconv"
	"strings"
	"sync"
	"sync/atomic"
	"syscall"
	"testing"
	"time"

	"golang.org/x/sys/unix"

	"github.com/shunt-project/shunt/fanout"
	"github.com/shunt-project/shunt/host"
	"github.com/shunt-project/shunt/internal/testenv"
)

// onOneCPU keeps the calling goroutine on its thread and the thread on the
// CPU it runs on until the returned function is called.
func onOneCPU(t testing.TB) func() {
	runtime.LockOSThread()
	var was, one unix.CPUSet
	if err := unix.SchedGetaffinity(0, &was); err != nil {
		t.Fatal(err)
	}
	cpu, err := fanout.CurrentCPU()
	if err != nil {
		t.Fatal(err)
	}
	one.Set(cpu)
	if err := unix.SchedSetaffinity(0, &one); err != nil {
		t.Fatal(err)
	}
	return func() {
		unix.SchedSetaffinity(0, &was)
		runtime.UnlockOSThread()
	}
}

var allPaths = []fanout.Path{fanout.PathBatch, fanout.PathPerMessage, fanout.PathURing, fanout.PathKernel, fanout.PathZeroCopy}

// lab is a forwarder running in a namespace of its own.
type lab struct {
	t    *testing.T
	ns   *testenv.NetNS
	f    *fanout.Forwarder
	ctl  string
	stop func()
}

// mechanisms are what the forwarders a test makes use (the zero value:
// this kernel's newest); TestKernelPathAsOnOlderKernels sets them for the
// tests it runs.
var mechanisms host.Mechanisms

// useMechanisms makes the rest of t's forwarders use m.
func useMechanisms(t *testing.T, m host.Mechanisms) {
	old := mechanisms
	mechanisms = m
	t.Cleanup(func() { mechanisms = old })
}

func mustForwarder(t *testing.T, cfg fanout.Config) *lab {
	t.Helper()
	testenv.RequireRoot(t)
	return mustForwarderIn(t, testenv.MustNetNS(t), cfg)
}

func mustForwarderIn(t *testing.T, ns *testenv.NetNS, cfg fanout.Config) *lab {
	t.Helper()
	l := &lab{t: t, ns: ns, ctl: filepath.Join(t.TempDir(), "fanout.sock")}
	if !cfg.Source.IsValid() {
		cfg.Source = netip.MustParseAddrPort("127.0.0.1:0")
		cfg.Listen = netip.MustParseAddrPort("127.0.0.1:0")
	}
	cfg.Control = l.ctl
	cfg.Mechanisms = mechanisms
	var err error
	l.ns.Do(t, func() { l.f, err = fanout.New(cfg) })
	if err != nil {
		t.Fatal(err)
	}
	ctx, cancel := context.WithCancel(context.Background())
	done := make(chan error, 1)
	go func() { done <- l.f.Run(ctx) }()
	l.stop = func() {
		cancel()
		if err := <-done; err != nil {
			t.Error(err)
		}
		l.f.Close()
	}
	t.Cleanup(func() {
		if l.stop != nil {
			l.stop()
		}
	})
	return l
}

// subscribe connects a subscriber; the caller reads it.
func (l *lab) subscribe() *net.TCPConn {
	l.t.Helper()
	var c net.Conn
	var err error
	l.ns.Do(l.t, func() { c, err = net.Dial("tcp", l.f.ListenAddr().String()) })
	if err != nil {
		l.t.Fatal(err)
	}
	l.t.Cleanup(func() { c.Close() })
	return c.(*net.TCPConn)
}

func (l *lab) sender() *net.UDPConn {
	l.t.Helper()
	var c net.Conn
	var err error
	l.ns.Do(l.t, func() { c, err = net.Dial("udp", l.f.SourceAddr().String()) })
	if err != nil {
		l.t.Fatal(err)
	}
	l.t.Cleanup(func() { c.Close() })
	return c.(*net.UDPConn)
}

func (l *lab) stats() fanout.Stats {
	l.t.Helper()
	st, err := fanout.Query(l.ctl)
	if err != nil {
		l.t.Fatal(err)
	}
	return st
}

// waitSubscribers waits until the forwarder has accepted n subscribers.
func (l *lab) waitSubscribers(n int) {
	l.t.Helper()
	deadline := time.Now().Add(10 * time.Second)
	for l.stats().Totals.Subscribers != n {
		if time.Now().After(deadline) {
			l.t.Fatalf("forwarder has %d subscribers, want %d", l.stats().Totals.Subscribers, n)
		}
		time.Sleep(5 * time.Millisecond)
	}
}

// subscriberStats is what the forwarder counts for subscriber c.
func (l *lab) subscriberStats(c *net.TCPConn) fanout.SubscriberStats {
	l.t.Helper()
	for _, s := range l.stats().Subscribers {
		if s.Peer == c.LocalAddr().String() {
			return s
		}
	}
	l.t.Fatalf("the forwarder has no subscriber %s", c.LocalAddr())
	return fanout.SubscriberStats{}
}

// waitDrained waits until the forwarder holds nothing for subscriber c.
func (l *lab) waitDrained(c *net.TCPConn) {
	l.t.Helper()
	deadline := time.Now().Add(30 * time.Second)
	for {
		if l.subscriberStats(c).Queued == 0 {
			return
		}
		if time.Now().After(deadline) {
			l.t.Fatalf("subscriber %s still has bytes queued after 30 s", c.LocalAddr())
		}
		time.Sleep(5 * time.Millisecond)
	}
}

// message i: its sequence number, then bytes derived from it, 16..200 long.
func message(i uint64, size int) []byte {
	if size == 0 {
		size = 16 + int(i*7919%185)
	}
	b := make([]byte, size)
	binary.BigEndian.PutUint64(b, i)
	for j := 8; j < size; j++ {
		b[j] = byte(i + uint64(j))
	}
	return b
}

// send sends messages [from, to), never more than 256 ahead of the
// forwarder. The source is UDP on loopback: a datagram waits in the sending
// CPU's backlog (1000 by default, shared with the subscribers' loopback
// traffic) until that CPU's softirq delivers it, and what does not fit is
// dropped before the forwarder sees it. It sends from one CPU: from two,
// datagrams could pass each other between the two backlogs.
func (l *lab) send(u *net.UDPConn, from, to uint64, size int) {
	l.t.Helper()
	defer onOneCPU(l.t)()
	base := l.stats().Totals.Received
	for i := from; i < to; i++ {
		if _, err := u.Write(message(i, size)); err != nil {
			l.t.Fatal(err)
		}
		if (i-from)%64 == 63 {
			for l.stats().Totals.Received+256 < base+(i-from) {
				time.Sleep(200 * time.Microsecond)
			}
		}
	}
}

// reader checks a u32-framed stream: consecutive messages from the first
// it sees, each intact. It returns how many it read, counting gap markers
// as the messages they stand for.
type result struct {
	first, n, lost uint64
	err            error
}

// readUntilLost reads until messages and losses add up to total.
func readUntilLost(r io.Reader, size int, total uint64) result {
	return readFramedUntil(r, size, func(res result) bool { return res.n+res.lost >= total })
}

func readFramed(r io.Reader, size int, until uint64) result {
	return readFramedUntil(r, size, func(res result) bool { return res.first+res.n+res.lost >= until && res.n > 0 })
}

func readFramedUntil(r io.Reader, size int, done func(result) bool) result {
	br := bufio.NewReaderSize(r, 1<<16)
	var res result
	next := uint64(0)
	started := false
	hdr := make([]byte, 4)
	for {
		if _, err := io.ReadFull(br, hdr); err != nil {
			res.err = err
			return res
		}
		n := binary.BigEndian.Uint32(hdr)
		if n == 0xffffffff {
			if _, err := io.ReadFull(br, hdr); err != nil {
				res.err = err
				return res
			}
			lost := uint64(binary.BigEndian.Uint32(hdr))
			res.lost += lost
			next += lost
			if done(res) {
				return res
			}
			continue
		}
		b := make([]byte, n)
		if _, err := io.ReadFull(br, b); err != nil {
			res.err = err
			return res
		}
		seq := binary.BigEndian.Uint64(b)
		if !started {
			started, res.first, next = true, seq, seq
		}
		if seq != next || string(b) != string(message(seq, size)) {
			res.err = fmt.Errorf("got message %d (%d bytes), want %d intact", seq, n, next)
			return res
		}
		next++
		res.n++
		if done(res) {
			return res
		}
	}
}

// Every subscriber gets every message from when it joined, in order and
// intact, while others join and leave; those present throughout get all.
func TestEveryMessageToEverySubscriber(t *testing.T) {
	for _, tc := range []struct {
		path fanout.Path
		subs int
		msgs uint64
	}{
		{fanout.PathBatch, 1000, 100_000},
		{fanout.PathPerMessage, 200, 20_000},
		{fanout.PathURing, 500, 50_000},
		{fanout.PathKernel, 200, 20_000},
		{fanout.PathZeroCopy, 1000, 100_000},
	} {
		t.Run(tc.path.String(), func(t *testing.T) {
			// A thousand subscribers with 8 MiB queues may pin gigabytes
			// (the 4 GiB guests of make test-kernels ran out; under -race one run
			// grew past 21 GB).
			if testing.Short() || raceEnabled || memTotal(t) < 8<<30 {
				tc.subs, tc.msgs = 50, 5_000
			}
			testEveryMessage(t, tc.path, tc.subs, tc.msgs)
		})
	}
}

func testEveryMessage(t *testing.T, path fanout.Path, subs int, msgs uint64) {
	l := mustForwarder(t, fanout.Config{Framing: fanout.FramingU32, Queue: 8 << 20, Path: path})
	u := l.sender()

	type sub struct {
		c     *net.TCPConn
		late  bool
		leave bool
		res   result
	}
	all := make([]*sub, 0, subs)
	var wg sync.WaitGroup
	start := func(s *sub) {
		wg.Add(1)
		go func() {
			defer wg.Done()
			s.c.SetReadDeadline(time.Now().Add(3 * time.Minute))
			if s.leave {
				s.res = readFramed(io.LimitReader(s.c, 50_000), 0, msgs)
				s.c.Close()
				return
			}
			s.res = readFramed(s.c, 0, msgs)
		}()
	}
	for i := 0; i < subs*9/10; i++ {
		s := &sub{c: l.subscribe(), leave: i%9 == 0}
		all = append(all, s)
		start(s)
	}
	l.waitSubscribers(len(all))
	l.send(u, 0, msgs/2, 0)
	for i := len(all); i < subs; i++ {
		s := &sub{c: l.subscribe(), late: true}
		all = append(all, s)
		start(s)
	}
	l.send(u, msgs/2, msgs, 0)
	wg.Wait()

	full := 0
	for i, s := range all {
		switch {
		case s.leave:
			if s.res.err != nil && s.res.err != io.ErrUnexpectedEOF && s.res.err != io.EOF {
				t.Errorf("subscriber %d (left early): %v", i, s.res.err)
			}
		case s.late:
			if s.res.err != nil || s.res.first+s.res.n != msgs || s.res.first > msgs/2+1000 {
				t.Errorf("late subscriber %d: first %d, %d messages, %v", i, s.res.first, s.res.n, s.res.err)
			}
		default:
			if s.res.err != nil || s.res.first != 0 || s.res.n != msgs || s.res.lost != 0 {
				t.Errorf("subscriber %d: first %d, %d messages, %d lost, %v", i, s.res.first, s.res.n, s.res.lost, s.res.err)
			} else {
				full++
			}
		}
	}
	st := l.stats()
	if st.Totals.Received != msgs || st.Totals.Connected != uint64(subs) {
		t.Errorf("totals %+v: want %d received, %d connected", st.Totals, msgs, subs)
	}
	t.Logf("%d subscribers got all %d messages; %+v", full, msgs, st.Totals)
	if path == fanout.PathKernel {
		// Every message went through the loopback queue and was counted
		// out of it (or the relay would have waited a second a batch).
		if relayed := l.f.KernelRelayed(); relayed != st.Totals.Received {
			t.Errorf("the pacer counted %d messages out of the loopback queue, want %d", relayed, st.Totals.Received)
		}
	}
	if t.Failed() {
		// Where a message may have gone missing before the forwarder: UDP's
		// and the loopback queue's drops in this namespace and machine.
		l.ns.Do(t, func() {
			snmp, _ := os.ReadFile("/proc/thread-self/net/snmp")
			softnet, _ := os.ReadFile("/proc/net/softnet_stat")
			t.Logf("/proc/net/snmp:\n%s\n/proc/net/softnet_stat (the second column counts drops):\n%s", snmp, softnet)
		})
	}
}

// A subscriber that stops reading loses messages past its queue bound,
// counted exactly (gap markers add up to the stats), and the others get
// everything.
func TestSlowSubscriberDropsAndOthersDoNot(t *testing.T) {
	for _, p := range allPaths {
		t.Run(p.String(), func(t *testing.T) { testSlowSubscriberDrops(t, p) })
	}
}

func testSlowSubscriberDrops(t *testing.T, path fanout.Path) {
	// The bound leaves a reader slowed by a busy machine (CI tests
	// packages in parallel) room not to be taken for the stalled one,
	// which passes it long before the 20 MB are sent.
	const msgs, size, queue = 20_000, 1000, 4 << 20
	l := mustForwarder(t, fanout.Config{Framing: fanout.FramingU32, Queue: queue, Path: path})
	u := l.sender()
	slow := l.subscribe()
	slow.SetReadBuffer(64 << 10)
	var wg sync.WaitGroup
	fast := make([]result, 3)
	got := make([]*atomic.Int64, len(fast))
	for i := range fast {
		got[i] = new(atomic.Int64)
		c := l.subscribe()
		wg.Add(1)
		go func() {
			defer wg.Done()
			c.SetReadDeadline(time.Now().Add(time.Minute))
			fast[i] = readFramed(countingReader{c, got[i]}, size, msgs)
		}()
	}
	l.waitSubscribers(4)
	l.sendPaced(u, msgs, size, got...)
	wg.Wait()
	dropped := l.checkIsolated(fast, msgs, slow)
	// Now read what the slow one was given: with its gap markers it must
	// account for every message. The user-space paths send the last marker
	// as soon as the queue drained; the kernel path puts it in front of the
	// next message, so one more is sent there.
	total := uint64(msgs)
	if path == fanout.PathKernel {
		total++
	}
	slow.SetReadDeadline(time.Now().Add(time.Minute))
	var r result
	read := make(chan struct{})
	go func() {
		r = readUntilLost(slow, size, total)
		close(read)
	}()
	if path == fanout.PathKernel {
		l.waitDrained(slow)
		l.send(u, msgs, msgs+1, size)
	}
	<-read
	if r.err != nil || r.first != 0 || r.n+r.lost != total || r.lost != dropped {
		t.Errorf("slow subscriber: %d read + %d in gap markers, stats say %d dropped, %v; want %d in all", r.n, r.lost, dropped, r.err, total)
	}
}

// countingReader counts the bytes read through it.
type countingReader struct {
	r io.Reader
	n *atomic.Int64
}

func (c countingReader) Read(b []byte) (int, error) {
	n, err := c.r.Read(b)
	c.n.Add(int64(n))
	return n, err
}

// checkIsolated checks that every reading subscriber got all msgs messages
// and that the stalled one lost some (else its queue never filled and the
// test proved nothing); it returns how many it lost.
func (l *lab) checkIsolated(readers []result, msgs uint64, stalled *net.TCPConn) uint64 {
	l.t.Helper()
	for i, r := range readers {
		if r.err != nil || r.n != msgs || r.lost != 0 {
			l.t.Errorf("reading subscriber %d: %d messages, %d lost, %v", i, r.n, r.lost, r.err)
		}
	}
	var dropped uint64
	for _, s := range l.stats().Subscribers {
		if s.Peer == stalled.LocalAddr().String() {
			dropped = s.Dropped
		}
	}
	if dropped == 0 {
		l.t.Fatal("the subscriber that never reads lost nothing: the test did not fill its queue")
	}
	return dropped
}

// sendPaced sends msgs messages no further ahead of the reading subscribers
// (bytes read so far in read) than 1 MB, so that a busy machine (CI tests
// packages in parallel) cannot make one of them look as slow as a stalled
// one, which passes a 4 MiB bound after ~4,000 messages.
func (l *lab) sendPaced(u *net.UDPConn, msgs uint64, size int, read ...*atomic.Int64) {
	l.t.Helper()
	behind := func() int64 {
		least := read[0].Load()
		for _, r := range read[1:] {
			least = min(least, r.Load())
		}
		return least
	}
	for from := uint64(0); from < msgs; from += 500 {
		to := min(from+500, msgs)
		l.send(u, from, to, size)
		for deadline := time.Now().Add(30 * time.Second); behind()+1000*int64(size+4) < int64(to)*int64(size+4); {
			if time.Now().After(deadline) {
				l.t.Fatalf("a reading subscriber is stuck at %d bytes", behind())
			}
			time.Sleep(200 * time.Microsecond)
		}
	}
}

// With --slow disconnect the slow subscriber is cut off and counted; the
// others are not disturbed.
func TestSlowSubscriberDisconnected(t *testing.T) {
	for _, p := range allPaths {
		t.Run(p.String(), func(t *testing.T) { testSlowSubscriberDisconnected(t, p) })
	}
}

func testSlowSubscriberDisconnected(t *testing.T, path fanout.Path) {
	// The bound leaves a reader slowed by a busy machine (CI tests
	// packages in parallel) room not to be taken for the stalled one,
	// which passes it long before the 20 MB are sent.
	const msgs, size, queue = 20_000, 1000, 4 << 20
	l := mustForwarder(t, fanout.Config{Framing: fanout.FramingU32, Queue: queue, Slow: fanout.SlowDisconnect, Path: path})
	u := l.sender()
	slow := l.subscribe()
	slow.SetReadBuffer(64 << 10)
	c := l.subscribe()
	var r result
	var got atomic.Int64 // bytes the reading subscriber has read
	done := make(chan struct{})
	go func() {
		c.SetReadDeadline(time.Now().Add(time.Minute))
		r = readFramed(countingReader{c, &got}, size, msgs)
		close(done)
	}()
	l.waitSubscribers(2)
	l.sendPaced(u, msgs, size, &got)
	<-done
	if r.err != nil || r.n != msgs {
		t.Errorf("other subscriber: %d messages, %v", r.n, r.err)
	}
	st := l.stats()
	if st.Totals.SlowDropped != 1 || st.Totals.Subscribers != 1 {
		t.Errorf("totals %+v: want the slow subscriber disconnected", st.Totals)
	}
	slow.SetReadDeadline(time.Now().Add(10 * time.Second))
	if _, err := io.Copy(io.Discard, slow); err != nil && !isReset(err) {
		t.Errorf("slow subscriber's stream ended with %v, want EOF or reset", err)
	}
}

func isReset(err error) bool {
	var oe *net.OpError
	return errors.As(err, &oe) && errors.Is(oe.Err, syscall.ECONNRESET)
}

// Subscribers that reset or half-close, a source that stops and restarts,
// and datagrams of the largest size: nothing breaks, nothing leaks.
func TestUnrulyPeers(t *testing.T) {
	for _, p := range allPaths {
		t.Run(p.String(), func(t *testing.T) { testUnrulyPeers(t, p) })
	}
}

func testUnrulyPeers(t *testing.T, path fanout.Path) {
	testenv.RequireRoot(t)
	ns := testenv.MustNetNS(t)
	fdsBefore := openFDs(t)
	l := mustForwarderIn(t, ns, fanout.Config{Framing: fanout.FramingU16, Path: path})
	reset := l.subscribe()
	half := l.subscribe()
	l.waitSubscribers(2)
	reset.SetLinger(0)
	reset.Close()
	half.CloseWrite()
	l.waitSubscribers(1)

	// The largest UDP datagram over IPv4, from one source, then another.
	big := make([]byte, 65507)
	for i := range big {
		big[i] = byte(i)
	}
	u := l.sender()
	u.SetWriteBuffer(1 << 20)
	if _, err := u.Write(big); err != nil {
		t.Fatal(err)
	}
	u.Close()
	u2 := l.sender()
	if _, err := u2.Write([]byte("again")); err != nil {
		t.Fatal(err)
	}
	half.SetReadDeadline(time.Now().Add(10 * time.Second))
	for _, want := range [][]byte{big, []byte("again")} {
		var hdr [2]byte
		if _, err := io.ReadFull(half, hdr[:]); err != nil {
			t.Fatal(err)
		}
		got := make([]byte, binary.BigEndian.Uint16(hdr[:]))
		if _, err := io.ReadFull(half, got); err != nil || string(got) != string(want) {
			t.Fatalf("half-closed subscriber got %d bytes (%v), want %d intact", len(got), err, len(want))
		}
	}
	half.Close()
	u2.Close()
	l.stop()
	l.stop = nil
	expectFDs(t, fdsBefore)
}

// fdTargets says what each open descriptor is.
func fdTargets(t *testing.T) []string {
	ents, err := os.ReadDir("/proc/self/fd")
	if err != nil {
		t.Fatal(err)
	}
	var out []string
	for _, e := range ents {
		target, _ := os.Readlink("/proc/self/fd/" + e.Name())
		out = append(out, e.Name()+"->"+target)
	}
	return out
}

func openFDs(t *testing.T) int {
	ents, err := os.ReadDir("/proc/self/fd")
	if err != nil {
		t.Fatal(err)
	}
	return len(ents)
}

func TestBadConfig(t *testing.T) {
	for _, tc := range []struct {
		cfg  fanout.Config
		want string
	}{
		{fanout.Config{Source: netip.MustParseAddrPort("127.0.0.1:0"), Listen: netip.MustParseAddrPort("127.0.0.1:0"), Queue: 1000}, "below one datagram"},
		{fanout.Config{Source: netip.MustParseAddrPort("192.0.2.1:5000"), Listen: netip.MustParseAddrPort("127.0.0.1:0")}, "source udp://192.0.2.1:5000"},
	} {
		if _, err := fanout.New(tc.cfg); err == nil || !strings.Contains(err.Error(), tc.want) {
			t.Errorf("New(%+v): %v, want %q", tc.cfg, err, tc.want)
		}
	}
	for _, s := range []string{"127.0.0.1:5000", "tcp://127.0.0.1:5000", "udp://localhost:5000", "udp://127.0.0.1"} {
		if _, err := fanout.ParseEndpoint("udp", s); err == nil {
			t.Errorf("ParseEndpoint(udp, %q) accepted it", s)
		}
	}
}

// The kernel path needs loopback (its group lives there) and says so.
func TestKernelPathNeedsLoopback(t *testing.T) {
	testenv.RequireRoot(t)
	ns := testenv.MustNetNS(t)
	if out, err := exec.Command("ip", "-n", ns.Name, "link", "set", "lo", "down").CombinedOutput(); err != nil {
		t.Fatalf("ip link set lo down: %v: %s", err, out)
	}
	var err error
	ns.Do(t, func() {
		var f *fanout.Forwarder
		f, err = fanout.New(fanout.Config{Path: fanout.PathKernel, Source: netip.MustParseAddrPort("0.0.0.0:0"), Listen: netip.MustParseAddrPort("0.0.0.0:0")})
		if err == nil {
			f.Close()
		}
	})
	if err == nil || !strings.Contains(err.Error(), "ip link set lo up") {
		t.Errorf("New with loopback down: %v, want a hint to bring lo up", err)
	}
}

// IPv6 source and listener, u16 framing, every path.
func TestIPv6(t *testing.T) {
	for _, p := range allPaths {
		t.Run(p.String(), func(t *testing.T) {
			testenv.RequireRoot(t)
			l := mustForwarder(t, fanout.Config{Framing: fanout.FramingU16, Path: p,
				Source: netip.MustParseAddrPort("[::1]:0"), Listen: netip.MustParseAddrPort("[::1]:0")})
			subs := []*net.TCPConn{l.subscribe(), l.subscribe()}
			l.waitSubscribers(2)
			u := l.sender()
			for _, m := range []string{"first", "second"} {
				if _, err := u.Write([]byte(m)); err != nil {
					t.Fatal(err)
				}
			}
			for _, c := range subs {
				c.SetReadDeadline(time.Now().Add(5 * time.Second))
				got := make([]byte, 2+5+2+6)
				if _, err := io.ReadFull(c, got); err != nil || string(got) != "\x00\x05first\x00\x06second" {
					t.Errorf("subscriber %s read %q, %v", c.LocalAddr(), got, err)
				}
			}
		})
	}
}

// A stats client that connects and never reads must not hold up delivery:
// the snapshot (here larger than a unix socket buffer) is written beside
// the relay loop.
func TestStatsReaderDoesNotBlockDelivery(t *testing.T) {
	l := mustForwarder(t, fanout.Config{Framing: fanout.FramingU32})
	reader := l.subscribe()
	for i := 0; i < 1500; i++ {
		l.subscribe()
	}
	l.waitSubscribers(1501)
	stuck, err := net.Dial("unix", l.ctl)
	if err != nil {
		t.Fatal(err)
	}
	defer stuck.Close()
	time.Sleep(50 * time.Millisecond) // let the loop accept it
	u := l.sender()
	start := time.Now()
	if _, err := u.Write(message(0, 0)); err != nil {
		t.Fatal(err)
	}
	reader.SetReadDeadline(time.Now().Add(5 * time.Second))
	r := readFramed(reader, 0, 1)
	// Generous against the usual ~1 ms, for a busy machine; a loop blocked
	// on the stats client would take its full 5 s send timeout.
	if r.err != nil || r.n != 1 || time.Since(start) > 2500*time.Millisecond {
		t.Errorf("message took %v (%v) with a stats client not reading", time.Since(start), r.err)
	}
}

// The kernel path keeps the kernel memory a stalled subscriber pins under
// its bound: redirected skbs wait in a queue that nothing else limits or
// counts. Measured as sk_buffs in the slab (system-wide, so with a wide
// margin); the same run with an enormous bound shows that the measure sees
// the queue.
func TestKernelPathBacklogBounded(t *testing.T) {
	const msgs, size = 200_000, 100
	grow := func(queue int) (skbs int, dropped uint64) {
		l := mustForwarder(t, fanout.Config{Framing: fanout.FramingU32, Queue: queue, Path: fanout.PathKernel})
		stalled := l.subscribe()
		stalled.SetReadBuffer(4 << 10)
		l.waitSubscribers(1)
		u := l.sender()
		before := slabObjects(t, "skbuff_head_cache")
		l.send(u, 0, msgs, size)
		time.Sleep(200 * time.Millisecond) // let the psock worker settle
		skbs = slabObjects(t, "skbuff_head_cache") - before
		dropped = l.stats().Subscribers[0].Dropped
		l.stop()
		l.stop = nil
		return skbs, dropped
	}
	unbounded, lost := grow(1 << 30)
	// What the socket's send buffer takes is coalesced into few skbs; the
	// rest waits one skb per message.
	if unbounded < msgs/2 || lost != 0 {
		t.Fatalf("with a 1 GiB bound: %d more sk_buffs, %d dropped; want over %d and none dropped (the measure is blind)", unbounded, lost, msgs/2)
	}
	// Packages tested beside this one add their own sk_buffs to the
	// system-wide count (7,545 once in CI against ~300 alone): a bound that
	// holds shows under the limit in one of three runs, a broken one in none.
	bounded, lost := grow(256 << 10)
	for try := 1; try < 3 && bounded > 5000; try++ {
		t.Logf("with a 256 KiB bound: %d more sk_buffs (run %d), measuring again", bounded, try)
		bounded, lost = grow(256 << 10)
	}
	if bounded > 5000 || lost == 0 {
		t.Errorf("with a 256 KiB bound: %d more sk_buffs, %d dropped; want under 5000 and some dropped", bounded, lost)
	}
	t.Logf("sk_buffs pinned by a stalled subscriber after %d messages: %d with a 1 GiB bound, %d with 256 KiB", msgs, unbounded, bounded)
}

// slabObjects reads the active objects of one slab cache.
func slabObjects(t *testing.T, cache string) int {
	t.Helper()
	b, err := os.ReadFile("/proc/slabinfo")
	if err != nil {
		t.Fatal(err)
	}
	for _, line := range strings.Split(string(b), "\n") {
		f := strings.Fields(line)
		if len(f) > 1 && f[0] == cache {
			n, err := strconv.Atoi(f[1])
			if err != nil {
				t.Fatal(err)
			}
			return n
		}
	}
	t.Fatalf("no slab cache %s in /proc/slabinfo", cache)
	return 0
}

// Subscribers that come and go through the kernel path leave no map entry
// and no descriptor behind.
func TestKernelPathNoLeak(t *testing.T) {
	testenv.RequireRoot(t)
	ns := testenv.MustNetNS(t)
	fdsBefore := openFDs(t)
	l := mustForwarderIn(t, ns, fanout.Config{Framing: fanout.FramingU32, Path: fanout.PathKernel})
	u := l.sender()
	for round := 0; round < 3; round++ {
		var conns []*net.TCPConn
		for i := 0; i < 200; i++ {
			conns = append(conns, l.subscribe())
		}
		l.waitSubscribers(200)
		l.send(u, 0, 100, 0)
		for i, c := range conns {
			c.SetReadDeadline(time.Now().Add(10 * time.Second))
			if r := readFramed(c, 0, 100); r.err != nil || r.n != 100 {
				feeds, targets, cookies, err := l.f.KernelMapEntries()
				t.Fatalf("round %d, subscriber %d: %d messages, %v; the forwarder's count: %+v, totals %+v; in the maps: %d feeds, %d targets, %d cookies (%v)",
					round, i, r.n, r.err, l.subscriberStats(c), l.stats().Totals, feeds, targets, cookies, err)
			}
			if i%2 == 0 {
				c.SetLinger(0) // reset
			}
			c.Close()
		}
		// A subscriber that closed (FIN) looks half-closed until the
		// next message meets its reset.
		l.send(u, 100, 101, 0)
		l.waitSubscribers(0)
		feeds, targets, cookies, err := l.f.KernelMapEntries()
		if err != nil || feeds+targets+cookies != 0 {
			t.Fatalf("round %d: %d feeds, %d targets, %d cookies left in the maps (%v)", round, feeds, targets, cookies, err)
		}
	}
	u.Close()
	l.stop()
	l.stop = nil
	expectFDs(t, fdsBefore)
}

// The zero-copy path really sends without copying (the kernel reports each
// send complete), lets go of every buffer once the subscribers have read,
// and says that loopback made the kernel copy after all.
func TestZeroCopyCompletions(t *testing.T) {
	const msgs = 10_000
	l := mustForwarder(t, fanout.Config{Framing: fanout.FramingU32, Path: fanout.PathZeroCopy})
	u := l.sender()
	var conns []*net.TCPConn
	for i := 0; i < 10; i++ {
		conns = append(conns, l.subscribe())
	}
	l.waitSubscribers(len(conns))
	res := make([]result, len(conns))
	var wg sync.WaitGroup
	for i, c := range conns {
		wg.Add(1)
		go func() {
			defer wg.Done()
			c.SetReadDeadline(time.Now().Add(time.Minute))
			res[i] = readFramed(c, 0, msgs)
		}()
	}
	l.send(u, 0, msgs, 0)
	wg.Wait()
	for i, r := range res {
		if r.err != nil || r.n != msgs || r.lost != 0 {
			t.Errorf("subscriber %d: %d messages, %d lost, %v", i, r.n, r.lost, r.err)
		}
	}
	deadline := time.Now().Add(10 * time.Second)
	var tot fanout.Totals
	for {
		tot = l.stats().Totals
		if tot.ZeroCopySends > 0 && tot.ZeroCopyDone == tot.ZeroCopySends {
			break
		}
		if time.Now().After(deadline) {
			t.Fatalf("zero-copy sends %d, completed %d: want all completed", tot.ZeroCopySends, tot.ZeroCopyDone)
		}
		time.Sleep(10 * time.Millisecond)
	}
	if tot.ZeroCopyCopied != tot.ZeroCopyDone {
		t.Errorf("over loopback the kernel copied %d of %d zero-copy sends; want all", tot.ZeroCopyCopied, tot.ZeroCopyDone)
	}
	t.Logf("%+v", tot)
}

// A subscriber that reads in fits and starts (small buffers, pauses) keeps
// getting everything sent to it or a gap marker for it, in order, on every
// path: the paths that stop and resume writing to it must always come back.
func TestStopAndGoSubscriber(t *testing.T) {
	for _, p := range allPaths {
		t.Run(p.String(), func(t *testing.T) {
			const msgs, size = 20_000, 500
			l := mustForwarder(t, fanout.Config{Framing: fanout.FramingU32, Queue: 128 << 10, Path: p})
			u := l.sender()
			c := l.subscribe()
			c.SetReadBuffer(64 << 10)
			l.waitSubscribers(1)
			var r result
			done := make(chan struct{})
			go func() {
				defer close(done)
				c.SetReadDeadline(time.Now().Add(time.Minute))
				pr := &pausingReader{r: c}
				r = readUntilLost(pr, size, msgs+1)
			}()
			l.send(u, 0, msgs, size)
			l.waitDrained(c)
			l.send(u, msgs, msgs+1, size) // carries the kernel path's last gap marker
			<-done
			if r.err != nil || r.first != 0 || r.n+r.lost != msgs+1 {
				t.Errorf("%d read + %d in gap markers, %v; want %d in all", r.n, r.lost, r.err, msgs+1)
			}
		})
	}
}

// pausingReader sleeps 2 ms after every 64 KiB it reads: slower than the
// sender, so its queue fills, empties and fills again.
type pausingReader struct {
	r    io.Reader
	read int
}

func (p *pausingReader) Read(b []byte) (int, error) {
	n, err := p.r.Read(b)
	p.read += n
	if p.read >= 64<<10 {
		p.read = 0
		time.Sleep(2 * time.Millisecond)
	}
	return n, err
}

// TestSlowSubscriberFreeRunningSender: isolation without help from the
// test. The sender keeps its own clock (5,000 messages/s, 10 MB in all),
// looking at no reader; a subscriber that never reads overflows its queue
// and loses messages, and the three that read lose none.
func TestSlowSubscriberFreeRunningSender(t *testing.T) {
	for _, p := range allPaths {
		t.Run(p.String(), func(t *testing.T) {
			const msgs, size, queue, rate = 10_000, 1000, 4 << 20, 5000
			l := mustForwarder(t, fanout.Config{Framing: fanout.FramingU32, Queue: queue, Path: p})
			u := l.sender()
			slow := l.subscribe()
			slow.SetReadBuffer(64 << 10)
			var wg sync.WaitGroup
			fast := make([]result, 3)
			for i := range fast {
				c := l.subscribe()
				wg.Add(1)
				go func() {
					defer wg.Done()
					c.SetReadDeadline(time.Now().Add(time.Minute))
					fast[i] = readFramed(c, size, msgs)
				}()
			}
			l.waitSubscribers(4)
			start := time.Now()
			for from := uint64(0); from < msgs; from += 50 {
				l.send(u, from, min(from+50, msgs), size)
				if ahead := time.Duration(from+50) * time.Second / rate; time.Since(start) < ahead {
					time.Sleep(ahead - time.Since(start))
				}
			}
			wg.Wait()
			dropped := l.checkIsolated(fast, msgs, slow)
			t.Logf("sent %d messages in %v; the stalled subscriber lost %d", msgs, time.Since(start).Round(time.Millisecond), dropped)
		})
	}
}

// memTotal is the machine's memory in bytes (/proc/meminfo).
func memTotal(t *testing.T) uint64 {
	t.Helper()
	b, err := os.ReadFile("/proc/meminfo")
	if err != nil {
		t.Fatal(err)
	}
	var kb uint64
	if _, err := fmt.Sscanf(string(b), "MemTotal: %d kB", &kb); err != nil {
		t.Fatalf("/proc/meminfo: %v", err)
	}
	return kb << 10
}

// expectFDs fails the test unless the process's descriptor count comes back
// to before within 3 s: other tests' goroutines may still be closing (or
// briefly opening) descriptors of their own.
func expectFDs(t *testing.T, before int) {
	t.Helper()
	after := openFDs(t)
	for deadline := time.Now().Add(3 * time.Second); after != before && time.Now().Before(deadline); after = openFDs(t) {
		time.Sleep(10 * time.Millisecond)
	}
	if after != before {
		t.Errorf("%d descriptors open after the forwarder closed, %d before: %v", after, before, fdTargets(t))
	}
}
