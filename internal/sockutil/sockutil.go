// Package sockutil has small socket helpers shared by packages that hand
// sockets to the kernel maps.
package sockutil

import (
	"net"
	"net/netip"

	"golang.org/x/sys/unix"
)

// DupUDP returns a new connection on c's socket (its own descriptor), for a
// caller that gives one away and keeps using the other.
func DupUDP(c *net.UDPConn) (*net.UDPConn, error) {
	f, err := c.File()
	if err != nil {
		return nil, err
	}
	defer f.Close()
	nc, err := net.FileConn(f)
	if err != nil {
		return nil, err
	}
	return nc.(*net.UDPConn), nil
}

// DrainUDP calls fn with each datagram waiting on c and its source, without
// blocking, and returns how many there were. (A read deadline in the past
// would not do: Go then fails the read without trying it.) b is reused
// between calls.
func DrainUDP(c *net.UDPConn, fn func(b []byte, from netip.AddrPort)) int {
	raw, err := c.SyscallConn()
	if err != nil {
		return 0
	}
	buf := make([]byte, 1<<16)
	n := 0
	raw.Control(func(fd uintptr) {
		for {
			m, sa, err := unix.Recvfrom(int(fd), buf, unix.MSG_DONTWAIT)
			if err == unix.EINTR {
				continue
			}
			if err != nil {
				return
			}
			var from netip.AddrPort
			switch a := sa.(type) {
			case *unix.SockaddrInet4:
				from = netip.AddrPortFrom(netip.AddrFrom4(a.Addr), uint16(a.Port))
			case *unix.SockaddrInet6:
				from = netip.AddrPortFrom(netip.AddrFrom16(a.Addr).Unmap(), uint16(a.Port))
			}
			fn(buf[:m], from)
			n++
		}
	})
	return n
}
