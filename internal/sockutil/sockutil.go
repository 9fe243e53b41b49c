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
// blocking, and returns how many there were, and the socket error that ended
// the drain if one did (an ICMP error, e.g. ECONNREFUSED, is reported once,
// by the read that takes it). (A read deadline in the past would not do: Go
// then fails the read without trying it.) b is reused between calls.
func DrainUDP(c *net.UDPConn, fn func(b []byte, from netip.AddrPort)) (n int, sockErr error) {
	raw, err := c.SyscallConn()
	if err != nil {
		return 0, nil
	}
	buf := make([]byte, 1<<16)
	// Fails only once c is closed: nothing to drain then.
	_ = raw.Control(func(fd uintptr) {
		for {
			m, sa, err := unix.Recvfrom(int(fd), buf, unix.MSG_DONTWAIT)
			if err == unix.EINTR {
				continue
			}
			if err == unix.EAGAIN {
				return
			}
			if err != nil {
				sockErr = err
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
	return n, sockErr
}
