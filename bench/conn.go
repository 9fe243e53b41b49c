package bench

import (
	"fmt"

	"golang.org/x/sys/unix"

	"github.com/shunt-project/shunt/internal/lab"
)

// connect returns a connected client and server fd for a mode: an AF_UNIX
// socketpair, or TCP with bypass on (shunt, shunt-bare) or off (tcp). The fds
// are non-blocking: measured loops use readSome/writeSome and friends.
func (l *Lab) connect(mode, topology string) (client, server int, err error) {
	switch mode {
	case ModeUnix:
		fds, err := unix.Socketpair(unix.AF_UNIX, unix.SOCK_STREAM|unix.SOCK_CLOEXEC|unix.SOCK_NONBLOCK, 0)
		return fds[0], fds[1], err
	case ModeTCP, ModeShunt, ModeBare, ModeTrust, ModePaired:
		if err := l.bypassMode(mode); err != nil {
			return -1, -1, err
		}
		return l.tcpPair(topology)
	}
	return -1, -1, fmt.Errorf("unknown mode %q", mode)
}

// tcpPair returns connected client and server fds, both in the lab's cgroup:
// over veth, the client in the client namespace and the server in the
// server namespace; over loopback, both in the server namespace.
func (l *Lab) tcpPair(topology string) (client, server int, err error) {
	ln, addr, err := l.listen(topology, 1)
	if err != nil {
		return -1, -1, err
	}
	defer unix.Close(ln)
	var cfd int
	err = l.clientNS(topology).Do(func() error {
		return lab.InCgroup(l.Cgroup, func() (e error) {
			cfd, e = dial(addr)
			return e
		})
	})
	if err != nil {
		return -1, -1, fmt.Errorf("client socket: %w", err)
	}
	sfd, _, err := unix.Accept4(ln, unix.SOCK_CLOEXEC|unix.SOCK_NONBLOCK)
	if err != nil {
		unix.Close(cfd)
		return -1, -1, fmt.Errorf("accept: %w", err)
	}
	_ = unix.SetsockoptInt(sfd, unix.IPPROTO_TCP, unix.TCP_NODELAY, 1)
	return cfd, sfd, nil
}

// listen makes a listening socket in the server namespace and the lab's
// cgroup (accepted sockets inherit both), and returns it with the address
// clients of the topology connect to.
func (l *Lab) listen(topology string, backlog int) (int, *unix.SockaddrInet4, error) {
	addr := &unix.SockaddrInet4{}
	copy(addr.Addr[:], ipv4(lab.VethIPv4B))
	if topology == Loopback {
		copy(addr.Addr[:], ipv4("127.0.0.1"))
	}
	ln := -1
	err := l.Server.Do(func() error {
		return lab.InCgroup(l.Cgroup, func() error {
			var e error
			if ln, e = unix.Socket(unix.AF_INET, unix.SOCK_STREAM|unix.SOCK_CLOEXEC, 0); e != nil {
				return e
			}
			if e = unix.Bind(ln, addr); e != nil {
				return e
			}
			if e = unix.Listen(ln, backlog); e != nil {
				return e
			}
			sa, e := unix.Getsockname(ln)
			if e != nil {
				return e
			}
			addr.Port = sa.(*unix.SockaddrInet4).Port
			return nil
		})
	})
	if err != nil {
		if ln >= 0 {
			unix.Close(ln)
		}
		return -1, nil, fmt.Errorf("server socket: %w", err)
	}
	return ln, addr, nil
}

// clientNS is where a topology's clients live.
func (l *Lab) clientNS(topology string) *lab.NetNS {
	if topology == Loopback {
		return l.Server
	}
	return l.Client
}

// dial connects a new TCP socket (TCP_NODELAY) to addr from the calling
// thread's namespace and cgroup, and leaves it non-blocking.
func dial(addr *unix.SockaddrInet4) (int, error) {
	fd, err := unix.Socket(unix.AF_INET, unix.SOCK_STREAM|unix.SOCK_CLOEXEC, 0)
	if err != nil {
		return -1, err
	}
	if err := unix.Connect(fd, addr); err != nil {
		unix.Close(fd)
		return -1, err
	}
	_ = unix.SetsockoptInt(fd, unix.IPPROTO_TCP, unix.TCP_NODELAY, 1)
	if err := unix.SetNonblock(fd, true); err != nil {
		unix.Close(fd)
		return -1, err
	}
	return fd, nil
}

func ipv4(s string) []byte {
	var b [4]byte
	_, _ = fmt.Sscanf(s, "%d.%d.%d.%d", &b[0], &b[1], &b[2], &b[3])
	return b[:]
}

// warm sends one byte each way, as an established connection has done: shunt
// bypass redirects to a socket only once its reader has called recv.
func warm(client, server int) error {
	b := []byte{'w'}
	for _, p := range [][2]int{{client, server}, {server, client}} {
		if err := writeFull(p[0], b); err != nil {
			return err
		}
		if err := readFull(p[1], b); err != nil {
			return err
		}
	}
	return nil
}

// Bench sockets are non-blocking and are read and written as an event loop
// does: try, and on EAGAIN wait in poll(2). shunt bypass redirects only to
// such readers; one that sleeps in read(2) sends its connection back to TCP
// (a signal would end its sleep with EAGAIN on a sockhash socket;
// docs/TRANSPARENCY.md), so blocking reads would measure plain TCP.

// waitFor waits until fd is ready for events (POLLIN, POLLOUT).
func waitFor(fd int, events int16) error {
	fds := []unix.PollFd{{Fd: int32(fd), Events: events}}
	for {
		if _, err := unix.Poll(fds, -1); err != unix.EINTR {
			return err
		}
	}
}

// readSome reads what fd holds, waiting for it if it holds nothing; 0 at EOF.
func readSome(fd int, b []byte) (int, error) {
	for {
		n, err := unix.Read(fd, b)
		switch err {
		case nil:
			return n, nil
		case unix.EINTR:
		case unix.EAGAIN:
			if err := waitFor(fd, unix.POLLIN); err != nil {
				return 0, fmt.Errorf("poll: %w", err)
			}
		default:
			return 0, fmt.Errorf("read: %w", err)
		}
	}
}

// writeSome writes what fd takes, waiting for room if it takes nothing.
func writeSome(fd int, b []byte) (int, error) {
	for {
		n, err := unix.Write(fd, b)
		switch err {
		case nil:
			return n, nil
		case unix.EINTR:
		case unix.EAGAIN:
			if err := waitFor(fd, unix.POLLOUT); err != nil {
				return 0, fmt.Errorf("poll: %w", err)
			}
		default:
			return 0, fmt.Errorf("write: %w", err)
		}
	}
}

func writeFull(fd int, b []byte) error {
	for len(b) > 0 {
		n, err := writeSome(fd, b)
		if err != nil {
			return err
		}
		b = b[n:]
	}
	return nil
}

// readFull reads len(b) bytes; it returns errEOF on a clean close.
func readFull(fd int, b []byte) error {
	for len(b) > 0 {
		n, err := readSome(fd, b)
		if err != nil {
			return err
		}
		if n == 0 {
			return errEOF
		}
		b = b[n:]
	}
	return nil
}

var errEOF = fmt.Errorf("connection closed")
