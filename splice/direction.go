package splice

import (
	"errors"
	"fmt"
	"net"
	"os"
	"runtime"
	"sync"
	"sync/atomic"
	"syscall"
	"time"

	"golang.org/x/sys/unix"
)

// direction moves the bytes that arrive on src out through dst. While the
// verdict forwards them the goroutine sleeps in the poller: src becomes
// readable only when the verdict passed bytes to user space, or at EOF or
// error.
type direction struct {
	p         *Pair
	name      string // "a->b" or "b->a", for errors
	src, dst  *net.TCPConn
	srcRaw    syscall.RawConn
	srcFD     int
	dstFD     int
	slot      uint32
	cookie    uint64
	shared    *spliceSpliceDir
	dstOrigin uint64 // sentSoFar(dst) when joined
	pending   []byte // read from src before the join, or written only in part before a hand-over: sent first
	ended     bool   // EOF forwarded (set by run)
	userRead  atomic.Uint64
	userWrote atomic.Uint64
}

var bufPool = sync.Pool{New: func() any { b := make([]byte, 256<<10); return &b }}

func newDirection(p *Pair, name string, src, dst *net.TCPConn, slot, peerSlot uint32) (*direction, error) {
	d := &direction{p: p, name: name, src: src, dst: dst, slot: slot}
	var err error
	if d.srcFD, err = socketFD(src); err != nil {
		return nil, fmt.Errorf("splice: %w", err)
	}
	if d.dstFD, err = socketFD(dst); err != nil {
		return nil, fmt.Errorf("splice: %w", err)
	}
	if d.srcRaw, err = src.SyscallConn(); err != nil {
		return nil, fmt.Errorf("splice: %w", err)
	}
	if d.cookie, err = unix.GetsockoptUint64(d.srcFD, unix.SOL_SOCKET, unix.SO_COOKIE); err != nil {
		return nil, fmt.Errorf("splice: SO_COOKIE: %w", err)
	}
	if d.dstOrigin, err = sentSoFar(d.dstFD); err != nil {
		return nil, fmt.Errorf("splice: socket is not a connected TCP socket: %w", err)
	}
	d.shared = p.s.dir(slot)
	*d.shared = spliceSpliceDir{Peer: peerSlot, MaxInflight: p.s.maxInflight}
	// Start in user mode: the hand-back below first makes sure no byte
	// queued before the join is left behind the kernel's.
	atomic.StoreUint64(&d.shared.State, dirUser)
	return d, nil
}

func (d *direction) stats() Stats {
	k := atomic.LoadUint64(&d.shared.Redirected)
	return Stats{
		Bytes:     d.userWrote.Load() + k,
		Kernel:    k,
		ToUser:    atomic.LoadUint32(&d.shared.ToUser),
		Repeated:  atomic.LoadUint32(&d.shared.Overlaps),
		KernelNow: !d.p.userOnly && atomic.LoadUint64(&d.shared.State)&dirUser == 0,
	}
}

func (d *direction) run() error {
	if len(d.pending) > 0 {
		b := d.pending
		d.pending = nil
		if err := d.write(b); err != nil {
			return d.wrap("write", err)
		}
	}
	var eofAt time.Time
	for eof := 0; ; {
		buf, n, err := d.read()
		if err != nil {
			return d.wrap("read", err)
		}
		if n == 0 && !d.p.userOnly && !d.allSeenRead(atomic.LoadUint64(&d.shared.State)) {
			// EOF can come before bytes the verdict passed just ahead
			// of the FIN: they wait in the psock's backlog when it was
			// busy sending for the other direction. Read on, but do
			// not hide bytes that never come.
			if d.p.frozen.Load() {
				return errFrozen
			}
			if eof == 0 {
				eofAt = time.Now()
			} else if lost := d.p.s.lostAfter(); time.Since(eofAt) > lost {
				state := atomic.LoadUint64(&d.shared.State)
				return fmt.Errorf("%s: EOF, but bytes the kernel took never arrived within %v (it saw %d, %d read here, %d redirected)",
					d.name, lost, state&^dirUser, d.userRead.Load(), atomic.LoadUint64(&d.shared.Redirected))
			}
			backoff(eof)
			eof++
			continue
		}
		if n == 0 {
			// A reset can read as EOF here: tcp_bpf_recvmsg_parser checks
			// SOCK_DONE before sk_err. The error is still pending.
			if e, _ := unix.GetsockoptInt(d.srcFD, unix.SOL_SOCKET, unix.SO_ERROR); e != 0 {
				return fmt.Errorf("%s: read: %w", d.name, unix.Errno(e))
			}
			if err := d.finish(); err != nil {
				return d.wrap("forward EOF", err)
			}
			d.ended = true
			return nil
		}
		err = d.write((*buf)[:n])
		bufPool.Put(buf)
		if err == nil {
			err = d.drainAndHandBack()
		}
		if err != nil {
			return d.wrap("write", err)
		}
	}
}

