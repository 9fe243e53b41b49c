package fanout

import (
	"crypto/rand"
	"errors"
	"fmt"
	"net"
	"os"
	"strconv"
	"strings"
	"sync/atomic"
	"time"
	"unsafe"

	"github.com/cilium/ebpf"
	"golang.org/x/sys/unix"

	"github.com/shunt-project/shunt/host"
	"github.com/shunt-project/shunt/internal/sockmap"
)

// kernelPath is PathKernel's machinery (bpf/fanout.c). Each subscriber gets
// a UDP feed socket joined to a multicast group on loopback that belongs to
// this forwarder; the relay sends every datagram once to the group and the
// kernel clones it to each feed socket, whose sk_skb verdict sends it on to
// the subscriber's TCP socket. Per message, user space does one send
// whatever the number of subscribers.
type kernelPath struct {
	objs    kfanoutObjects
	verdict *sockmap.Attachment // the verdict on feeds
	subs    []byte              // the subs array, shared with the verdict
	tot     []byte              // the totals array

	group    unix.SockaddrInet4 // the forwarder's own group and port
	loIndex  int
	out      int // UDP socket that sends to the group
	netns    int // the forwarder's network namespace: feeds are made there
	free     []uint32
	lastSlow uint64
	send     mmsgSender

	// The relay keeps at most window messages in the loopback queue, where
	// a message waits until the softirq delivers it to the group: the
	// queue (net.core.netdev_max_backlog) drops what does not fit, without
	// a trace to the sender. The pacer, a feed of the relay's own, counts
	// the messages out.
	pacer  int
	window int
	sent   uint64 // messages sent to the group
}

// kernelMaxSubscribers bounds the subscribers of the kernel path (map size,
// less the pacer's slot).
const kernelMaxSubscribers = 1<<16 - 1

// pacerSlot is the pacer's slot in the feeds map.
const pacerSlot = kernelMaxSubscribers

// pacerStall is how long the relay waits for the loopback queue to make room
// before it sends anyway (the queue then decides).
const pacerStall = time.Second

// kernelMaxMessage is the largest datagram the group carries: it is IPv4.
const kernelMaxMessage = 65507

func openKernelPath(cfg Config) (k *kernelPath, err error) {
	lo, err := net.InterfaceByName("lo")
	if err != nil || lo.Flags&net.FlagUp == 0 {
		return nil, errors.New("kernel path: the loopback interface is down in this network namespace (ip link set lo up)")
	}
	spec, err := loadKfanout()
	if err != nil {
		return nil, err
	}
	var disconnect uint32
	if cfg.Slow == SlowDisconnect {
		disconnect = 1
	}
	framing := map[Framing]uint32{FramingNone: 0, FramingU16: 2, FramingU32: 4}[cfg.Framing]
	kcfg := kfanoutFanoutConfig{Framing: framing, Queue: uint32(cfg.Queue), Disconnect: disconnect, PacerSlot: pacerSlot}
	if cfg.Mechanisms.KernelReadsByProbe() {
		kcfg.ProbeReads = 1
	}
	if err := spec.Variables["cfg"].Set(kcfg); err != nil {
		return nil, err
	}
	k = &kernelPath{loIndex: lo.Index, out: -1, netns: -1, pacer: -1, window: loopbackWindow()}
	if err := spec.LoadAndAssign(&k.objs, nil); err != nil {
		if errors.Is(err, unix.EPERM) {
			return nil, fmt.Errorf("kernel path: load BPF program: %w (needs root: CAP_BPF and CAP_NET_ADMIN)", err)
		}
		return nil, host.Explain(fmt.Errorf("kernel path: load BPF program: %w", err), "fan-out's kernel path", host.MinKernel)
	}
	defer func() {
		if err != nil {
			k.Close()
		}
	}()
	k.verdict, err = sockmap.Attach(k.objs.Feeds, k.objs.FanoutVerdict, ebpf.AttachSkSKBVerdict, cfg.Mechanisms.AttachOnMap)
	if err != nil {
		return nil, host.Explain(fmt.Errorf("kernel path: attach verdict: %w", err), "fan-out's kernel path", host.MinKernel)
	}
	size := int(k.objs.Subs.MaxEntries()) * int(unsafe.Sizeof(kfanoutFanoutSub{}))
	if k.subs, err = unix.Mmap(k.objs.Subs.FD(), 0, size, unix.PROT_READ|unix.PROT_WRITE, unix.MAP_SHARED); err != nil {
		return nil, fmt.Errorf("kernel path: map subscriber state: %w", err)
	}
	if k.tot, err = unix.Mmap(k.objs.Totals.FD(), 0, int(unsafe.Sizeof(kfanoutFanoutTotals{})), unix.PROT_READ, unix.MAP_SHARED); err != nil {
		return nil, fmt.Errorf("kernel path: map totals: %w", err)
	}
	// Run (which makes the feeds) may be on a thread in another namespace.
	if k.netns, err = unix.Open("/proc/thread-self/ns/net", unix.O_RDONLY|unix.O_CLOEXEC, 0); err != nil {
		return nil, fmt.Errorf("kernel path: %w", err)
	}
	if err = k.openGroup(); err != nil {
		return nil, fmt.Errorf("kernel path: %w", err)
	}
	if k.pacer, _, err = k.joinFeed(pacerSlot); err != nil {
		return nil, fmt.Errorf("kernel path: pacer: %w", err)
	}
	for i := kernelMaxSubscribers - 1; i >= 0; i-- {
		k.free = append(k.free, uint32(i))
	}
	return k, nil
}

