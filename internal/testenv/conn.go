package testenv

import (
	"io"
	"net"
	"net/netip"
	"strconv"
	"syscall"
	"testing"
	"time"

	"golang.org/x/sys/unix"

	"github.com/shunt-project/shunt/host"
)

// Side says where a socket is made: which namespace and which cgroup. Zero
// values mean the test's own.
type Side struct {
	NS *NetNS
	CG host.Cgroup
}

// Make runs fn so that sockets it creates belong to the side.
func (s Side) Make(t testing.TB, fn func()) {
	t.Helper()
	s.NS.Do(t, func() { InCgroup(t, s.CG, fn) })
}

// Listen opens a TCP listener on the server side. addr like "127.0.0.1:0".
func Listen(t testing.TB, server Side, network, addr string) *net.TCPListener {
	t.Helper()
	var ln net.Listener
	var err error
	server.Make(t, func() { ln, err = net.Listen(network, addr) })
	if err != nil {
		t.Fatalf("listen %s %s: %v", network, addr, err)
	}
	t.Cleanup(func() { ln.Close() })
	return ln.(*net.TCPListener)
}

// Dial connects from the client side, optionally from a fixed local address.
func Dial(t testing.TB, client Side, network, addr string, local *net.TCPAddr) *net.TCPConn {
	t.Helper()
	var c net.Conn
	var err error
	d := net.Dialer{Timeout: 5 * time.Second}
	if local != nil {
		d.LocalAddr = local
	}
	client.Make(t, func() { c, err = d.Dial(network, addr) })
	if err != nil {
		t.Fatalf("dial %s %s: %v", network, addr, err)
	}
	t.Cleanup(func() { c.Close() })
	return c.(*net.TCPConn)
}

// Accept takes one connection from ln.
func Accept(t testing.TB, ln *net.TCPListener) *net.TCPConn {
	t.Helper()
	_ = ln.SetDeadline(time.Now().Add(5 * time.Second))
	c, err := ln.AcceptTCP()
	if err != nil {
		t.Fatalf("accept: %v", err)
	}
	t.Cleanup(func() { c.Close() })
	return c
}

// ConnPair returns a connected client and server socket: the listener is
// made on the server side at listenAddr, the client dials dialAddr (the
// listener's port is filled in when dialAddr's port is 0).
func ConnPair(t testing.TB, network string, server Side, listenAddr string, client Side, dialAddr string) (c, s *net.TCPConn) {
	t.Helper()
	ln := Listen(t, server, network, listenAddr)
	host, _, _ := net.SplitHostPort(dialAddr)
	port := ln.Addr().(*net.TCPAddr).Port
	c = Dial(t, client, network, net.JoinHostPort(host, strconv.Itoa(port)), nil)
	s = Accept(t, ln)
	return c, s
}

// onFD runs fn on the connection's file descriptor and fails the test on
// any error.
func onFD(t testing.TB, c syscall.Conn, what string, fn func(fd int) error) {
	t.Helper()
	raw, err := c.SyscallConn()
	if err != nil {
		t.Fatal(err)
	}
	var ferr error
	if err := raw.Control(func(fd uintptr) { ferr = fn(int(fd)) }); err != nil || ferr != nil {
		t.Fatalf("%s: %v %v", what, err, ferr)
	}
}

// Cookie returns the socket cookie (SO_COOKIE) of a TCP or UDP socket.
func Cookie(t testing.TB, c syscall.Conn) (v uint64) {
	t.Helper()
	onFD(t, c, "SO_COOKIE", func(fd int) (err error) {
		v, err = unix.GetsockoptUint64(fd, unix.SOL_SOCKET, unix.SO_COOKIE)
		return err
	})
	return v
}

// InQueue returns FIONREAD for a connection.
func InQueue(t testing.TB, c *net.TCPConn) (v int) {
	t.Helper()
	onFD(t, c, "FIONREAD", func(fd int) (err error) {
		v, err = unix.IoctlGetInt(fd, unix.SIOCINQ)
		return err
	})
	return v
}

// UDPConnPair returns two UDP sockets in ns connected to each other, bound
// to addr's address (port 0 for any), with large buffers so that a test's
// bursts are not dropped by the sockets themselves.
func UDPConnPair(t testing.TB, ns *NetNS, addr string) (x, y *net.UDPConn) {
	t.Helper()
	ns.Do(t, func() {
		ap := net.UDPAddrFromAddrPort(netip.MustParseAddrPort(addr))
		var err error
		if x, err = net.ListenUDP("udp", ap); err != nil {
			t.Fatal(err)
		}
		if y, err = net.DialUDP("udp", nil, x.LocalAddr().(*net.UDPAddr)); err != nil {
			t.Fatal(err)
		}
		// Connect x back to y, keeping its address.
		xa := x.LocalAddr().(*net.UDPAddr)
		x.Close()
		if x, err = net.DialUDP("udp", xa, y.LocalAddr().(*net.UDPAddr)); err != nil {
			t.Fatal(err)
		}
	})
	for _, c := range []*net.UDPConn{x, y} {
		_ = c.SetReadBuffer(32 << 20)
		_ = c.SetWriteBuffer(4 << 20)
	}
	t.Cleanup(func() { x.Close(); y.Close() })
	return x, y
}

// Warm runs one round trip of one byte each way, so that both readers have
// been seen in recv: until then shunt bypass sends each way over TCP
// (docs/TRANSPARENCY.md, "Readers").
func Warm(t testing.TB, c, s net.Conn) {
	t.Helper()
	for _, p := range [][2]net.Conn{{c, s}, {s, c}} {
		if _, err := p[0].Write([]byte{'w'}); err != nil {
			t.Fatalf("warm-up write: %v", err)
		}
		b := make([]byte, 1)
		if _, err := io.ReadFull(p[1], b); err != nil || b[0] != 'w' {
			t.Fatalf("warm-up read: %q %v", b, err)
		}
	}
}

// WaitTCPState waits up to 5 s until a connection's TCP state (TCP_INFO)
// is state, e.g. unix.BPF_TCP_CLOSE_WAIT once the peer's FIN arrived.
func WaitTCPState(t testing.TB, c *net.TCPConn, state uint8) {
	t.Helper()
	var got uint8
	for deadline := time.Now().Add(5 * time.Second); time.Now().Before(deadline); time.Sleep(time.Millisecond) {
		onFD(t, c, "TCP_INFO", func(fd int) error {
			info, err := unix.GetsockoptTCPInfo(fd, unix.IPPROTO_TCP, unix.TCP_INFO)
			if err == nil {
				got = info.State
			}
			return err
		})
		if got == state {
			return
		}
	}
	t.Fatalf("TCP state %d after 5 s, want %d", got, state)
}
