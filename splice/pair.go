package splice

import (
	"errors"
	"fmt"
	"net"
	"sync"
	"sync/atomic"
	"syscall"
	"time"

	"github.com/cilium/ebpf"
	"golang.org/x/sys/unix"
)

// dirUser is DIR_USER in bpf/include/splice_maps.h.
const dirUser = uint64(1) << spliceSpliceStateBitsDIR_USER_BIT

// Stats counts one direction's bytes.
type Stats struct {
	Bytes  uint64 // bytes delivered to the outgoing socket
	Kernel uint64 // of which the kernel forwarded
	ToUser uint32 // times flow control moved the direction to user space
	// Repeated counts retransmissions that overlapped bytes already
	// received; their repeated bytes were dropped (see bpf/splice.c).
	Repeated uint32
	// KernelNow says whether the kernel forwards this direction at the
	// moment (false while flow control has it in user space).
	KernelNow bool
}

// Pair is two sockets joined by a Splicer. It ends when both directions have
// ended (EOF forwarded each way) or either side failed (then both are reset).
type Pair struct {
	s     *Splicer
	index uint32
	a, b  *net.TCPConn
	ab    *direction // bytes arriving on a, leaving through b
	ba    *direction

	userOnly bool        // not in the kernel maps: copied in user space
	joined   atomic.Bool // both directions set up (Stats may read them)
	done     chan struct{}
	stopped  chan struct{} // closed when a frozen pair's goroutines are out
	frozenCh chan struct{} // closed when freeze begins
	once     sync.Once
	aborted  atomic.Bool
	frozen   atomic.Bool // handing over to another process: stop, keep the sockets
	errMu    sync.Mutex
	err      error
	finished sync.WaitGroup
	final    atomic.Pointer[[2]Stats] // Stats once the Splicer's shared state is gone
}

// Join hands a and b to the kernel: from now on every byte that arrives on
// one is sent out of the other. The Splicer owns both connections and closes
// them when the pair ends. Bytes already read from a or b by the caller are
// the caller's; bytes queued and not yet read are forwarded.
func (s *Splicer) Join(a, b *net.TCPConn) (*Pair, error) {
	s.mu.Lock()
	if s.closed {
		s.mu.Unlock()
		return nil, errors.New("splice: splicer is closed")
	}
	if len(s.free) == 0 {
		s.mu.Unlock()
		return nil, ErrFull
	}
	index := s.free[len(s.free)-1]
	s.free = s.free[:len(s.free)-1]
	p := &Pair{s: s, index: index, a: a, b: b, done: make(chan struct{})}
	s.pairs[index] = p
	s.mu.Unlock()

	if err := p.join(); err != nil {
		p.unregister()
		return nil, err
	}
	p.joined.Store(true)
	p.start()
	return p, nil
}

// start runs both directions (a direction that already ended stays ended).
func (p *Pair) start() {
	p.stopped = make(chan struct{})
	p.frozenCh = make(chan struct{})
	p.finished.Add(2)
	go p.run(p.ab)
	go p.run(p.ba)
	go func() {
		p.finished.Wait()
		if p.frozen.Load() {
			close(p.stopped)
			return
		}
		p.release()
	}()
}

func (p *Pair) join() error {
	slotA, slotB := 2*p.index, 2*p.index+1
	var err error
	if p.ab, err = newDirection(p, "a->b", p.a, p.b, slotA, slotB); err != nil {
		return err
	}
	if p.ba, err = newDirection(p, "b->a", p.b, p.a, slotB, slotA); err != nil {
		return err
	}
	for _, d := range []*direction{p.ab, p.ba} {
		if err := d.takeQueued(); err != nil {
			return err
		}
	}
	if beforeMapped != nil {
		beforeMapped()
	}
	// Cookies first, sockets last: once a socket is in the map the
	// verdict runs for it, and it must find its direction (in user mode).
	for _, d := range []*direction{p.ab, p.ba} {
		if err := p.s.objs.Slots.Update(d.cookie, d.slot, ebpf.UpdateAny); err != nil {
			p.forget()
			return fmt.Errorf("splice: register socket: %w", err)
		}
	}
	for i, d := range []*direction{p.ab, p.ba} {
		if err := p.s.objs.Socks.Update(d.slot, uint64(d.srcFD), ebpf.UpdateAny); err != nil {
			if i == 1 {
				_ = p.s.objs.Socks.Delete(p.ab.slot)
			}
			p.forget()
			if errors.Is(err, unix.EOPNOTSUPP) {
				// Only established sockets may join a sockmap; one
				// that already got FIN (or worse) is copied in user
				// space for the rest of its short life.
				p.userOnly = true
				return nil
			}
			return fmt.Errorf("splice: add socket to map: %w", err)
		}
	}
	return nil
}

// beforeMapped, if set (tests only), runs between taking the queued bytes
// and adding the sockets to the map: where a send that bypass redirects to a
// joining socket can land unseen by the verdict (leaveOutUnseen).
var beforeMapped func()

