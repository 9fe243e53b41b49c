package fanout

import (
	"context"
	"fmt"
	"io"
	"net/netip"
	"os"
	"runtime"
	"time"
	"unsafe"

	"golang.org/x/sys/unix"

	"github.com/shunt-project/shunt/internal/uring"
)

// Forwarder is a running relay. All of its state belongs to one event loop
// on one OS thread: no locks, and stats are answered by the loop itself.
type Forwarder struct {
	cfg  Config
	log  io.Writer
	src  int // UDP socket of the feed
	ln   int // TCP listener
	ctl  int // unix listener for stats, -1 if none
	ep   int
	stop int // eventfd: Run returns when it is written

	ring    *uring.Ring // PathURing only
	kern    *kernelPath // PathKernel only
	zc      zpool       // PathZeroCopy only
	maxMsg  int         // longer datagrams are dropped
	subs    map[int]*subscriber
	batch   [][]byte // datagrams of one wake-up
	pending []byte   // their bytes, back to back; capacity for a full batch
	totals  Totals
}

// Totals are the forwarder's counts since start.
type Totals struct {
	Received     uint64 `json:"messages_received"`
	Bytes        uint64 `json:"bytes_received"`
	Oversized    uint64 `json:"messages_oversized"` // too long for the framing: delivered to nobody
	Subscribers  int    `json:"subscribers"`
	Connected    uint64 `json:"subscribers_connected"`    // since start
	Disconnected uint64 `json:"subscribers_disconnected"` // by the subscriber or for being slow
	SlowDropped  uint64 `json:"subscribers_disconnected_slow"`
	// PathZeroCopy: sends made without copying, those the kernel reported
	// done, and how many of those it had to copy after all (loopback, or
	// a device without scatter-gather).
	ZeroCopySends  uint64 `json:"zerocopy_sends,omitempty"`
	ZeroCopyDone   uint64 `json:"zerocopy_completed,omitempty"`
	ZeroCopyCopied uint64 `json:"zerocopy_copied,omitempty"`
}

const (
	batchMax    = 64
	maxDatagram = 1 << 16 // above the largest UDP payload (65,527 bytes over IPv6)
)

// New binds the source, the listener and the control socket. Run relays.
func New(cfg Config) (*Forwarder, error) {
	if cfg.Queue == 0 {
		cfg.Queue = DefaultQueue
	}
	if cfg.Queue < 0 {
		return nil, fmt.Errorf("queue bound %d: want a positive number of bytes", cfg.Queue)
	}
	if cfg.Queue < frameLen(cfg.Framing, 65507)+gapLen(cfg.Framing) {
		return nil, fmt.Errorf("queue bound %d bytes is below one datagram (%d with framing): raise --queue", cfg.Queue, frameLen(cfg.Framing, 65507)+gapLen(cfg.Framing))
	}
	f := &Forwarder{cfg: cfg, log: cfg.Log, src: -1, ln: -1, ctl: -1, ep: -1, stop: -1, subs: map[int]*subscriber{}}
	if f.log == nil {
		f.log = io.Discard
	}
	var err error
	defer func() {
		if err != nil {
			f.Close()
		}
	}()
	if f.src, err = bindSocket(unix.SOCK_DGRAM, cfg.Source); err != nil {
		return nil, fmt.Errorf("source udp://%s: %w", cfg.Source, err)
	}
	// A burst must wait in the kernel, not be dropped, while the loop
	// writes to subscribers.
	_ = unix.SetsockoptInt(f.src, unix.SOL_SOCKET, unix.SO_RCVBUFFORCE, 32<<20)
	if f.ln, err = bindSocket(unix.SOCK_STREAM, cfg.Listen); err != nil {
		return nil, fmt.Errorf("listen tcp://%s: %w", cfg.Listen, err)
	}
	if err = unix.Listen(f.ln, 4096); err != nil {
		return nil, fmt.Errorf("listen tcp://%s: %w", cfg.Listen, err)
	}
	if cfg.Control != "" {
		if f.ctl, err = listenControl(cfg.Control); err != nil {
			return nil, err
		}
	}
	if f.ep, err = unix.EpollCreate1(unix.EPOLL_CLOEXEC); err != nil {
		return nil, err
	}
	if f.stop, err = unix.Eventfd(0, unix.EFD_CLOEXEC|unix.EFD_NONBLOCK); err != nil {
		return nil, err
	}
	for _, fd := range []int{f.src, f.ln, f.ctl, f.stop} {
		if fd < 0 {
			continue
		}
		if err = unix.EpollCtl(f.ep, unix.EPOLL_CTL_ADD, fd, &unix.EpollEvent{Events: unix.EPOLLIN, Fd: int32(fd)}); err != nil {
			return nil, err
		}
	}
	if cfg.Path == PathURing {
		if f.ring, err = uring.New(uringEntries); err != nil {
			return nil, fmt.Errorf("io_uring: %w", err)
		}
	}
	f.maxMsg = min(cfg.Framing.maxMessage(), maxDatagram)
	if cfg.Path == PathKernel {
		if f.kern, err = openKernelPath(cfg); err != nil {
			return nil, err
		}
		f.maxMsg = min(f.maxMsg, kernelMaxMessage)
	}
	f.pending = make([]byte, 0, batchMax*maxDatagram)
	return f, nil
}

