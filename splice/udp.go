package splice

import (
	"errors"
	"fmt"
	"maps"
	"net"
	"net/netip"
	"os"
	"slices"
	"sync"
	"sync/atomic"

	"github.com/cilium/ebpf"
	"golang.org/x/sys/unix"

	"github.com/shunt-project/shunt/internal/sockutil"

	"github.com/shunt-project/shunt/host"
	"github.com/shunt-project/shunt/internal/sockmap"
)

// DefaultUDPMaxQueue bounds the kernel memory the datagrams waiting to leave
// through one socket of a UDP pair may take; past it datagrams are dropped
// (counted), as a full socket buffer drops them.
const DefaultUDPMaxQueue = 1 << 20

// UDPOptions shape a UDPSplicer.
type UDPOptions struct {
	MaxQueue uint32 // 0: DefaultUDPMaxQueue
	MaxPairs int    // 0: DefaultMaxPairs
	// Mechanisms: the zero value uses the kernel's newest; tests set it
	// to run an older kernel's ways on this one.
	Mechanisms host.Mechanisms
}

// UDPSplicer joins pairs of connected UDP sockets in the kernel
// (bpf/splice_udp.c): each datagram arriving on one leaves through the
// other, whole, with no process woken. UDP has no end of stream: a pair
// lasts until Close.
type UDPSplicer struct {
	objs     spliceudpObjects
	attach   *sockmap.Attachment
	maxQueue uint32

	mu       sync.Mutex
	free     []uint32
	pairs    map[uint32]*UDPPair
	closed   bool
	released bool // handed over: Close has nothing left to do
}

// NewUDP loads the UDP splice program. It needs CAP_BPF and CAP_NET_ADMIN.
func NewUDP(opts UDPOptions) (*UDPSplicer, error) {
	if opts.MaxQueue == 0 {
		opts.MaxQueue = DefaultUDPMaxQueue
	}
	cfg := spliceudpSpliceUdpConfig{ProbeReads: probeReads(opts.Mechanisms)}
	spec, slots, err := loadSized(loadSpliceudp, opts.MaxPairs, cfg, "udp_socks", "udp_dirs", "udp_slots")
	if err != nil {
		return nil, err
	}
	s := &UDPSplicer{maxQueue: opts.MaxQueue, pairs: map[uint32]*UDPPair{}}
	if err := spec.LoadAndAssign(&s.objs, nil); err != nil {
		return nil, host.Explain(fmt.Errorf("load UDP splice program: %w", err), "joining sockets in the kernel", host.MinKernel)
	}
	s.attach, err = sockmap.Attach(s.objs.UdpSocks, s.objs.SpliceUdpVerdict, ebpf.AttachSkSKBVerdict, opts.Mechanisms.AttachOnMap)
	if err != nil {
		s.objs.Close()
		return nil, host.Explain(fmt.Errorf("attach UDP splice verdict: %w", err), "joining sockets in the kernel", host.MinKernel)
	}
	s.free = freeIndices(int(slots/2), nil)
	return s, nil
}

// UDPStats counts one direction of a UDP pair.
type UDPStats struct {
	Datagrams    uint64 // sent on
	Bytes        uint64
	Dropped      uint64 // over the bound (or the other socket gone)
	DroppedBytes uint64
	// Copied counts datagrams that were queued on the socket before the
	// join and were sent on by user space.
	Copied uint64
	// Refused counts errors the network reported for the outgoing
	// socket (an ICMP port unreachable: nobody listens at the far end
	// now), each of which had the kernel stop sending through it until
	// the pair repaired it; datagrams waiting at that moment were lost,
	// as plain UDP loses them.
	Refused uint64
}

// UDPPair is two connected UDP sockets joined by a UDPSplicer.
type UDPPair struct {
	s        *UDPSplicer
	index    uint32
	a, b     *net.UDPConn
	cookies  [2]uint64
	copiedAB atomic.Uint64
	copiedBA atomic.Uint64
	refused  [2]atomic.Uint64 // by the socket that was refused: a, b
	refusals chan int         // the index of a refused socket, for Refusals
	once     sync.Once
	mu       sync.Mutex // insert and repair against Close
	closed   bool
	err      error // a repair failed: the pair forwards no more (Err)
	watchers sync.WaitGroup
}