// openGroup picks a random group in 239.255.0.0/16 (organisation-local, and
// only ever sent on loopback) and binds the sending socket to 127.0.0.1 on
// an ephemeral port, which becomes the group's port: holding it keeps any
// wildcard-bound socket of another program off the port, so no one else
// receives the feed.
func (k *kernelPath) openGroup() error {
	var r [2]byte
	_, _ = rand.Read(r[:])
	k.group.Addr = [4]byte{239, 255, r[0], r[1]}
	fd, err := unix.Socket(unix.AF_INET, unix.SOCK_DGRAM|unix.SOCK_CLOEXEC, 0)
	if err != nil {
		return err
	}
	k.out = fd
	if err := unix.Bind(fd, &unix.SockaddrInet4{Addr: [4]byte{127, 0, 0, 1}}); err != nil {
		return fmt.Errorf("bind the group sender: %w", err)
	}
	sa, err := unix.Getsockname(fd)
	if err != nil {
		return err
	}
	k.group.Port = sa.(*unix.SockaddrInet4).Port
	if err := unix.SetsockoptIPMreqn(fd, unix.IPPROTO_IP, unix.IP_MULTICAST_IF, &unix.IPMreqn{Ifindex: int32(k.loIndex)}); err != nil {
		return fmt.Errorf("send the group on loopback: %w", err)
	}
	_ = unix.SetsockoptInt(fd, unix.IPPROTO_IP, unix.IP_MULTICAST_LOOP, 1)
	_ = unix.SetsockoptInt(fd, unix.IPPROTO_IP, unix.IP_MULTICAST_TTL, 0)
	_ = unix.SetsockoptInt(fd, unix.SOL_SOCKET, unix.SO_SNDBUFFORCE, 4<<20)
	return unix.Connect(fd, &k.group)
}

// sub returns the shared state of slot.
func (k *kernelPath) sub(slot uint32) *kfanoutFanoutSub {
	off := uintptr(slot) * unsafe.Sizeof(kfanoutFanoutSub{})
	return (*kfanoutFanoutSub)(unsafe.Pointer(&k.subs[off]))
}

// attach gives a new subscriber its slot and feed socket.
func (k *kernelPath) attach(s *subscriber) error {
	if len(k.free) == 0 {
		return fmt.Errorf("more than %d subscribers", kernelMaxSubscribers)
	}
	slot := k.free[len(k.free)-1]
	*k.sub(slot) = kfanoutFanoutSub{}
	if err := k.objs.Targets.Update(slot, uint64(s.fd), ebpf.UpdateAny); err != nil {
		return fmt.Errorf("add subscriber to sockmap: %w", err)
	}
	feed, cookie, err := k.joinFeed(slot)
	if err != nil {
		_ = k.objs.Targets.Delete(slot)
		return err
	}
	k.free = k.free[:len(k.free)-1]
	s.slot, s.feed, s.cookie = slot, feed, cookie
	return nil
}

// joinFeed makes the feed socket of slot, in the forwarder's namespace and
// under the verdict. It joins the group last, so the first message it gets
// is whole and every later one follows it.
func (k *kernelPath) joinFeed(slot uint32) (feed int, cookie uint64, err error) {
	err = host.InNetns(fmt.Sprintf("/proc/self/fd/%d", k.netns), func() (err error) {
		feed, err = unix.Socket(unix.AF_INET, unix.SOCK_DGRAM|unix.SOCK_NONBLOCK|unix.SOCK_CLOEXEC, 0)
		return err
	})
	if err != nil {
		return -1, 0, fmt.Errorf("feed socket: %w", err)
	}
	fail := func(what string, err error) (int, uint64, error) {
		unix.Close(feed)
		return -1, 0, fmt.Errorf("%s: %w", what, err)
	}
	_ = unix.SetsockoptInt(feed, unix.SOL_SOCKET, unix.SO_REUSEADDR, 1)
	_ = unix.SetsockoptInt(feed, unix.IPPROTO_IP, unix.IP_MULTICAST_ALL, 0)
	if err := unix.Bind(feed, &k.group); err != nil {
		return fail("bind feed socket", err)
	}
	if cookie, err = unix.GetsockoptUint64(feed, unix.SOL_SOCKET, unix.SO_COOKIE); err != nil {
		return fail("feed socket cookie", err)
	}
	if err := k.objs.Slots.Update(cookie, slot, ebpf.UpdateAny); err != nil {
		return fail("add feed cookie", err)
	}
	if err := k.objs.Feeds.Update(slot, uint64(feed), ebpf.UpdateAny); err != nil {
		_ = k.objs.Slots.Delete(cookie)
		return fail("add feed to sockmap", err)
	}
	mreq := &unix.IPMreqn{Multiaddr: k.group.Addr, Ifindex: int32(k.loIndex)}
	if err := unix.SetsockoptIPMreqn(feed, unix.IPPROTO_IP, unix.IP_ADD_MEMBERSHIP, mreq); err != nil {
		_ = k.objs.Slots.Delete(cookie)
		return fail("join the group", err)
	}
	return feed, cookie, nil
}