func bindSocket(typ int, ap netip.AddrPort) (int, error) {
	fam := unix.AF_INET6
	var sa unix.Sockaddr = &unix.SockaddrInet6{Port: int(ap.Port()), Addr: ap.Addr().As16()}
	if ap.Addr().Is4() {
		fam = unix.AF_INET
		sa = &unix.SockaddrInet4{Port: int(ap.Port()), Addr: ap.Addr().As4()}
	}
	fd, err := unix.Socket(fam, typ|unix.SOCK_NONBLOCK|unix.SOCK_CLOEXEC, 0)
	if err != nil {
		return -1, err
	}
	_ = unix.SetsockoptInt(fd, unix.SOL_SOCKET, unix.SO_REUSEADDR, 1)
	if err := unix.Bind(fd, sa); err != nil {
		unix.Close(fd)
		return -1, err
	}
	return fd, nil
}

func localAddr(fd int) netip.AddrPort {
	sa, err := unix.Getsockname(fd)
	if err != nil {
		return netip.AddrPort{}
	}
	return addrOf(sa)
}

func addrOf(sa unix.Sockaddr) netip.AddrPort {
	switch a := sa.(type) {
	case *unix.SockaddrInet4:
		return netip.AddrPortFrom(netip.AddrFrom4(a.Addr), uint16(a.Port))
	case *unix.SockaddrInet6:
		return netip.AddrPortFrom(netip.AddrFrom16(a.Addr).Unmap(), uint16(a.Port))
	}
	return netip.AddrPort{}
}

// SourceAddr and ListenAddr are the bound addresses (port 0 resolved).
func (f *Forwarder) SourceAddr() netip.AddrPort { return localAddr(f.src) }
func (f *Forwarder) ListenAddr() netip.AddrPort { return localAddr(f.ln) }

// Close releases every socket. Call it after Run returned.
func (f *Forwarder) Close() error {
	if f.ring != nil {
		f.ring.Close()
	}
	for fd, s := range f.subs {
		if f.kern != nil {
			f.kern.detach(s)
		}
		f.releaseZeroCopy(s)
		unix.Close(fd)
	}
	if f.kern != nil {
		f.kern.Close()
	}
	for _, fd := range []int{f.src, f.ln, f.ctl, f.ep, f.stop} {
		if fd >= 0 {
			unix.Close(fd)
		}
	}
	if f.ctl >= 0 && f.cfg.Control != "" {
		os.Remove(f.cfg.Control)
	}
	return nil
}

// currentCPU is the CPU the calling thread runs on.
func currentCPU() (int, error) {
	var cpu, node uint32
	if _, _, errno := unix.RawSyscall(unix.SYS_GETCPU, uintptr(unsafe.Pointer(&cpu)), uintptr(unsafe.Pointer(&node)), 0); errno != 0 {
		return 0, fmt.Errorf("getcpu: %w", errno)
	}
	return int(cpu), nil
}

