package fanout

import (
	"unsafe"

	"golang.org/x/sys/unix"
)

// PathZeroCopy: every subscriber that has nothing queued is sent the same
// framed batch, from one buffer, with MSG_ZEROCOPY: no per-subscriber copy
// in user space, and on a real NIC none in the kernel either (over loopback
// the kernel copies on delivery and says so in the completion). The buffer
// stays untouched until every send that references it is reported complete
// on the socket's error queue. A subscriber with bytes queued takes the
// copying batch path until it has caught up.

// zbuf is one framed batch shared by the zero-copy sends that reference it.
type zbuf struct {
	b    []byte
	refs int
}

// zsend is one zero-copy send in flight: the kernel numbers them per
// socket, from 0, and reports them complete in ranges.
type zsend struct {
	id  uint32
	buf *zbuf
}

// zpool recycles batch buffers once no send references them.
type zpool struct{ free []*zbuf }

func (p *zpool) get(size int) *zbuf {
	for i := len(p.free) - 1; i >= 0; i-- {
		if z := p.free[i]; cap(z.b) >= size {
			p.free = append(p.free[:i], p.free[i+1:]...)
			z.b = z.b[:0]
			return z
		}
	}
	return &zbuf{b: make([]byte, 0, max(size, 64<<10))}
}

func (p *zpool) put(z *zbuf) {
	z.refs--
	if z.refs == 0 && len(p.free) < 64 {
		p.free = append(p.free, z)
	}
}

// deliverShared hands one framed batch to every subscriber: by zero-copy
// send to those with nothing queued, through their queue to the others.
func (f *Forwarder) deliverShared() {
	size := 0
	for _, m := range f.batch {
		size += frameLen(f.cfg.Framing, len(m))
	}
	z := f.zc.get(size)
	lens := make([]int, len(f.batch))
	for i, m := range f.batch {
		z.b = appendFrame(z.b, f.cfg.Framing, m)
		lens[i] = frameLen(f.cfg.Framing, len(m))
	}
	z.refs++ // ours, while sending
	for _, s := range f.subs {
		if !s.writable || s.queued() > 0 || s.gapDue() {
			f.deliver(s)
			continue
		}
		f.sendShared(s, z, lens)
	}
	f.zc.put(z)
}

// sendShared sends the batch z to s without copying it; what the socket did
// not take is queued (copied) as on the batch path.
func (f *Forwarder) sendShared(s *subscriber, z *zbuf, lens []int) {
	var n int
	var err error
	for {
		n, err = unix.SendmsgN(s.fd, z.b, nil, nil, unix.MSG_ZEROCOPY|unix.MSG_DONTWAIT|unix.MSG_NOSIGNAL)
		if err != unix.EINTR {
			break
		}
	}
	switch {
	case err == unix.EAGAIN || err == unix.ENOBUFS || (err == nil && n == 0):
		// Full, or out of the memory zero-copy needs (optmem): copy, as
		// the batch path does, with its bound.
		if err == unix.EAGAIN {
			s.writable = false
			f.watch(s) // EPOLLOUT flushes what deliver queues
		}
		f.deliver(s)
		return
	case err != nil:
		f.drop(s, "connection closed")
		return
	}
	z.refs++
	f.totals.ZeroCopySends++
	s.zc = append(s.zc, zsend{id: s.zcNext, buf: z})
	s.zcNext++
	s.frames = append(s.frames, lens...)
	s.account(n)
	if n < len(z.b) {
		s.queue = append(s.queue, z.b[n:]...)
		s.writable = false
		f.watch(s)
	}
}

// reapCompletions reads the zero-copy completions on s's error queue and
// lets go of the buffers they release. It returns the socket's pending
// error, if any.
func (f *Forwarder) reapCompletions(s *subscriber) error {
	var oob [256]byte
	for {
		_, oobn, _, _, err := unix.Recvmsg(s.fd, nil, oob[:], unix.MSG_ERRQUEUE|unix.MSG_DONTWAIT)
		if err == unix.EINTR {
			continue
		}
		if err != nil {
			break
		}
		msgs, err := unix.ParseSocketControlMessage(oob[:oobn])
		if err != nil {
			continue
		}
		for _, m := range msgs {
			isErr := (m.Header.Level == unix.SOL_IP && m.Header.Type == unix.IP_RECVERR) ||
				(m.Header.Level == unix.SOL_IPV6 && m.Header.Type == unix.IPV6_RECVERR)
			if !isErr || len(m.Data) < int(unsafe.Sizeof(unix.SockExtendedErr{})) {
				continue
			}
			ee := (*unix.SockExtendedErr)(unsafe.Pointer(&m.Data[0]))
			if ee.Origin == unix.SO_EE_ORIGIN_ZEROCOPY {
				n := f.complete(s, ee.Info, ee.Data)
				f.totals.ZeroCopyDone += uint64(n)
				if ee.Code&unix.SO_EE_CODE_ZEROCOPY_COPIED != 0 {
					f.totals.ZeroCopyCopied += uint64(n)
				}
			}
		}
	}
	errno, err := unix.GetsockoptInt(s.fd, unix.SOL_SOCKET, unix.SO_ERROR)
	if err != nil {
		return err
	}
	if errno != 0 {
		return unix.Errno(errno)
	}
	return nil
}

// complete releases the sends lo..hi (inclusive; the numbers wrap) and
// returns how many it found.
func (f *Forwarder) complete(s *subscriber, lo, hi uint32) int {
	kept := s.zc[:0]
	for _, z := range s.zc {
		if z.id-lo <= hi-lo {
			f.zc.put(z.buf)
		} else {
			kept = append(kept, z)
		}
	}
	n := len(s.zc) - len(kept)
	s.zc = kept
	return n
}

// releaseZeroCopy is for a subscriber about to be closed: its unfinished
// sends still point into shared buffers, so the socket is reset (which
// frees its queued skbs at once) rather than left to send them on after
// close, and the buffers are released.
func (f *Forwarder) releaseZeroCopy(s *subscriber) {
	if len(s.zc) == 0 {
		return
	}
	_ = f.reapCompletions(s)
	if len(s.zc) > 0 {
		_ = unix.SetsockoptLinger(s.fd, unix.SOL_SOCKET, unix.SO_LINGER, &unix.Linger{Onoff: 1, Linger: 0})
		for _, z := range s.zc {
			f.zc.put(z.buf)
		}
		s.zc = nil
	}
}
