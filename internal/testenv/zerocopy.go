package testenv

import (
	"errors"
	"syscall"
	"testing"
	"unsafe"

	"golang.org/x/sys/unix"
)

// tcpZerocopyReceive is struct tcp_zerocopy_receive (linux/tcp.h, 5.11 on).
type tcpZerocopyReceive struct {
	Address        uint64
	Length         uint32
	RecvSkipHint   uint32
	Inq            uint32
	Err            int32
	CopybufAddress uint64
	CopybufLen     int32
	Flags          uint32
	MsgControl     uint64
	MsgControllen  uint64
	MsgFlags       uint32
	Reserved       uint32
}

// ZerocopyReceiver takes a socket's bytes as a TCP_ZEROCOPY_RECEIVE reader
// does: the pages of TCP's receive queue mapped into its memory, the rest
// (the skip hint) read with read().
type ZerocopyReceiver struct {
	fd      int
	mapping []byte
	buf     []byte
}

// NewZerocopyReceiver maps 1 MiB of the socket fd; unmapped when the test
// ends.
func NewZerocopyReceiver(t testing.TB, fd int) *ZerocopyReceiver {
	t.Helper()
	m, err := unix.Mmap(fd, 0, 1<<20, unix.PROT_READ, unix.MAP_SHARED)
	if err != nil {
		t.Fatalf("mmap of the socket: %v", err)
	}
	t.Cleanup(func() { _ = unix.Munmap(m) })
	return &ZerocopyReceiver{fd: fd, mapping: m, buf: make([]byte, 1<<20)}
}

// Take is one pass of a zerocopy reader: it maps what it can of TCP's
// queue, copies it out, and reads the skip hint. A socket error the call
// reports (the struct's err) comes back as the error.
func (z *ZerocopyReceiver) Take() ([]byte, error) {
	zc := tcpZerocopyReceive{Address: uint64(uintptr(unsafe.Pointer(&z.mapping[0]))), Length: uint32(len(z.mapping))}
	size := uint32(unsafe.Sizeof(zc))
	_, _, errno := unix.Syscall6(unix.SYS_GETSOCKOPT, uintptr(z.fd), unix.SOL_TCP, unix.TCP_ZEROCOPY_RECEIVE,
		uintptr(unsafe.Pointer(&zc)), uintptr(unsafe.Pointer(&size)), 0)
	if errno != 0 {
		return nil, errno
	}
	out := append([]byte(nil), z.mapping[:zc.Length]...)
	if zc.Length > 0 {
		if err := unix.Madvise(z.mapping[:zc.Length], unix.MADV_DONTNEED); err != nil {
			return out, err
		}
	}
	if zc.Err < 0 {
		return out, syscall.Errno(-zc.Err)
	}
	if zc.RecvSkipHint > 0 {
		n, err := unix.Read(z.fd, z.buf[:zc.RecvSkipHint])
		if err != nil && !errors.Is(err, unix.EAGAIN) {
			return out, err
		}
		if n > 0 {
			out = append(out, z.buf[:n]...)
		}
	}
	return out, nil
}
