package testenv

import (
	"fmt"
	"io"
	"net"
	"sync/atomic"
	"syscall"
	"unsafe"

	"golang.org/x/sys/unix"
)

// An io_uring with one request in flight at a time, as much of it as a
// test needs to splice or receive through io_uring (IORING_OP_SPLICE,
// IORING_OP_RECV) the way a program built on liburing does, with its
// requests run inline, in io-wq workers or by an SQPOLL thread. x86-64
// layouts (include/uapi/linux/io_uring.h).
type ring struct {
	fd             int
	sqpoll         bool  // a kernel thread takes the requests (IORING_SETUP_SQPOLL)
	sqeFlags       uint8 // set on every request (IOSQE_ASYNC: run it in an io-wq worker)
	sq, cq, sqes   []byte
	sqTail         *uint32 // one request at a time: the head is never needed
	sqMask         uint32
	sqArray        []byte
	cqHead, cqTail *uint32
	cqMask         uint32
	cqes           uint32 // offset of the completions in cq
}

const (
	ioringOffSQRing   = 0
	ioringOffCQRing   = 0x8000000
	ioringOffSQEs     = 0x10000000
	ioringOpSplice    = 30
	ioringOpRecv      = 27
	ioringEnterWait   = 1 // IORING_ENTER_GETEVENTS
	ioringEnterWake   = 2 // IORING_ENTER_SQ_WAKEUP
	ioringSetupSQPoll = 2 // IORING_SETUP_SQPOLL
	iosqeAsync        = 1 << 4
	ioringParamsSize  = 120
	ioringSQESize     = 64
	ioringCQESize     = 16
)

func u32At(b []byte, off uint32) *uint32 { return (*uint32)(unsafe.Pointer(&b[off])) }

func newRing() (*ring, error) { return newRingWith(0) }

// newRingWith sets the ring up with IORING_SETUP_* flags.
func newRingWith(flags uint32) (*ring, error) {
	var p [ioringParamsSize]byte
	*(*uint32)(unsafe.Pointer(&p[8])) = flags
	if flags&ioringSetupSQPoll != 0 {
		*(*uint32)(unsafe.Pointer(&p[16])) = 1000 // sq_thread_idle, ms
	}
	fd, _, errno := unix.Syscall(unix.SYS_IO_URING_SETUP, 2, uintptr(unsafe.Pointer(&p[0])), 0)
	if errno != 0 {
		return nil, fmt.Errorf("io_uring_setup: %w", errno)
	}
	r := &ring{fd: int(fd), sqpoll: flags&ioringSetupSQPoll != 0}
	le := func(off int) uint32 { return *(*uint32)(unsafe.Pointer(&p[off])) }
	sqEntries, cqEntries := le(0), le(4)
	// struct io_sqring_offsets at 40, io_cqring_offsets at 80.
	sqTail, sqMask, sqArray := le(44), le(48), le(64)
	cqHead, cqTail, cqMask, cqes := le(80), le(84), le(88), le(100)
	mmap := func(off int64, size uint32) ([]byte, error) {
		return unix.Mmap(r.fd, off, int(size), unix.PROT_READ|unix.PROT_WRITE, unix.MAP_SHARED|unix.MAP_POPULATE)
	}
	var err error
	if r.sq, err = mmap(ioringOffSQRing, sqArray+sqEntries*4); err != nil {
		r.close()
		return nil, err
	}
	if r.cq, err = mmap(ioringOffCQRing, cqes+cqEntries*ioringCQESize); err != nil {
		r.close()
		return nil, err
	}
	if r.sqes, err = mmap(ioringOffSQEs, sqEntries*ioringSQESize); err != nil {
		r.close()
		return nil, err
	}
	r.sqTail, r.sqMask = u32At(r.sq, sqTail), *u32At(r.sq, sqMask)
	r.sqArray = r.sq[sqArray:]
	r.cqHead, r.cqTail, r.cqMask, r.cqes = u32At(r.cq, cqHead), u32At(r.cq, cqTail), *u32At(r.cq, cqMask), cqes
	return r, nil
}