// Run relays until ctx is done.
func (f *Forwarder) Run(ctx context.Context) error {
	runtime.LockOSThread()
	cpu, pin := f.cfg.CPU, f.cfg.PinCPU
	if f.kern != nil && !pin {
		// Loopback queues a datagram on the sending CPU's backlog and
		// each CPU works through its own: a relay that moved between
		// CPUs could have a later message delivered to every subscriber
		// before an earlier one still queued behind. One CPU, one queue,
		// the relay's order. (Seen on a loaded machine: every subscriber
		// got message 4006 where 3778 was due.)
		var err error
		if cpu, err = currentCPU(); err != nil {
			return err
		}
		pin = true
	}
	if pin {
		var old, set unix.CPUSet
		if err := unix.SchedGetaffinity(0, &old); err != nil {
			return err
		}
		set.Set(cpu)
		if err := unix.SchedSetaffinity(0, &set); err != nil {
			return fmt.Errorf("pin to CPU %d: %w", cpu, err)
		}
		// A thread that cannot be unpinned stays locked and dies with
		// this goroutine rather than carry the mask elsewhere.
		defer func() {
			if unix.SchedSetaffinity(0, &old) == nil {
				runtime.UnlockOSThread()
			}
		}()
	} else {
		defer runtime.UnlockOSThread()
	}
	// Cancelling ctx wakes the loop through the eventfd. The waker ends
	// before Run returns, however Run returns: a waker left behind would
	// write to f.stop after Close closed it (by then, perhaps, another
	// file's descriptor).
	runDone, wakerDone := make(chan struct{}), make(chan struct{})
	go func() {
		defer close(wakerDone)
		select {
		case <-ctx.Done():
			_, _ = unix.Write(f.stop, []byte{1, 0, 0, 0, 0, 0, 0, 0})
		case <-runDone:
		}
	}()
	defer func() {
		close(runDone)
		<-wakerDone
	}()
	events := make([]unix.EpollEvent, 256)
	for {
		n, err := unix.EpollWait(f.ep, events, -1)
		if err == unix.EINTR {
			continue
		}
		if err != nil {
			return fmt.Errorf("epoll: %w", err)
		}
		for _, ev := range events[:n] {
			switch fd := int(ev.Fd); fd {
			case f.stop:
				return nil
			case f.src:
				f.readSource()
			case f.ln:
				f.accept()
			case f.ctl:
				f.serveControl()
			default:
				if s := f.subs[fd]; s != nil {
					f.subscriberEvent(s, ev.Events)
				}
			}
		}
	}
}

// readSource takes up to batchMax datagrams and hands each to every
// subscriber, then writes once per subscriber. Datagrams are received
// straight into one buffer with room for a full batch, which the batch's
// slices point into.
func (f *Forwarder) readSource() {
	f.batch, f.pending = f.batch[:0], f.pending[:0]
	k := 0
	for k < batchMax {
		off := len(f.pending)
		buf := f.pending[off : off+maxDatagram]
		n, _, err := unix.Recvfrom(f.src, buf, unix.MSG_DONTWAIT|unix.MSG_TRUNC)
		if err == unix.EINTR {
			continue
		}
		if err != nil {
			break
		}
		f.totals.Received++
		if n > f.maxMsg {
			f.totals.Oversized++
			fmt.Fprintf(f.log, "fanout: dropped a %d-byte datagram: %s carries at most %d bytes\n", n, f.limitName(), f.maxMsg)
			continue
		}
		f.totals.Bytes += uint64(n)
		f.pending = f.pending[:off+n]
		f.batch = append(f.batch, f.pending[off:off+n])
		k++
	}
	if k == 0 {
		return
	}
	if f.kern != nil {
		if err := f.kern.relay(f.batch); err != nil {
			fmt.Fprintf(f.log, "fanout: send to the subscribers' group: %v\n", err)
		}
		if f.kern.slowSince() {
			f.dropSlowKernel()
		}
		return
	}
	if f.cfg.Path == PathZeroCopy {
		f.deliverShared()
		return
	}
	for _, s := range f.subs {
		f.deliver(s)
	}
	if f.ring != nil {
		f.sendAll()
	}
}