// forget removes the pair's cookie entries.
func (p *Pair) forget() {
	for _, d := range []*direction{p.ab, p.ba} {
		if d != nil {
			_ = p.s.objs.Slots.Delete(d.cookie)
		}
	}
}

func (p *Pair) unregister() {
	p.s.mu.Lock()
	delete(p.s.pairs, p.index)
	p.s.free = append(p.s.free, p.index)
	p.s.mu.Unlock()
}

// run moves one direction until EOF is forwarded or the pair fails.
func (p *Pair) run(d *direction) {
	defer p.finished.Done()
	if d.ended {
		return
	}
	err := d.run()
	if errors.Is(err, errFrozen) {
		return
	}
	if err != nil && !p.aborted.Load() {
		p.fail(err)
	}
}

// freeze stops both directions where they stand, sockets open and in the
// map, for another process to take over.
// It returns false for a pair that ended meanwhile (nothing to hand over).
func (p *Pair) freeze() bool {
	p.frozen.Store(true)
	close(p.frozenCh)
	past := time.Unix(1, 0)
	for _, c := range []*net.TCPConn{p.a, p.b} {
		c.SetDeadline(past) // wakes goroutines asleep in the poller
	}
	select {
	case <-p.stopped:
	case <-p.done: // both directions had ended before the flag was seen
		return false
	}
	for _, c := range []*net.TCPConn{p.a, p.b} {
		c.SetDeadline(time.Time{})
	}
	return true
}

// fail records the first error and resets both sockets, as a proxy whose one
// side broke would.
func (p *Pair) fail(err error) {
	p.errMu.Lock()
	if p.err == nil {
		p.err = err
	}
	p.errMu.Unlock()
	p.Abort()
}

// Abort resets both connections (RST to both peers) and ends the pair.
func (p *Pair) Abort() {
	p.once.Do(func() {
		p.aborted.Store(true)
		for _, c := range []*net.TCPConn{p.a, p.b} {
			_ = c.SetLinger(0)
			c.Close()
		}
	})
}

// release runs when both directions have ended: sockets leave the maps
// and are closed, and the slots are reused.
func (p *Pair) release() {
	if !p.userOnly {
		_ = p.s.objs.Socks.Delete(p.ab.slot)
		_ = p.s.objs.Socks.Delete(p.ba.slot)
		p.forget()
	}
	p.a.Close()
	p.b.Close()
	p.seal()
	p.unregister()
	close(p.done)
}

// Index is the pair's slot in its Splicer (what a hand-over carries).
func (p *Pair) Index() uint32 { return p.index }

// Stopped is closed when the pair was frozen for a hand-over.
func (p *Pair) Stopped() <-chan struct{} { return p.frozenCh }

// Done is closed when the pair has ended and both sockets are closed.
func (p *Pair) Done() <-chan struct{} { return p.done }

// Err is why the pair ended early; nil after a clean close each way, or
// before the pair ended.
func (p *Pair) Err() error {
	p.errMu.Lock()
	defer p.errMu.Unlock()
	return p.err
}

// InKernel says whether the kernel forwards this pair's bytes (false when a
// socket could not join the map; the pair is then copied in user space).
func (p *Pair) InKernel() bool { return !p.userOnly }

// Stats returns bytes moved a->b and b->a so far; after the Splicer let go
// of its shared state (Close, or Release after a hand-over), the last
// counts it had.
func (p *Pair) Stats() (ab, ba Stats) {
	p.s.memMu.RLock()
	defer p.s.memMu.RUnlock()
	if p.s.mem == nil {
		if f := p.final.Load(); f != nil {
			return f[0], f[1]
		}
		return Stats{}, Stats{}
	}
	return p.ab.stats(), p.ba.stats()
}

// seal keeps the counts for Stats once the shared state is gone.
func (p *Pair) seal() {
	ab, ba := p.ab.stats(), p.ba.stats()
	ab.KernelNow, ba.KernelNow = false, false
	p.final.Store(&[2]Stats{ab, ba})
}

// socketFD returns the descriptor behind c without taking it from Go's
// poller.
func socketFD(c syscall.Conn) (int, error) {
	rc, err := c.SyscallConn()
	if err != nil {
		return -1, err
	}
	fd := -1
	if err := rc.Control(func(f uintptr) { fd = int(f) }); err != nil {
		return -1, err
	}
	return fd, nil
}

// sentSoFar is how many bytes fd has queued for sending since an arbitrary
// origin fixed per connection: acknowledged bytes plus bytes in the send
// queue. Read in this order, it can only lag behind the truth.
func sentSoFar(fd int) (uint64, error) {
	info, err := unix.GetsockoptTCPInfo(fd, unix.IPPROTO_TCP, unix.TCP_INFO)
	if err != nil {
		return 0, err
	}
	outq, err := unix.IoctlGetInt(fd, unix.SIOCOUTQ)
	if err != nil {
		return 0, err
	}
	return info.Bytes_acked + uint64(outq), nil
}
