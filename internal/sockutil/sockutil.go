// Package sockutil has small socket helpers shared by packages that hand
// sockets to the kernel maps.
package sockutil

import "net"

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