// read waits for bytes the verdict gave to user space, or EOF (0 bytes).
// Each time src runs dry it tries to hand the direction back to the kernel.
func (d *direction) read() (*[]byte, int, error) {
	for {
		buf, n, err := d.readOnce()
		if err != nil || n == 0 {
			return buf, n, err
		}
		if n, err = d.account(buf, n); err != nil || n > 0 {
			return buf, n, err
		}
	}
}

// account counts n bytes read into buf and cuts the repeats out of them; it
// returns how many are left at the front of buf. With none left (or an
// error) buf has gone back to the pool.
func (d *direction) account(buf *[]byte, n int) (int, error) {
	pos := d.userRead.Load() + atomic.LoadUint64(&d.shared.Redirected)
	d.userRead.Add(uint64(n))
	d.leaveOutUnseen()
	if atomic.LoadUint32(&d.shared.Broken) != 0 {
		bufPool.Put(buf)
		return 0, errors.New("more retransmissions overlapping received bytes at once than the verdict can track")
	}
	kept := d.dropRepeated((*buf)[:n], pos)
	if len(kept) == 0 {
		bufPool.Put(buf)
	}
	return len(kept), nil
}

func (d *direction) readOnce() (*[]byte, int, error) {
	var buf *[]byte
	var n int
	var rerr error
	err := d.srcRaw.Read(func(fd uintptr) bool {
		buf = bufPool.Get().(*[]byte)
		n, rerr = unix.Read(int(fd), *buf)
		if rerr == unix.EAGAIN || rerr == unix.EINTR {
			bufPool.Put(buf)
			buf = nil
			d.handBack()
			return false
		}
		return true
	})
	if err == nil {
		err = rerr
	}
	if err != nil {
		if buf != nil {
			bufPool.Put(buf)
		}
		return nil, 0, err
	}
	if n == 0 {
		bufPool.Put(buf)
		return nil, 0, nil
	}
	return buf, n, nil
}

// leaveOutUnseen takes out of userRead the bytes read that the verdict never
// saw: a send that bypass redirected to src (an sk_msg verdict, straight
// into its psock's queue) having looked before the join was there to see
// (bpf/bypass/redirect.h: psock_joined). They come at the join's start only, and
// would leave allSeenRead false for good: no hand-back, and EOF taken for
// bytes lost. The verdict counts a byte before it can be read, and counts
// a redirect before adding it to Redirected (loaded first here), so any
// excess of what was read and redirected over what it saw is theirs.
func (d *direction) leaveOutUnseen() {
	if d.p.userOnly {
		return
	}
	redirected := atomic.LoadUint64(&d.shared.Redirected)
	seen := atomic.LoadUint64(&d.shared.State) &^ dirUser
	if excess := (d.userRead.Load() + redirected - seen) &^ dirUser; excess != 0 && excess < dirUser/2 {
		d.userRead.Add(-excess)
	}
}

