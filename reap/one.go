package reap

import (
	"fmt"
	"net/netip"
	"strconv"

	"golang.org/x/sys/unix"

	"github.com/shunt-project/shunt/sockindex"
)

// TCPSocket names one TCP socket on the host: the namespace it lives in (its
// cookie, and a process likely to be in it), its addresses as it sees them,
// and its cookie.
type TCPSocket struct {
	Netns         uint64
	PID           int // a process in that namespace, tried first; 0: none known
	Local, Remote netip.AddrPort
	Cookie        uint64
}

// DestroyTCP aborts one TCP socket (the application sees ECONNABORTED and
// the peer a reset), found by exact tuple and cookie in its namespace: the
// PID's, or else every namespace of the host is searched for the cookie.
func DestroyTCP(s TCPSocket) error {
	var d *diagConn
	if s.PID > 0 {
		d, _ = openIn("/proc/"+strconv.Itoa(s.PID)+"/ns/net", s.Netns)
	}
	if d == nil {
		path, ok := newNetnsScan().find(s.Netns)
		if !ok {
			return fmt.Errorf("network namespace %d not found", s.Netns)
		}
		var err error
		if d, err = openIn(path, s.Netns); err != nil {
			return err
		}
	}
	defer d.Close()
	family := unix.AF_INET6
	if s.Local.Addr().Unmap().Is4() {
		family = unix.AF_INET
	}
	rep, err := d.destroy(sockindex.TCP, []diagID{{family: family, local: s.Local, remote: s.Remote, cookie: s.Cookie}})
	if err != nil {
		return err
	}
	return rep[0].err
}
