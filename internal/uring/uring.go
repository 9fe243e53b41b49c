// Package uring is the smallest io_uring shunt needs: SEND and RECV, many in
// one submission. Written against the kernel ABI
// (include/uapi/linux/io_uring.h); no Go io_uring module is available here.
package uring

import (
	"fmt"
	"runtime"
	"sync/atomic"
	"unsafe"

	"golang.org/x/sys/unix"
)

// Ring is one io_uring. Not safe for concurrent use.
type Ring struct {
	fd        int
	sq, cq    []byte // mmapped rings (the same mapping with IORING_FEAT_SINGLE_MMAP)
	sqes      []byte
	sqTail    *uint32
	sqMask    uint32
	sqEntries uint32
	sqArray   unsafe.Pointer
	cqHead    *uint32
	cqTail    *uint32
	cqMask    uint32
	cqes      unsafe.Pointer
	pending   uint32   // SQEs queued and not yet submitted
	keep      [][]byte // buffers in flight, kept reachable until reaped
}

const (
	OpSend               = 26
	OpRecv               = 27
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

// New sets up a ring with room for entries requests at a time.
func New(entries uint32) (*Ring, error) {
	var p ioUringParams
	fd, _, errno := unix.Syscall(unix.SYS_IO_URING_SETUP, uintptr(entries), uintptr(unsafe.Pointer(&p)), 0)
	if errno != 0 {
		return nil, fmt.Errorf("io_uring_setup: %w", errno)
	}
	r := &Ring{fd: int(fd), sqEntries: p.SqEntries}
	sqSize := int(p.SqOff.Array + p.SqEntries*4)
	cqSize := int(p.CqOff.Cqes + p.CqEntries*cqeSize)
	single := p.Features&ioringFeatSingleMmap != 0
	if single {
		sqSize = max(sqSize, cqSize)
	}
	var err error
	prot, flags := unix.PROT_READ|unix.PROT_WRITE, unix.MAP_SHARED|unix.MAP_POPULATE
	if r.sq, err = unix.Mmap(r.fd, ioringOffSQRing, sqSize, prot, flags); err != nil {
		r.Close()
		return nil, fmt.Errorf("mmap sq ring: %w", err)
	}
	r.cq = r.sq
	if !single {
		if r.cq, err = unix.Mmap(r.fd, ioringOffCQRing, cqSize, prot, flags); err != nil {
			r.Close()
			return nil, fmt.Errorf("mmap cq ring: %w", err)
		}
	}
	if r.sqes, err = unix.Mmap(r.fd, ioringOffSQEs, int(p.SqEntries)*sqeSize, prot, flags); err != nil {
		r.Close()
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

// Prep queues one request; it returns false when the submission queue is
// full (Submit first). buf must not change until its completion is reaped.
func (r *Ring) Prep(op uint8, fd int, buf []byte, msgFlags uint32, userData uint64) bool {
	if r.pending == r.sqEntries {
		return false
	}
	tail := atomic.LoadUint32(r.sqTail)
	idx := tail & r.sqMask
	sqe := (*ioSQE)(unsafe.Pointer(&r.sqes[idx*sqeSize]))
	*sqe = ioSQE{Opcode: op, Fd: int32(fd), Addr: uint64(uintptr(unsafe.Pointer(unsafe.SliceData(buf)))), Len: uint32(len(buf)), OpFlags: msgFlags, UserData: userData}
	*(*uint32)(unsafe.Add(r.sqArray, idx*4)) = idx
	atomic.StoreUint32(r.sqTail, tail+1)
	r.pending++
	r.keep = append(r.keep, buf)
	return true
}

// SubmitAndWait submits what Prep queued and waits until at least wait
// completions are ready.
func (r *Ring) SubmitAndWait(wait int) error {
	submit := r.pending
	for {
		_, _, errno := unix.Syscall6(unix.SYS_IO_URING_ENTER, uintptr(r.fd), uintptr(submit), uintptr(wait), ioringEnterGetevents, 0, 0)
		if errno == unix.EINTR {
			continue
		}
		if errno != 0 {
			return fmt.Errorf("io_uring_enter: %w", errno)
		}
		r.pending = 0
		return nil
	}
}

// Reap hands each ready completion to fn: its user data and its result (a
// byte count, or a negated errno).
func (r *Ring) Reap(fn func(userData uint64, res int32)) int {
	n := 0
	for {
		head := atomic.LoadUint32(r.cqHead)
		if head == atomic.LoadUint32(r.cqTail) {
			break
		}
		cqe := (*ioCQE)(unsafe.Add(r.cqes, (head&r.cqMask)*cqeSize))
		ud, res := cqe.UserData, cqe.Res
		atomic.StoreUint32(r.cqHead, head+1)
		fn(ud, res)
		n++
	}
	if atomic.LoadUint32(r.cqHead) == atomic.LoadUint32(r.cqTail) && r.pending == 0 {
		runtime.KeepAlive(r.keep)
		r.keep = r.keep[:0]
	}
	return n
}

// Do runs one request and waits for its result.
func (r *Ring) Do(op uint8, fd int, buf []byte) (int, error) {
	r.Prep(op, fd, buf, 0, 0)
	if err := r.SubmitAndWait(1); err != nil {
		return 0, err
	}
	var res int32
	for r.Reap(func(_ uint64, v int32) { res = v }) == 0 {
		if err := r.SubmitAndWait(1); err != nil {
			return 0, err
		}
	}
	if res < 0 {
		return 0, unix.Errno(-res)
	}
	return int(res), nil
}

// Close releases the ring. Nothing may be in flight.
func (r *Ring) Close() {
	if r.sqes != nil {
		unix.Munmap(r.sqes)
	}
	if len(r.cq) > 0 && &r.cq[0] != &r.sq[0] {
		unix.Munmap(r.cq)
	}
	if r.sq != nil {
		unix.Munmap(r.sq)
	}
	unix.Close(r.fd)
}