// dropRepeated removes from b the bytes the verdict saw twice (see
// seen_before in bpf/splice.c). b holds passed bytes whose first byte the
// verdict counted at pos; the ring lists repeats in stream order.
func (d *direction) dropRepeated(b []byte, pos uint64) []byte {
	end := pos + uint64(len(b))
	out := b[:0]
	cursor := pos
	for {
		tail := atomic.LoadUint32(&d.shared.SkipTail)
		if tail == atomic.LoadUint32(&d.shared.SkipHead) {
			break
		}
		sk := &d.shared.Skips[tail%uint32(len(d.shared.Skips))]
		from, to := sk.Pos, sk.Pos+uint64(sk.Len)
		if from >= end {
			break
		}
		if from > cursor {
			out = append(out, b[cursor-pos:from-pos]...)
		}
		cursor = max(cursor, min(to, end))
		if to > end {
			break // the rest of this repeat comes with the next read
		}
		atomic.AddUint32(&d.shared.SkipTail, 1)
	}
	return append(out, b[cursor-pos:]...)
}

// write sends bytes read in user space, after every byte the kernel
// forwarded before them.
func (d *direction) write(b []byte) error {
	n := 0
	err := d.waitPeerFlushed()
	if err == nil {
		n, err = d.dst.Write(b)
		d.userWrote.Add(uint64(n))
	}
	if err != nil && d.p.frozen.Load() {
		// Stopped for a hand-over before or while writing: the next
		// owner sends the rest first.
		d.pending = append([]byte{}, b[n:]...)
		return errFrozen
	}
	return err
}

// dstHasRoom says whether dst holds at most a quarter of what the verdict
// lets the kernel keep in flight, so that a hand-back has room to run. It
// does not wait: while dst stays fuller, user space copies like any proxy,
// which keeps a long path's pipe as full as TCP would.
func (d *direction) dstHasRoom() bool {
	sndbuf, err := unix.GetsockoptInt(d.dstFD, unix.SOL_SOCKET, unix.SO_SNDBUF)
	if err != nil {
		return false
	}
	room := min(uint32(sndbuf)/2, atomic.LoadUint32(&d.shared.MaxInflight)) / 4
	outq, err := unix.IoctlGetInt(d.dstFD, unix.SIOCOUTQ)
	return err == nil && uint32(outq) <= room
}

// errFrozen ends a direction's goroutine for a hand-over; nothing is reset.
var errFrozen = errors.New("handed over")

// wrap names the direction and the step in an error, leaving errFrozen
// as it is.
func (d *direction) wrap(step string, err error) error {
	if d.p.frozen.Load() && (errors.Is(err, errFrozen) || errors.Is(err, os.ErrDeadlineExceeded)) {
		return errFrozen
	}
	return fmt.Errorf("%s: %s: %w", d.name, step, err)
}

// DefaultLostAfter bounds the wait, after EOF, for passed bytes to arrive.
const DefaultLostAfter = 5 * time.Second

// drainWindow is the receive window while draining: small enough that the
// sender pauses within microseconds, at least a few segments so that ACKs
// are not held back (a window under one MSS waits for the delayed-ACK timer).
const drainWindow = 256 << 10

// drainAndHandBack runs after a user-space write. If dst has room again, it
// narrows src's receive window to drainWindow, so a sender that never
// pauses cannot keep src from running dry, copies what src holds, and hands
// the direction back to the kernel. Without it a busy direction, once flow
// control gave it to user space, would stay there. The window is restored
// on the way out, whether or not the hand-back succeeded.
func (d *direction) drainAndHandBack() error {
	if d.p.userOnly || !d.dstHasRoom() {
		return nil
	}
	clamp, err := unix.GetsockoptInt(d.srcFD, unix.IPPROTO_TCP, unix.TCP_WINDOW_CLAMP)
	if err != nil || unix.SetsockoptInt(d.srcFD, unix.IPPROTO_TCP, unix.TCP_WINDOW_CLAMP, drainWindow) != nil {
		return nil
	}
	handed := false
	defer func() {
		_ = unix.SetsockoptInt(d.srcFD, unix.IPPROTO_TCP, unix.TCP_WINDOW_CLAMP, clamp)
		// Announce the wider window now rather than with a delayed ACK.
		// Not once handed back: the verdict's reads announce it as they
		// take the queue, and on 6.18 TCP_QUICKACK on a socket the
		// verdict reads can trip the kernel's "cleanup rbuf bug"
		// warning (its copied_seq seen ahead of rcv_nxt).
		if !handed {
			_ = unix.SetsockoptInt(d.srcFD, unix.IPPROTO_TCP, unix.TCP_QUICKACK, 1)
		}
	}()
	for range 256 {
		buf := bufPool.Get().(*[]byte)
		n, err := unix.Read(d.srcFD, *buf)
		if err == unix.EAGAIN || err == unix.EINTR {
			bufPool.Put(buf)
			if d.handBack() {
				handed = true
				return nil
			}
			continue
		}
		if err != nil || n == 0 {
			// EOF is seen again by the next read; an error is not
			// (reading it clears it).
			bufPool.Put(buf)
			return err
		}
		if n, err = d.account(buf, n); err != nil {
			return err
		}
		if n == 0 {
			continue
		}
		err = d.write((*buf)[:n])
		bufPool.Put(buf)
		if err != nil {
			return err
		}
	}
	return nil
}