func (r *ring) close() {
	for _, m := range [][]byte{r.sq, r.cq, r.sqes} {
		if m != nil {
			_ = unix.Munmap(m)
		}
	}
	_ = unix.Close(r.fd)
}

// splice moves up to n bytes from in to out (one a pipe) as IORING_OP_SPLICE
// and returns the request's result: bytes moved, or a negative errno.
func (r *ring) splice(in, out int, n uint32) (int32, error) {
	res, _, err := r.run(func(sqe []byte) {
		sqe[0] = ioringOpSplice
		*(*int32)(unsafe.Pointer(&sqe[4])) = int32(out)
		*(*int64)(unsafe.Pointer(&sqe[8])) = -1  // off_out: none (a pipe or a socket)
		*(*int64)(unsafe.Pointer(&sqe[16])) = -1 // off_in
		*(*uint32)(unsafe.Pointer(&sqe[24])) = n
		*(*int32)(unsafe.Pointer(&sqe[44])) = int32(in)
	})
	return res, err
}

// recv reads into buf as IORING_OP_RECV and returns the request's result
// (bytes read, or a negative errno) and its completion's flags.
func (r *ring) recv(fd int, buf []byte) (int32, uint32, error) {
	return r.run(func(sqe []byte) {
		sqe[0] = ioringOpRecv
		*(*int32)(unsafe.Pointer(&sqe[4])) = int32(fd)
		*(*uint64)(unsafe.Pointer(&sqe[16])) = uint64(uintptr(unsafe.Pointer(&buf[0])))
		*(*uint32)(unsafe.Pointer(&sqe[24])) = uint32(len(buf))
	})
}

// run submits the one request fill describes and waits for its completion:
// its result and flags.
func (r *ring) run(fill func(sqe []byte)) (int32, uint32, error) {
	tail := atomic.LoadUint32(r.sqTail)
	idx := tail & r.sqMask
	sqe := r.sqes[idx*ioringSQESize : (idx+1)*ioringSQESize]
	clear(sqe)
	fill(sqe)
	sqe[1] = r.sqeFlags
	*u32At(r.sqArray, idx*4) = idx
	atomic.StoreUint32(r.sqTail, tail+1)
	submit, enter := uintptr(1), uintptr(ioringEnterWait)
	if r.sqpoll {
		// Its thread takes the request; the call only wakes it, if it
		// slept, and waits.
		enter |= ioringEnterWake
	}
	for {
		if head := atomic.LoadUint32(r.cqHead); head != atomic.LoadUint32(r.cqTail) {
			off := r.cqes + (head&r.cqMask)*ioringCQESize
			res := *(*int32)(unsafe.Pointer(&r.cq[off+8]))
			flags := *(*uint32)(unsafe.Pointer(&r.cq[off+12]))
			atomic.StoreUint32(r.cqHead, head+1)
			return res, flags, nil
		}
		// Submits (it returns how many it took), then waits; a signal
		// may end the wait before the completion.
		took, _, errno := unix.Syscall6(unix.SYS_IO_URING_ENTER, uintptr(r.fd), submit, 1, enter, 0, 0)
		switch {
		case errno == 0 && took >= submit:
			submit = 0
		case errno != 0 && errno != unix.EINTR:
			return 0, 0, fmt.Errorf("io_uring_enter: %w", errno)
		}
	}
}

// HeaderThenIOUringSplice serves a connection as HeaderThenSplice does,
// but splices through io_uring (IOUringEcho).
func HeaderThenIOUringSplice(s *net.TCPConn) (copied int64, err error) {
	head := make([]byte, 4)
	if _, err := io.ReadFull(s, head); err != nil {
		return 0, err
	}
	copied, err = IOUringEcho(s)
	_ = s.CloseWrite()
	return copied, err
}

// IOUringEcho echoes what s receives as a liburing program would: it makes
// the socket blocking (such a program's usual socket; io_uring runs the
// splice in one of its worker threads), then moves socket to pipe by
// IORING_OP_SPLICE and pipe to socket by splice(2), until the stream ends
// or a splice fails.
func IOUringEcho(s *net.TCPConn) (copied int64, err error) {
	raw, err := s.SyscallConn()
	if err != nil {
		return 0, err
	}
	if ctlErr := raw.Control(func(fd uintptr) { copied, err = ioURingEcho(int(fd)) }); ctlErr != nil {
		return copied, ctlErr
	}
	return copied, err
}

