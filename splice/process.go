package splice

import (
	"errors"
	"fmt"
	"net"
	"os"

	"golang.org/x/sys/unix"
)

// TakeFromProcess returns a connection to the TCP socket behind descriptor
// fd of process pid (pidfd_getfd, Linux 5.6+; the caller needs ptrace rights
// over the process, as root has). The process keeps its descriptor: it must
// stop reading and writing it, or it competes with the kernel for the bytes.
func TakeFromProcess(pid, fd int) (*net.TCPConn, error) {
	c, err := TakeSocket(pid, fd)
	if err != nil {
		return nil, err
	}
	if tc, ok := c.(*net.TCPConn); ok {
		return tc, nil
	}
	c.Close()
	return nil, fmt.Errorf("descriptor %d of process %d: is not a TCP socket", fd, pid)
}

// TakeSocket is TakeFromProcess for a TCP or a UDP socket: it returns a
// connected *net.TCPConn or *net.UDPConn.
func TakeSocket(pid, fd int) (net.Conn, error) {
	pidfd, err := unix.PidfdOpen(pid, 0)
	if err != nil {
		if errors.Is(err, unix.ESRCH) {
			return nil, fmt.Errorf("no process %d", pid)
		}
		return nil, fmt.Errorf("open process %d: %w", pid, err)
	}
	defer unix.Close(pidfd)
	nfd, err := unix.PidfdGetfd(pidfd, fd, 0)
	switch {
	case errors.Is(err, unix.EBADF):
		return nil, fmt.Errorf("process %d has no descriptor %d", pid, fd)
	case errors.Is(err, unix.EPERM):
		return nil, fmt.Errorf("not allowed to take descriptors of process %d (needs ptrace rights over it: run as root, or as its user with kernel.yama.ptrace_scope 0)", pid)
	case err != nil:
		return nil, fmt.Errorf("take descriptor %d of process %d: %w", fd, pid, err)
	}
	var c net.Conn
	if typ, _ := unix.GetsockoptInt(nfd, unix.SOL_SOCKET, unix.SO_TYPE); typ == unix.SOCK_DGRAM {
		c, err = UDPConn(nfd)
	} else {
		c, err = Conn(nfd)
	}
	if err != nil {
		return nil, fmt.Errorf("descriptor %d of process %d: %w", fd, pid, err)
	}
	return c, nil
}

// Conn wraps a descriptor that must be a connected TCP socket (half-closed
// is fine), as Join wants; it takes ownership of fd (closed on error too).
func Conn(fd int) (*net.TCPConn, error) {
	f := os.NewFile(uintptr(fd), "socket")
	defer f.Close()
	typ, proto, err := socketKind(fd)
	if err != nil {
		return nil, err
	}
	if typ == unix.SOCK_DGRAM && proto == unix.IPPROTO_UDP {
		return nil, errors.New("is a UDP socket (UDP pairs join through splice.NewUDP or shunt splice --pid)")
	}
	if typ != unix.SOCK_STREAM || proto != unix.IPPROTO_TCP {
		return nil, errors.New("is not a TCP or UDP socket (only those can be joined)")
	}
	info, err := unix.GetsockoptTCPInfo(fd, unix.IPPROTO_TCP, unix.TCP_INFO)
	if err != nil || !connected(info.State) {
		return nil, errors.New("is not a connected TCP socket")
	}
	c, err := net.FileConn(f)
	if err != nil {
		return nil, err
	}
	return c.(*net.TCPConn), nil
}

// connected says whether a TCP state still carries bytes one way or both:
// established, or half closed (Join copies those in user space).
func connected(state uint8) bool {
	switch state {
	case unix.BPF_TCP_ESTABLISHED, unix.BPF_TCP_CLOSE_WAIT, unix.BPF_TCP_FIN_WAIT1, unix.BPF_TCP_FIN_WAIT2:
		return true
	}
	return false
}

// socketKind reads a descriptor's socket type and protocol.
func socketKind(fd int) (typ, proto int, err error) {
	if typ, err = unix.GetsockoptInt(fd, unix.SOL_SOCKET, unix.SO_TYPE); err != nil {
		return 0, 0, errors.New("is not a socket")
	}
	proto, _ = unix.GetsockoptInt(fd, unix.SOL_SOCKET, unix.SO_PROTOCOL)
	return typ, proto, nil
}