// takeQueued reads what src holds unread before the join; run sends it
// first. (The verdict reads whole skbs from the receive queue, including
// bytes of one the caller has partly read, which would go out twice.)
func (d *direction) takeQueued() error {
	buf := make([]byte, 64<<10)
	for {
		n, err := unix.Read(d.srcFD, buf)
		if err == unix.EAGAIN || err == nil && n == 0 {
			// EOF is seen again, and forwarded, once joined.
			return nil
		}
		if err != nil {
			return fmt.Errorf("splice: read queued bytes: %w", err)
		}
		d.pending = append(d.pending, buf[:n]...)
	}
}

// allSeenRead says whether every byte the verdict has seen was either
// forwarded by the kernel or read by us; state is a snapshot of the state word.
func (d *direction) allSeenRead(state uint64) bool {
	seen := state &^ dirUser
	return seen == (d.userRead.Load()+atomic.LoadUint64(&d.shared.Redirected))&^dirUser
}

// peerFlushed says whether dst's psock has sent on everything the kernel
// redirected to it (nothing of ours waits in its backlog).
func (d *direction) peerFlushed() (bool, error) {
	sent, err := sentSoFar(d.dstFD)
	if err != nil {
		return false, err
	}
	return sent-d.dstOrigin >= d.userWrote.Load()+atomic.LoadUint64(&d.shared.Redirected), nil
}

// handBack gives the direction to the kernel if we have read every byte the
// verdict passed to us and dst holds nothing of the kernel's in its backlog.
// The compare-and-swap fails if a verdict ran since state was read.
func (d *direction) handBack() bool {
	if d.p.userOnly {
		return false
	}
	state := atomic.LoadUint64(&d.shared.State)
	if state&dirUser == 0 {
		return true
	}
	if !d.allSeenRead(state) {
		return false
	}
	if ok, err := d.peerFlushed(); err != nil || !ok {
		return false
	}
	atomic.StoreUint32(&d.shared.BaseValid, 0)
	return atomic.CompareAndSwapUint64(&d.shared.State, state, state&^dirUser)
}

// waitPeerFlushed waits until the kernel's redirected bytes have left dst's
// backlog. The psock worker usually takes microseconds; when dst's buffer is
// full it retries once a jiffy.
func (d *direction) waitPeerFlushed() error {
	if d.p.userOnly {
		return nil
	}
	for i := 0; ; i++ {
		ok, err := d.peerFlushed()
		if err != nil {
			return err
		}
		if ok {
			return nil
		}
		if d.p.aborted.Load() {
			return net.ErrClosed
		}
		if d.p.frozen.Load() {
			return errFrozen
		}
		backoff(i)
	}
}

// finish forwards EOF once every byte of src has been read or redirected:
// after the kernel's last bytes have left dst's backlog, dst sends FIN.
func (d *direction) finish() error {
	if err := d.waitPeerFlushed(); err != nil {
		return err
	}
	if err := d.dst.CloseWrite(); err != nil && !errors.Is(err, unix.ENOTCONN) {
		return err
	}
	return nil
}

// backoff spins briefly, then sleeps up to a millisecond.
func backoff(i int) {
	switch {
	case i < 16:
		runtime.Gosched()
	case i < 32:
		time.Sleep(20 * time.Microsecond)
	default:
		time.Sleep(time.Millisecond)
	}
}
