package fanout

import (
	"errors"
	"net/netip"
	"time"

	"golang.org/x/sys/unix"
)

// subscriber is one TCP connection and what waits to be written to it.
type subscriber struct {
	fd      int
	framing Framing
	peer    netip.AddrPort
	since   time.Time

	queue  []byte // bytes not yet accepted by the socket, from head
	head   int
	frames []int // lengths of the frames in queue, oldest first (first may be partly sent)
	sentOf int   // bytes of frames[0] already sent

	msgs, bytes, dropped uint64
	gap                  uint32 // messages lost since the last gap marker
	writable             bool   // false while waiting for EPOLLOUT
	eof                  bool   // the subscriber shut down its sending side

	// PathKernel: the subscriber's slot in the BPF maps and its feed socket
	// (-1 on other paths).
	slot   uint32
	feed   int
	cookie uint64

	// PathZeroCopy: sends whose buffers the kernel still holds, and the
	// number the next one gets.
	zc     []zsend
	zcNext uint32
}

func (s *subscriber) queued() int { return len(s.queue) - s.head }

func (s *subscriber) gapDue() bool { return s.gap > 0 && s.framing != FramingNone }

// enqueue adds a message (or reports that the queue bound forbids it). A
// gap marker, if due, goes first.
func (s *subscriber) enqueue(msg []byte, bound int) bool {
	f := s.framing
	need := frameLen(f, len(msg))
	if s.gap > 0 {
		need += gapLen(f)
	}
	if s.queued()+need > bound {
		return false
	}
	if s.gap > 0 && f != FramingNone {
		s.queue = appendGap(s.queue, f, s.gap)
		s.frames = append(s.frames, -gapLen(f)) // negative: not a message
		s.gap = 0
	}
	s.queue = appendFrame(s.queue, f, msg)
	s.frames = append(s.frames, frameLen(f, len(msg)))
	return true
}

// errGone means the subscriber's connection failed (reset, closed).
var errGone = errors.New("connection closed")

// flush writes what it can without blocking. It returns errGone when the
// connection is dead.
func (s *subscriber) flush() error {
	for s.queued() > 0 || s.gapDue() {
		if s.queued() == 0 {
			// Drained with losses pending: say so now rather than with
			// the next message, which may be long in coming.
			s.queue = appendGap(s.queue[:0], s.framing, s.gap)
			s.head = 0
			s.frames = append(s.frames, -gapLen(s.framing))
			s.gap = 0
		}
		n, err := unix.SendmsgN(s.fd, s.queue[s.head:], nil, nil, unix.MSG_DONTWAIT|unix.MSG_NOSIGNAL)
		if err == unix.EINTR {
			continue
		}
		if err == unix.EAGAIN {
			s.writable = false
			return nil
		}
		if err != nil {
			return errGone
		}
		s.head += n
		s.account(n)
	}
	// Empty: reuse the buffer from its start.
	s.queue, s.head = s.queue[:0], 0
	return nil
}

// account moves n sent bytes through the frame list, counting whole
// messages delivered.
func (s *subscriber) account(n int) {
	for n > 0 && len(s.frames) > 0 {
		l := s.frames[0]
		size := l
		if size < 0 {
			size = -size
		}
		take := min(n, size-s.sentOf)
		s.sentOf += take
		n -= take
		if s.sentOf == size {
			if l > 0 {
				s.msgs++
				s.bytes += uint64(l)
			}
			s.frames = s.frames[1:]
			s.sentOf = 0
		}
	}
	if s.head > 1<<20 && s.head > len(s.queue)/2 {
		s.queue = append(s.queue[:0], s.queue[s.head:]...)
		s.head = 0
	}
}
