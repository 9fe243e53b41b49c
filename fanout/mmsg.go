package fanout

import (
	"unsafe"

	"golang.org/x/sys/unix"
)

// mmsghdr is struct mmsghdr (x/sys/unix has no sendmmsg).
type mmsghdr struct {
	hdr unix.Msghdr
	len uint32
	_   [4]byte
}

// mmsgSender sends many datagrams on a connected socket with sendmmsg(2),
// reusing its headers between calls.
type mmsgSender struct {
	hdrs []mmsghdr
	iovs []unix.Iovec
}

// send sends every datagram of batch, in order; a datagram the kernel
// refuses (too long) is skipped, so one bad datagram never stalls the rest.
// It returns how many were sent.
func (m *mmsgSender) send(fd int, batch [][]byte) (sent int, err error) {
	for len(batch) > 0 {
		m.hdrs, m.iovs = m.hdrs[:0], m.iovs[:0]
		for _, b := range batch {
			m.iovs = append(m.iovs, unix.Iovec{Base: unsafe.SliceData(b), Len: uint64(len(b))})
		}
		for i := range batch {
			h := mmsghdr{}
			h.hdr.Iov = &m.iovs[i]
			h.hdr.Iovlen = 1
			m.hdrs = append(m.hdrs, h)
		}
		n, _, errno := unix.Syscall6(unix.SYS_SENDMMSG, uintptr(fd), uintptr(unsafe.Pointer(&m.hdrs[0])), uintptr(len(m.hdrs)), 0, 0, 0)
		switch {
		case errno == unix.EINTR:
			continue
		case errno == unix.EMSGSIZE && n == 0:
			batch = batch[1:]
			continue
		case errno != 0:
			return sent, errno
		}
		batch = batch[n:]
		sent += int(n)
	}
	return sent, nil
}