// detach takes a subscriber out before its socket is closed. The cookie goes
// first, so a verdict still running for the old feed drops rather than
// write to whoever gets the slot next.
func (k *kernelPath) detach(s *subscriber) {
	if s.feed < 0 {
		return
	}
	_ = k.objs.Slots.Delete(s.cookie)
	unix.Close(s.feed) // leaves the group and the feeds map
	_ = k.objs.Targets.Delete(s.slot)
	k.free = append(k.free, s.slot)
	s.feed = -1
}

// relay sends a batch of datagrams to the group, in system calls of at most
// window datagrams, each once the loopback queue has room for it.
func (k *kernelPath) relay(batch [][]byte) error {
	stalled := false
	for len(batch) > 0 {
		n := min(len(batch), k.window)
		if !k.waitForRoom(n) {
			stalled = true
		}
		sent, err := k.send.send(k.out, batch[:n])
		k.sent += uint64(sent)
		if err != nil {
			return err
		}
		batch = batch[n:]
	}
	if stalled {
		return fmt.Errorf("the loopback queue did not move for %v: sent without waiting for room", pacerStall)
	}
	return nil
}

// waitForRoom waits until n more messages fit in the window. The relay's
// thread stays on one CPU (see Forwarder.Run), the CPU whose queue it fills,
// so sleeping is what lets that CPU's softirq work the queue off. It gives
// up, returning false, on a queue that does not move for pacerStall.
func (k *kernelPath) waitForRoom(n int) bool {
	var since time.Time
	last := k.relayed()
	for k.sent+uint64(n) > last+uint64(k.window) {
		time.Sleep(20 * time.Microsecond)
		now := k.relayed()
		switch {
		case now != last:
			last, since = now, time.Time{}
		case since.IsZero():
			since = time.Now()
		case time.Since(since) > pacerStall:
			return false
		}
	}
	return true
}

// relayed is how many messages the pacer has seen.
func (k *kernelPath) relayed() uint64 {
	return atomic.LoadUint64((*uint64)(unsafe.Pointer(&k.tot[unsafe.Offsetof(kfanoutFanoutTotals{}.Relayed)])))
}

// loopbackWindow is how many of its messages the relay keeps in a CPU's
// loopback queue: half of it, the rest left to the subscribers' own loopback
// traffic and the source's.
func loopbackWindow() int {
	n := 1000 // the kernel's default
	if b, err := os.ReadFile("/proc/sys/net/core/netdev_max_backlog"); err == nil {
		if v, err := strconv.Atoi(strings.TrimSpace(string(b))); err == nil && v > 0 {
			n = v
		}
	}
	return max(n/2, 1)
}

// slowSince reports whether the verdict flagged a subscriber since the last
// call (one load, so the relay loop can ask after every batch).
func (k *kernelPath) slowSince() bool {
	n := atomic.LoadUint64((*uint64)(unsafe.Pointer(&k.tot[0])))
	if n == k.lastSlow {
		return false
	}
	k.lastSlow = n
	return true
}

// subCounts is what the verdict keeps for one subscriber.
type subCounts struct {
	msgs, bytes, dropped uint64
	queued               int  // not acknowledged by its far end yet
	slow                 bool // over the bound, under the disconnect policy
	failed               bool // a message could not be framed: the stream would be cut
}

// counts reads a subscriber's counters; queued is what its far end has not
// acknowledged yet (in the socket or waiting to enter it).
func (k *kernelPath) counts(s *subscriber) subCounts {
	st := k.sub(s.slot)
	c := subCounts{
		msgs:    atomic.LoadUint64(&st.Msgs),
		bytes:   atomic.LoadUint64(&st.Bytes),
		dropped: atomic.LoadUint64(&st.Dropped),
		slow:    atomic.LoadUint32(&st.Slow) != 0,
		failed:  atomic.LoadUint32(&st.Failed) != 0,
	}
	if info, err := unix.GetsockoptTCPInfo(s.fd, unix.IPPROTO_TCP, unix.TCP_INFO); err == nil && c.bytes >= info.Bytes_acked {
		c.queued = int(c.bytes - info.Bytes_acked)
	}
	return c
}

func (k *kernelPath) Close() {
	for _, fd := range []int{k.pacer, k.out, k.netns} {
		if fd >= 0 {
			unix.Close(fd)
		}
	}
	if k.tot != nil {
		unix.Munmap(k.tot)
	}
	if k.subs != nil {
		unix.Munmap(k.subs)
	}
	if k.verdict != nil {
		k.verdict.Close()
	}
	k.objs.Close()
}