func ioURingEcho(fd int) (copied int64, err error) {
	if err := unix.SetNonblock(fd, false); err != nil {
		return 0, err
	}
	r, err := newRing()
	if err != nil {
		return 0, err
	}
	defer r.close()
	var p [2]int
	if err := unix.Pipe2(p[:], unix.O_CLOEXEC); err != nil {
		return 0, err
	}
	defer unix.Close(p[0])
	defer unix.Close(p[1])
	for {
		n, err := r.splice(fd, p[1], 64<<10)
		if err != nil {
			return copied, err
		}
		if n < 0 {
			return copied, syscall.Errno(-n)
		}
		if n == 0 {
			return copied, nil
		}
		for left := int(n); left > 0; {
			w, err := unix.Splice(p[0], nil, fd, nil, left, 0)
			if err != nil {
				return copied, err
			}
			left -= int(w)
			copied += w
		}
	}
}

// IOUringReader reads a connection through io_uring (IORING_OP_RECV), as
// an event loop built on it does (Netty's io_uring transport), and reports
// what each completion says of the socket: whether bytes are left in it
// after the read (IORING_CQE_F_SOCK_NONEMPTY), which such a loop trusts to
// end its reads.
type IOUringReader struct {
	r *ring
	c syscall.RawConn
}

// ioringCQESockNonEmpty is IORING_CQE_F_SOCK_NONEMPTY.
const ioringCQESockNonEmpty = 1 << 2

// Where io_uring runs a reader's receives.
type IOUringMode int

const (
	// IOUringInline: inside io_uring_enter, at submission (or as task
	// work after a readiness wake-up), as most programs' rings do.
	IOUringInline IOUringMode = iota
	// IOUringWorker: in an io-wq worker thread (IOSQE_ASYNC).
	IOUringWorker
	// IOUringSQPoll: in the ring's own kernel thread (IORING_SETUP_SQPOLL).
	IOUringSQPoll
)

func (m IOUringMode) String() string {
	return [...]string{"inline", "worker", "sqpoll"}[m]
}

// NewIOUringReader sets up a ring for reading c whose receives run as mode
// says; Close frees it.
func NewIOUringReader(c *net.TCPConn, mode IOUringMode) (*IOUringReader, error) {
	raw, err := c.SyscallConn()
	if err != nil {
		return nil, err
	}
	var flags uint32
	if mode == IOUringSQPoll {
		flags = ioringSetupSQPoll
	}
	r, err := newRingWith(flags)
	if err != nil {
		return nil, err
	}
	if mode == IOUringWorker {
		r.sqeFlags = iosqeAsync
	}
	return &IOUringReader{r: r, c: raw}, nil
}

// Read waits until the socket is readable, then reads into buf with one
// io_uring recv: bytes read, and whether the completion said more are left.
func (u *IOUringReader) Read(buf []byte) (n int, more bool, err error) {
	ctlErr := u.c.Control(func(fd uintptr) {
		for {
			pfd := []unix.PollFd{{Fd: int32(fd), Events: unix.POLLIN}}
			if _, err = unix.Poll(pfd, 10_000); err == unix.EINTR {
				continue
			}
			if err != nil {
				return
			}
			if pfd[0].Revents == 0 {
				err = fmt.Errorf("not readable within 10 s")
				return
			}
			var res int32
			var flags uint32
			if res, flags, err = u.r.recv(int(fd), buf); err != nil {
				return
			}
			if res == -int32(unix.EAGAIN) {
				continue
			}
			if res < 0 {
				err = syscall.Errno(-res)
				return
			}
			n, more = int(res), flags&ioringCQESockNonEmpty != 0
			return
		}
	})
	if ctlErr != nil {
		return 0, false, ctlErr
	}
	return n, more, err
}

// Close frees the ring.
func (u *IOUringReader) Close() { u.r.close() }