// Join hands a and b to the kernel: from now on every datagram that arrives
// on one is sent out of the other. The UDPSplicer owns both connections and
// closes them with the pair. Datagrams already queued on a or b are sent on
// by Join itself; those that arrive while it joins may overtake them, as UDP
// allows, but none is lost.
func (s *UDPSplicer) Join(a, b *net.UDPConn) (*UDPPair, error) {
	for i, c := range []*net.UDPConn{a, b} {
		if c.RemoteAddr() == nil {
			return nil, fmt.Errorf("splice: socket %d is not a connected UDP socket (connect it to its peer first)", i+1)
		}
	}
	s.mu.Lock()
	if s.closed {
		s.mu.Unlock()
		return nil, errors.New("splice: UDP splicer is closed")
	}
	if len(s.free) == 0 {
		s.mu.Unlock()
		return nil, ErrFull
	}
	index := s.free[len(s.free)-1]
	s.free = s.free[:len(s.free)-1]
	s.mu.Unlock()

	p := newUDPPair(s, index, a, b)
	// What waits on a socket now would never reach its verdict (it reads
	// one datagram per arrival), so it is sent on here, before and after
	// the sockets join.
	p.forwardQueued()
	if err := p.insert(); err != nil {
		p.remove()
		s.release(index)
		return nil, err
	}
	p.forwardQueued()
	s.mu.Lock()
	s.pairs[index] = p
	s.mu.Unlock()
	p.start()
	return p, nil
}

func newUDPPair(s *UDPSplicer, index uint32, a, b *net.UDPConn) *UDPPair {
	return &UDPPair{s: s, index: index, a: a, b: b, refusals: make(chan int, 2)}
}

func (p *UDPPair) start() {
	p.watchers.Add(2)
	go p.watch(0)
	go p.watch(1)
}

// watch repairs socket i (0: a, 1: b) after the network refused what it
// sent. Plain UDP reports an ICMP error once, on the next send, and goes on;
// the psock worker that sends for the kernel takes any error as the end
// and stops sending through the socket for good, dropping from then on. The
// error also wakes the socket's pollers, so this goroutine, asleep in Go's
// poller until then, takes the error and puts the socket back into the map,
// which gives it a fresh psock.
func (p *UDPPair) watch(i int) {
	defer p.watchers.Done()
	c := p.a
	if i == 1 {
		c = p.b
	}
	raw, err := c.SyscallConn()
	if err != nil {
		return
	}
	_ = raw.Read(func(fd uintptr) bool {
		if soerr, _ := unix.GetsockoptInt(int(fd), unix.SOL_SOCKET, unix.SO_ERROR); soerr != 0 {
			p.noteRefused(i)
			p.repair(i, int(fd))
		}
		return false // sleep again; Close ends the wait
	})
}

func (p *UDPPair) repair(i, fd int) {
	p.mu.Lock()
	defer p.mu.Unlock()
	if p.closed {
		return
	}
	slot := 2*p.index + uint32(i)
	// Out of the map and back: a fresh psock. Out already (a repair raced
	// with another): ErrKeyNotExist, harmless.
	if err := p.s.objs.UdpSocks.Delete(slot); err != nil && !errors.Is(err, ebpf.ErrKeyNotExist) {
		p.fail(fmt.Errorf("splice: socket %d was refused, and taking it out of the kernel path failed: %w", i+1, err))
		return
	}
	if err := p.s.objs.UdpSocks.Update(slot, uint64(fd), ebpf.UpdateAny); err != nil {
		p.fail(fmt.Errorf("splice: socket %d was refused, and putting it back into the kernel path failed: %w", i+1, err))
		return
	}
	// What arrived on it meanwhile took the normal path, and what arrived
	// on its peer while it was out waits on the peer.
	p.forwardQueued()
}

// fail records why the pair stopped forwarding (p.mu held); the owner
// learns it from Err when Refusals reports the socket.
func (p *UDPPair) fail(err error) {
	if p.err == nil {
		p.err = err
	}
}

// Err says why the pair forwards no more: a socket refused by the network
// could not be put back into the kernel path. nil while it forwards.
func (p *UDPPair) Err() error {
	p.mu.Lock()
	defer p.mu.Unlock()
	return p.err
}

// noteRefused counts a refusal of socket i and reports it to Refusals.
func (p *UDPPair) noteRefused(i int) {
	p.refused[i].Add(1)
	select {
	case p.refusals <- i:
	default: // the owner has not taken the last ones; counted anyway
	}
}

func (p *UDPPair) insert() error {
	slots := [2]uint32{2 * p.index, 2*p.index + 1}
	for i, c := range []*net.UDPConn{p.a, p.b} {
		fd, err := socketFD(c)
		if err != nil {
			return err
		}
		if p.cookies[i], err = unix.GetsockoptUint64(fd, unix.SOL_SOCKET, unix.SO_COOKIE); err != nil {
			return fmt.Errorf("socket cookie: %w", err)
		}
		dir := spliceudpSpliceUdpDir{Peer: slots[1-i], MaxQueue: p.s.maxQueue}
		if err := p.s.objs.UdpDirs.Update(slots[i], &dir, ebpf.UpdateAny); err != nil {
			return err
		}
		if err := p.s.objs.UdpSlots.Update(p.cookies[i], slots[i], ebpf.UpdateAny); err != nil {
			return err
		}
	}
	for i, c := range []*net.UDPConn{p.a, p.b} {
		fd, _ := socketFD(c)
		if err := p.s.objs.UdpSocks.Update(slots[i], uint64(fd), ebpf.UpdateAny); err != nil {
			return fmt.Errorf("add UDP socket to sockmap: %w", err)
		}
	}
	return nil
}