// uringEntries bounds the sends in one submission; more subscribers take
// more submissions.
const uringEntries = 1024

// sendAll submits one send for every subscriber with bytes waiting, in as
// few io_uring_enter calls as the ring allows, and settles the results as
// flush would.
func (f *Forwarder) sendAll() {
	var batch []*subscriber
	settle := func() {
		if len(batch) == 0 {
			return
		}
		if err := f.ring.SubmitAndWait(len(batch)); err != nil {
			fmt.Fprintf(f.log, "fanout: %v\n", err)
		}
		f.ring.Reap(func(ud uint64, res int32) {
			s := batch[ud]
			switch {
			case res >= 0:
				s.head += int(res)
				s.account(int(res))
				if s.queued() > 0 || s.gapDue() {
					f.flush(s) // the rest, or a pending gap marker
				} else {
					s.queue, s.head = s.queue[:0], 0
				}
			case res == -int32(unix.EAGAIN) || res == -int32(unix.EINTR):
				s.writable = false
				f.watch(s)
			default:
				f.drop(s, "connection closed")
			}
		})
		batch = batch[:0]
	}
	for _, s := range f.subs {
		if !s.writable || s.queued() == 0 {
			continue
		}
		if !f.ring.Prep(uring.OpSend, s.fd, s.queue[s.head:], unix.MSG_DONTWAIT|unix.MSG_NOSIGNAL, uint64(len(batch))) {
			settle()
			f.ring.Prep(uring.OpSend, s.fd, s.queue[s.head:], unix.MSG_DONTWAIT|unix.MSG_NOSIGNAL, uint64(len(batch)))
		}
		batch = append(batch, s)
	}
	settle()
}

func (f *Forwarder) deliver(s *subscriber) {
	for _, msg := range f.batch {
		if s.enqueue(msg, f.cfg.Queue) {
			if f.cfg.Path == PathPerMessage && s.writable {
				if !f.flush(s) {
					return
				}
			}
			continue
		}
		if f.cfg.Slow == SlowDisconnect {
			f.totals.SlowDropped++
			f.drop(s, fmt.Sprintf("slow: more than %d bytes waiting", f.cfg.Queue))
			return
		}
		s.dropped++
		s.gap++
	}
	if s.writable && f.ring == nil {
		f.flush(s)
	}
	// Not writable: EPOLLOUT will flush. With the ring, sendAll does.
}

// flush writes what it can and watches for writability if some is left.
// It returns false if the subscriber is gone.
func (f *Forwarder) flush(s *subscriber) bool {
	if err := s.flush(); err != nil {
		f.drop(s, "connection closed")
		return false
	}
	if !s.writable {
		f.watch(s)
	}
	return true
}

// watch sets the epoll interest for a subscriber: always readable (to see
// it leave), writable while bytes wait.
func (f *Forwarder) watch(s *subscriber) {
	// After the subscriber's FIN, input and RDHUP would stay ready for
	// good: only errors (always reported) and writability matter then.
	var ev uint32
	if !s.eof {
		ev |= unix.EPOLLIN | unix.EPOLLRDHUP
	}
	if !s.writable {
		ev |= unix.EPOLLOUT
	}
	// s.fd stays registered while s is a subscriber: MOD fails only on a
	// closed epoll, after Close.
	_ = unix.EpollCtl(f.ep, unix.EPOLL_CTL_MOD, s.fd, &unix.EpollEvent{Events: ev, Fd: int32(s.fd)})
}

