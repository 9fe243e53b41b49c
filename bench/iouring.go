package bench

import (
	"fmt"
	"runtime"
	"sync/atomic"
	"unsafe"

	"golang.org/x/sys/unix"
)

// ring is the smallest io_uring the echo benchmark needs: one request in
// flight at a time, RECV and SEND only. Written against the kernel ABI
// (include/uapi/linux/io_uring.h); no Go io_uring library is available here.
type ring struct {
	fd      int
	sq, cq  []byte // mmapped rings (the same mapping with IORING_FEAT_SINGLE_MMAP)
	sqes    []byte
	sqTail  *uint32
	sqMask  uint32
	sqArray unsafe.Pointer
	cqHead  *uint32
	cqTail  *uint32
	cqMask  uint32
	cqes    unsafe.Pointer
}

const (
	ioringOpSend         = 26
	ioringOpRecv         = 27
	ioringEnterGetevents = 1
	ioringFeatSingleMmap = 1
	ioringOffSQRing      = 0
	ioringOffCQRing      = 0x8000000
	ioringOffSQEs        = 0x10000000
	sqeSize, cqeSize     = 64, 16
)

type ioSQRingOffsets struct {
	Head, Tail, RingMask, RingEntries, Flags, Dropped, Array, Resv1 uint32
	UserAddr                                                        uint64
}

type ioCQRingOffsets struct {
	Head, Tail, RingMask, RingEntries, Overflow, Cqes, Flags, Resv1 uint32
	UserAddr                                                        uint64
}

type ioUringParams struct {
	SqEntries, CqEntries, Flags, SqThreadCPU, SqThreadIdle, Features, WqFd uint32
	Resv                                                                   [3]uint32
	SqOff                                                                  ioSQRingOffsets
	CqOff                                                                  ioCQRingOffsets
}

type ioSQE struct {
	Opcode      uint8
	Flags       uint8
	Ioprio      uint16
	Fd          int32
	Off         uint64
	Addr        uint64
	Len         uint32
	OpFlags     uint32
	UserData    uint64
	BufIndex    uint16
	Personality uint16
	SpliceFdIn  int32
	Addr3       uint64
	_           uint64
}

type ioCQE struct {
	UserData uint64
	Res      int32
	Flags    uint32
}

func newRing(entries uint32) (*ring, error) {
	var p ioUringParams
	fd, _, errno := unix.Syscall(unix.SYS_IO_URING_SETUP, uintptr(entries), uintptr(unsafe.Pointer(&p)), 0)
	if errno != 0 {
		return nil, fmt.Errorf("io_uring_setup: %w", errno)
	}
	r := &ring{fd: int(fd)}
	sqSize := int(p.SqOff.Array + p.SqEntries*4)
	cqSize := int(p.CqOff.Cqes + p.CqEntries*cqeSize)
	single := p.Features&ioringFeatSingleMmap != 0
	if single {
		sqSize = max(sqSize, cqSize)
	}
	var err error
	prot, flags := unix.PROT_READ|unix.PROT_WRITE, unix.MAP_SHARED|unix.MAP_POPULATE
	if r.sq, err = unix.Mmap(r.fd, ioringOffSQRing, sqSize, prot, flags); err != nil {
		r.close()
		return nil, fmt.Errorf("mmap sq ring: %w", err)
	}
	r.cq = r.sq
	if !single {
		if r.cq, err = unix.Mmap(r.fd, ioringOffCQRing, cqSize, prot, flags); err != nil {
			r.close()
			return nil, fmt.Errorf("mmap cq ring: %w", err)
		}
	}
	if r.sqes, err = unix.Mmap(r.fd, ioringOffSQEs, int(p.SqEntries)*sqeSize, prot, flags); err != nil {
		r.close()
		return nil, fmt.Errorf("mmap sqes: %w", err)
	}
	sq, cq := unsafe.Pointer(&r.sq[0]), unsafe.Pointer(&r.cq[0])
	r.sqTail = (*uint32)(unsafe.Add(sq, p.SqOff.Tail))
	r.sqMask = *(*uint32)(unsafe.Add(sq, p.SqOff.RingMask))
	r.sqArray = unsafe.Add(sq, p.SqOff.Array)
	r.cqHead = (*uint32)(unsafe.Add(cq, p.CqOff.Head))
	r.cqTail = (*uint32)(unsafe.Add(cq, p.CqOff.Tail))
	r.cqMask = *(*uint32)(unsafe.Add(cq, p.CqOff.RingMask))
	r.cqes = unsafe.Add(cq, p.CqOff.Cqes)
	return r, nil
}

// do submits one RECV or SEND on fd and waits for its result.
func (r *ring) do(op uint8, fd int, buf []byte) (int, error) {
	tail := atomic.LoadUint32(r.sqTail)
	idx := tail & r.sqMask
	sqe := (*ioSQE)(unsafe.Pointer(&r.sqes[idx*sqeSize]))
	*sqe = ioSQE{Opcode: op, Fd: int32(fd), Addr: uint64(uintptr(unsafe.Pointer(&buf[0]))), Len: uint32(len(buf))}
	*(*uint32)(unsafe.Add(r.sqArray, idx*4)) = idx
	atomic.StoreUint32(r.sqTail, tail+1)

	submit := uintptr(1)
	for {
		head := atomic.LoadUint32(r.cqHead)
		if head != atomic.LoadUint32(r.cqTail) {
			cqe := (*ioCQE)(unsafe.Add(r.cqes, (head&r.cqMask)*cqeSize))
			res := cqe.Res
			atomic.StoreUint32(r.cqHead, head+1)
			runtime.KeepAlive(buf)
			if res < 0 {
				return 0, unix.Errno(-res)
			}
			return int(res), nil
		}
		_, _, errno := unix.Syscall6(unix.SYS_IO_URING_ENTER, uintptr(r.fd), submit, 1, ioringEnterGetevents, 0, 0)
		if errno != 0 && errno != unix.EINTR {
			return 0, fmt.Errorf("io_uring_enter: %w", errno)
		}
		if errno == 0 {
			submit = 0
		}
	}
}

func (r *ring) close() {
	if r.sqes != nil {
		unix.Munmap(r.sqes)
	}
	if r.cq != nil && len(r.cq) > 0 && &r.cq[0] != &r.sq[0] {
		unix.Munmap(r.cq)
	}
	if r.sq != nil {
		unix.Munmap(r.sq)
	}
	unix.Close(r.fd)
}