// remove takes the pair's sockets and cookies out of the maps.
func (p *UDPPair) remove() {
	for i := range 2 {
		_ = p.s.objs.UdpSocks.Delete(2*p.index + uint32(i))
		if p.cookies[i] != 0 {
			_ = p.s.objs.UdpSlots.Delete(p.cookies[i])
		}
	}
}

// forwardQueued sends on every datagram waiting on either socket, without
// blocking. A refusal the drain takes (the read reports it, once) is noted
// as the watcher would have.
func (p *UDPPair) forwardQueued() {
	for i, c := range [2]*net.UDPConn{p.a, p.b} {
		to, copied := p.b, &p.copiedAB
		if i == 1 {
			to, copied = p.a, &p.copiedBA
		}
		// A datagram the far side refuses is dropped, as the kernel path drops it.
		n, err := sockutil.DrainUDP(c, func(b []byte, _ netip.AddrPort) { _, _ = to.Write(b) })
		copied.Add(uint64(n))
		if errors.Is(err, unix.ECONNREFUSED) {
			p.noteRefused(i)
		}
	}
}

func (s *UDPSplicer) release(index uint32) {
	s.mu.Lock()
	s.free = append(s.free, index)
	delete(s.pairs, index)
	s.mu.Unlock()
}

// Index is the pair's slot in the Splicer's maps.
func (p *UDPPair) Index() uint32 { return p.index }

// Refusals reports which socket (0: a, 1: b) the network refused what it
// sent through (an ICMP port unreachable), as it happens; the pair has
// repaired itself already. Reports that nobody takes are dropped (Stats
// counts them all).
func (p *UDPPair) Refusals() <-chan int { return p.refusals }

// Stats reads both directions' counters.
func (p *UDPPair) Stats() (ab, ba UDPStats) {
	read := func(slot uint32, copied uint64) UDPStats {
		var d spliceudpSpliceUdpDir
		_ = p.s.objs.UdpDirs.Lookup(slot, &d)
		return UDPStats{Datagrams: d.Datagrams, Bytes: d.Bytes, Dropped: d.Dropped, DroppedBytes: d.DroppedBytes, Copied: copied}
	}
	ab, ba = read(2*p.index, p.copiedAB.Load()), read(2*p.index+1, p.copiedBA.Load())
	// A direction's datagrams leave through the other socket.
	ab.Refused, ba.Refused = p.refused[1].Load(), p.refused[0].Load()
	return ab, ba
}

// Close takes the pair out of the kernel and closes both sockets.
func (p *UDPPair) Close() error {
	var err error
	p.once.Do(func() {
		p.mu.Lock()
		p.closed = true
		p.remove()
		p.mu.Unlock()
		err = errors.Join(p.a.Close(), p.b.Close())
		p.watchers.Wait()
		p.s.release(p.index)
	})
	return err
}

// Active is the number of pairs joined now.
func (s *UDPSplicer) Active() int {
	s.mu.Lock()
	defer s.mu.Unlock()
	return len(s.pairs)
}

// MapEntries counts the socket and cookie entries in the kernel maps.
func (s *UDPSplicer) MapEntries() (socks, cookies int, err error) {
	return countEntries(s.objs.UdpSocks, s.objs.UdpSlots)
}

// Close closes every pair and unloads the program (after a hand-over: does
// nothing).
func (s *UDPSplicer) Close() error {
	s.mu.Lock()
	if s.released {
		s.mu.Unlock()
		return nil
	}
	s.closed = true
	pairs := slices.Collect(maps.Values(s.pairs))
	s.mu.Unlock()
	for _, p := range pairs {
		p.Close()
	}
	return errors.Join(s.attach.Close(), s.objs.Close())
}

// UDPConn wraps a descriptor that must be a connected UDP socket; it takes
// ownership of fd (closed on error too).
func UDPConn(fd int) (*net.UDPConn, error) {
	f := os.NewFile(uintptr(fd), "socket")
	defer f.Close()
	typ, proto, err := socketKind(fd)
	if err != nil {
		return nil, err
	}
	if typ != unix.SOCK_DGRAM || proto != unix.IPPROTO_UDP {
		return nil, errors.New("is not a UDP socket")
	}
	if _, err := unix.Getpeername(fd); err != nil {
		return nil, errors.New("is not a connected UDP socket (connect it to its peer first)")
	}
	c, err := net.FileConn(f)
	if err != nil {
		return nil, err
	}
	return c.(*net.UDPConn), nil
}