func (f *Forwarder) accept() {
	for {
		fd, sa, err := unix.Accept4(f.ln, unix.SOCK_NONBLOCK|unix.SOCK_CLOEXEC)
		if err != nil {
			return
		}
		// The loop batches by itself; Nagle would hold the next batch for
		// an ACK that the subscriber may delay by 40 ms. The kernel path
		// hands TCP one message at a time, and there Nagle is what
		// coalesces them under load (2.5x the deliveries, no worse p99 in
		// the benchmark).
		if f.kern == nil {
			_ = unix.SetsockoptInt(fd, unix.IPPROTO_TCP, unix.TCP_NODELAY, 1)
		}
		if f.cfg.Path == PathZeroCopy {
			// Without it MSG_ZEROCOPY is ignored and the path copies.
			_ = unix.SetsockoptInt(fd, unix.SOL_SOCKET, unix.SO_ZEROCOPY, 1)
		}
		s := &subscriber{fd: fd, framing: f.cfg.Framing, peer: addrOf(sa), since: time.Now(), writable: true, feed: -1}
		if f.kern != nil {
			if err := f.kern.attach(s); err != nil {
				fmt.Fprintf(f.log, "fanout: subscriber %s refused: %v\n", s.peer, err)
				unix.Close(fd)
				continue
			}
		}
		if err := unix.EpollCtl(f.ep, unix.EPOLL_CTL_ADD, fd, &unix.EpollEvent{Events: unix.EPOLLIN | unix.EPOLLRDHUP, Fd: int32(fd)}); err != nil {
			if f.kern != nil {
				f.kern.detach(s)
			}
			unix.Close(fd)
			continue
		}
		f.subs[fd] = s
		f.totals.Connected++
		fmt.Fprintf(f.log, "fanout: subscriber %s connected (%d now)\n", s.peer, len(f.subs))
	}
}

func (f *Forwarder) subscriberEvent(s *subscriber, ev uint32) {
	if ev&unix.EPOLLOUT != 0 {
		s.writable = true
		if err := s.flush(); err != nil {
			f.drop(s, "connection closed")
			return
		}
		f.watch(s)
	}
	if ev&(unix.EPOLLIN|unix.EPOLLRDHUP) != 0 && !s.eof {
		// Subscribers have nothing to say; what they send is discarded.
		var b [512]byte
		n, _, err := unix.Recvfrom(s.fd, b[:], unix.MSG_DONTWAIT)
		switch {
		case n == 0 && err == nil:
			// Half-closed: it may still read. Stop watching input.
			s.eof = true
			f.watch(s)
		case err != nil && err != unix.EAGAIN && err != unix.EINTR:
			f.drop(s, "connection reset")
			return
		}
	}
	if ev&unix.EPOLLERR != 0 && f.cfg.Path == PathZeroCopy {
		// Completions are reported as errors; only a real one ends it.
		if err := f.reapCompletions(s); err != nil {
			f.drop(s, "connection closed")
			return
		}
		ev &^= unix.EPOLLERR
	}
	if ev&(unix.EPOLLERR|unix.EPOLLHUP) != 0 {
		f.drop(s, "connection closed")
	}
}

func (f *Forwarder) drop(s *subscriber, why string) {
	if f.kern != nil {
		c := f.kern.counts(s)
		s.msgs, s.bytes, s.dropped = c.msgs, c.bytes, c.dropped
		f.kern.detach(s)
	}
	f.releaseZeroCopy(s)
	_ = unix.EpollCtl(f.ep, unix.EPOLL_CTL_DEL, s.fd, nil)
	unix.Close(s.fd)
	delete(f.subs, s.fd)
	f.totals.Disconnected++
	fmt.Fprintf(f.log, "fanout: subscriber %s disconnected (%s) after %d messages, %d dropped\n", s.peer, why, s.msgs, s.dropped)
}

// dropSlowKernel disconnects the subscribers the verdict flagged: slow ones
// (under the disconnect policy) and any whose stream it could not frame.
func (f *Forwarder) dropSlowKernel() {
	for _, s := range f.subs {
		switch c := f.kern.counts(s); {
		case c.failed:
			f.drop(s, "the kernel could not add the framing to a message")
		case c.slow:
			f.totals.SlowDropped++
			f.drop(s, fmt.Sprintf("slow: its backlog passed %d bytes beyond its send buffer", f.cfg.Queue))
		}
	}
}

// limitName says what bounds a datagram's size, for the log.
func (f *Forwarder) limitName() string {
	if f.kern != nil && f.maxMsg == kernelMaxMessage {
		return "the kernel path (IPv4 multicast on loopback)"
	}
	return "framing " + f.cfg.Framing.String()
}
