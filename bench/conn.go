package bench

import (
	"fmt"

	"golang.org/x/sys/unix"

	"github.com/shunt-project/shunt/internal/lab"
)

// connect returns a connected client and server fd for a mode: an AF_UNIX
// socketpair, or TCP with bypass on (shunt, shunt-bare) or off (tcp). The fds
// are blocking: measured loops make plain syscalls on them.
func (l *Lab) connect(mode, topology string) (client, server int, err error) {
	switch mode {
	case ModeUnix:
		fds, err := unix.Socketpair(unix.AF_UNIX, unix.SOCK_STREAM|unix.SOCK_CLOEXEC, 0)
		return fds[0], fds[1], err
	case ModeTCP, ModeShunt, ModeBare:
		if err := l.Bypass(mode != ModeTCP); err != nil {
			return -1, -1, err
		}
		if err := l.install.UseBareRedirect(mode == ModeBare); err != nil {
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
	ln, cfd := -1, -1
	defer func() {
		if ln >= 0 {
			unix.Close(ln)
		}
		if err != nil && cfd >= 0 {
			unix.Close(cfd)
		}
	}()
	addr := &unix.SockaddrInet4{}
	clientNS := l.Client
	copy(addr.Addr[:], ipv4(lab.VethIPv4B))
	if topology == Loopback {
		clientNS = l.Server
		copy(addr.Addr[:], ipv4("127.0.0.1"))
	}
	err = l.Server.Do(func() error {
		return lab.InCgroup(l.Cgroup, func() error {
			var e error
			if ln, e = unix.Socket(unix.AF_INET, unix.SOCK_STREAM|unix.SOCK_CLOEXEC, 0); e != nil {
				return e
			}
			if e = unix.Bind(ln, addr); e != nil {
				return e
			}
			if e = unix.Listen(ln, 1); e != nil {
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
		return -1, -1, fmt.Errorf("server socket: %w", err)
	}
	err = clientNS.Do(func() error {
		return lab.InCgroup(l.Cgroup, func() error {
			var e error
			if cfd, e = unix.Socket(unix.AF_INET, unix.SOCK_STREAM|unix.SOCK_CLOEXEC, 0); e != nil {
				return e
			}
			return unix.Connect(cfd, addr)
		})
	})
	if err != nil {
		return -1, -1, fmt.Errorf("client socket: %w", err)
	}
	sfd, _, err := unix.Accept4(ln, unix.SOCK_CLOEXEC)
	if err != nil {
		return -1, -1, fmt.Errorf("accept: %w", err)
	}
	for _, fd := range []int{cfd, sfd} {
		_ = unix.SetsockoptInt(fd, unix.IPPROTO_TCP, unix.TCP_NODELAY, 1)
	}
	return cfd, sfd, nil
}

func ipv4(s string) []byte {
	var b [4]byte
	fmt.Sscanf(s, "%d.%d.%d.%d", &b[0], &b[1], &b[2], &b[3])
	return b[:]
}

// warm sends one byte each way, as an established connection has done: shunt
// bypass redirects to a socket only once its reader has called recv.
func warm(client, server int) error {
	var eagain int
	b := []byte{'w'}
	for _, p := range [][2]int{{client, server}, {server, client}} {
		if err := writeFull(p[0], b); err != nil {
			return err
		}
		if err := readFull(p[1], b, &eagain); err != nil {
			return err
		}
	}
	return nil
}

func writeFull(fd int, b []byte) error {
	for len(b) > 0 {
		n, err := unix.Write(fd, b)
		if err == unix.EINTR {
			continue
		}
		if err != nil {
			return fmt.Errorf("write: %w", err)
		}
		b = b[n:]
	}
	return nil
}

// readFull reads len(b) bytes; it returns errEOF on a clean close.
//
// A blocking read of a bypassed socket that a signal interrupts fails with
// EAGAIN on 6.18 (tcp_bpf_recvmsg; plain TCP restarts it), and Go's runtime
// signals threads to preempt them. Such reads are retried and counted in
// *eagain, so results say how often an application would have seen it.
func readFull(fd int, b []byte, eagain *int) error {
	for len(b) > 0 {
		n, err := unix.Read(fd, b)
		if err == unix.EINTR {
			continue
		}
		if err == unix.EAGAIN {
			*eagain++
			continue
		}
		if err != nil {
			return fmt.Errorf("read: %w", err)
		}
		if n == 0 {
			return errEOF
		}
		b = b[n:]
	}
	return nil
}

var errEOF = fmt.Errorf("connection closed")
