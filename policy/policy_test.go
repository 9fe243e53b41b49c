package policy_test

import (
	"context"
	"encoding/binary"
	"errors"
	"fmt"
	"io"
	"net"
	"net/netip"
	"os"
	"os/exec"
	"sync"
	"sync/atomic"
	"testing"
	"time"

	"golang.org/x/sys/unix"

	"github.com/shunt-project/shunt/bypass"
	"github.com/shunt-project/shunt/bypass/bypasstest"
	"github.com/shunt-project/shunt/host"
	"github.com/shunt-project/shunt/internal/testenv"
	"github.com/shunt-project/shunt/policy"
)

// mustBypass installs shunt's bypass (trusting readers, so a test's first
// bytes are redirected too) for the cgroups, removed at cleanup.
func mustBypass(t testing.TB, cgs ...host.Cgroup) *bypass.Install {
	t.Helper()
	in, err := bypass.Create(bypasstest.MustPinDir(t), bypass.Options{TrustReaders: true})
	if err != nil {
		t.Fatal(err)
	}
	t.Cleanup(func() { in.Close() })
	for _, cg := range cgs {
		if _, err := in.Attach(cg); err != nil {
			t.Fatal(err)
		}
	}
	return in
}

// echo sends 4 bytes and waits for them back, within a second.
func echo(c net.Conn) error {
	c.SetDeadline(time.Now().Add(time.Second))
	if _, err := c.Write([]byte("ping")); err != nil {
		return err
	}
	_, err := io.ReadFull(c, make([]byte, 4))
	return err
}

// mustPolicy installs an empty policy at a fresh pin directory.
// mechanisms are what the policies a test makes use (the zero value: this
// kernel's newest); eachCloseMethod sets them for its sock_diag run.
var mechanisms host.Mechanisms

func mustPolicy(t *testing.T) *policy.Policy {
	t.Helper()
	testenv.RequireRoot(t)
	testenv.WatchKernelLog(t)
	p, err := policy.Create(bypasstest.MustPinDir(t), policy.Options{Mechanisms: mechanisms})
	if err != nil {
		t.Fatal(err)
	}
	t.Cleanup(func() { p.Remove() })
	return p
}

func mustApply(t testing.TB, p *policy.Policy, rs policy.Ruleset) *policy.ApplyResult {
	t.Helper()
	res, err := p.Apply(context.Background(), rs)
	if err != nil {
		t.Fatal(err)
	}
	return res
}

func mustParse(t testing.TB, text string) policy.Ruleset {
	t.Helper()
	rs, err := policy.Parse([]byte(text))
	if err != nil {
		t.Fatal(err)
	}
	return rs
}

// mustAddressNS is a namespace where all of 10.9.0.0/16 and fd09::/64 are
// local, so a connection to any of their addresses reaches a listener on
// the wildcard address.
func mustAddressNS(t testing.TB) *testenv.NetNS {
	t.Helper()
	ns := testenv.MustNetNS(t)
	for _, args := range [][]string{
		{"route", "add", "local", "10.9.0.0/16", "dev", "lo"},
		{"-6", "route", "add", "local", "fd09::/64", "dev", "lo"},
	} {
		if err := ipIn(ns, args...); err != nil {
			t.Fatal(err)
		}
	}
	return ns
}

// ipIn runs ip(8) in the namespace.
func ipIn(ns *testenv.NetNS, args ...string) error {
	out, err := exec.Command("ip", append([]string{"-n", ns.Name}, args...)...).CombinedOutput()
	if err != nil {
		return fmt.Errorf("ip %v: %v: %s", args, err, out)
	}
	return nil
}

// received records the datagrams listeners' UDP sockets got, by payload.
type received struct {
	mu  sync.Mutex
	got map[string]bool
}

func (r *received) add(p string) {
	r.mu.Lock()
	r.got[p] = true
	r.mu.Unlock()
}

// within reports whether a datagram with payload p arrives within d.
func (r *received) within(p string, d time.Duration) bool {
	for deadline := time.Now().Add(d); ; time.Sleep(5 * time.Millisecond) {
		r.mu.Lock()
		ok := r.got[p]
		r.mu.Unlock()
		if ok || time.Now().After(deadline) {
			return ok
		}
	}
}

// listeners serve every port of ports over TCP (echoing) and UDP, dual
// stack, created on side; what the UDP sockets receive is recorded.
func listeners(t testing.TB, side testenv.Side, ports ...int) *received {
	t.Helper()
	rec := &received{got: map[string]bool{}}
	for _, port := range ports {
		ln := testenv.Listen(t, side, "tcp", fmt.Sprintf("[::]:%d", port))
		go func() {
			for {
				c, err := ln.Accept()
				if err != nil {
					return
				}
				// Read and write, not io.Copy: Go would splice(2), which a
				// bypassed socket's reader must not (see bypass).
				go func() {
					defer c.Close()
					buf := make([]byte, 4096)
					for {
						n, err := c.Read(buf)
						if err != nil {
							return
						}
						if _, err := c.Write(buf[:n]); err != nil {
							return
						}
					}
				}()
			}
		}()
		var pc net.PacketConn
		var err error
		side.Make(t, func() { pc, err = net.ListenPacket("udp", fmt.Sprintf("[::]:%d", port)) })
		if err != nil {
			t.Fatal(err)
		}
		t.Cleanup(func() { pc.Close() })
		go func() {
			buf := make([]byte, 512)
			for {
				n, _, err := pc.ReadFrom(buf)
				if err != nil {
					return
				}
				rec.add(string(buf[:n]))
			}
		}()
		udpLiteListener(t, side, port, rec)
	}
	return rec
}

// udpLiteListener records what a dual-stack UDP-Lite socket on port
// receives (Go's net has no UDP-Lite) until the test ends.
func udpLiteListener(t testing.TB, side testenv.Side, port int, rec *received) {
	t.Helper()
	var fd int
	var err error
	side.Make(t, func() {
		fd, err = unix.Socket(unix.AF_INET6, unix.SOCK_DGRAM|unix.SOCK_CLOEXEC, unix.IPPROTO_UDPLITE)
		if err == nil {
			err = unix.Bind(fd, &unix.SockaddrInet6{Port: port})
		}
	})
	if err != nil {
		t.Fatalf("UDP-Lite listener on %d: %v", port, err)
	}
	// A receive timeout lets the reader see the test end: closing the
	// descriptor does not wake a blocked recvfrom.
	unix.SetsockoptTimeval(fd, unix.SOL_SOCKET, unix.SO_RCVTIMEO, &unix.Timeval{Usec: 100_000})
	var done atomic.Bool
	stopped := make(chan struct{})
	go func() {
		defer close(stopped)
		buf := make([]byte, 512)
		for !done.Load() {
			if n, _, err := unix.Recvfrom(fd, buf, 0); err == nil {
				rec.add(string(buf[:n]))
			}
		}
	}()
	t.Cleanup(func() {
		done.Store(true)
		<-stopped
		unix.Close(fd)
	})
}

// What a case does.
type op int

const (
	tcpConnect op = iota
	udpConnect
	udpSendto
	udpliteConnect // UDP-Lite: connect(2) runs no cgroup hook
	udpliteSendto
	rawUDP // a UDP datagram built by hand on a raw socket
	rawTCP // a TCP segment (an ACK, not a SYN) built by hand on a raw socket
	// IPv6, behind a destination options extension header (IPV6_DSTOPTS),
	// which the transport header then follows.
	udpSendtoExt
	rawUDPExt
)

func (o op) String() string {
	return [...]string{"tcp connect", "udp connect", "udp sendto", "udplite connect", "udplite sendto", "raw udp", "raw tcp",
		"udp sendto behind dstopts", "raw udp behind dstopts"}[o]
}

type verdictCase struct {
	op     op
	dst    string // address; an IPv4-mapped one is used from an AF_INET6 socket
	port   int
	allow  bool
	reason string
}

func (c verdictCase) String() string {
	return fmt.Sprintf("%s [%s]:%d", c.op, c.dst, c.port)
}

// attempt runs one case on the calling thread and returns nil if the
// kernel let it through. An allowed TCP connection also echoes a message.
func attempt(c verdictCase) error { return attemptFrom(c, "") }

// attemptFrom is attempt from a source address (none: the kernel's
// choice). A UDP case sends its String() from there.
func attemptFrom(c verdictCase, from string) error {
	return attemptBound(c, from, 0, c.String())
}

// attemptBound is attemptFrom from port fromPort (0: any), sending payload
// in a datagram.
func attemptBound(c verdictCase, from string, fromPort int, payload string) error {
	a := netip.MustParseAddr(c.dst)
	fam := unix.AF_INET6
	var sa unix.Sockaddr = &unix.SockaddrInet6{Addr: a.As16(), Port: c.port}
	if a.Is4() {
		fam = unix.AF_INET
		sa = &unix.SockaddrInet4{Addr: a.As4(), Port: c.port}
	}
	typ, proto := unix.SOCK_DGRAM, 0
	switch c.op {
	case tcpConnect:
		typ = unix.SOCK_STREAM
	case udpliteConnect, udpliteSendto:
		proto = unix.IPPROTO_UDPLITE
	case rawUDP, rawUDPExt:
		typ, proto = unix.SOCK_RAW, unix.IPPROTO_UDP
	case rawTCP:
		typ, proto = unix.SOCK_RAW, unix.IPPROTO_TCP
	}
	fd, err := unix.Socket(fam, typ|unix.SOCK_CLOEXEC, proto)
	if err != nil {
		return fmt.Errorf("socket: %w", err)
	}
	defer unix.Close(fd)
	if c.op == udpSendtoExt || c.op == rawUDPExt {
		// Next header (the kernel's), length 0 (8 bytes), PadN of 4.
		opt := string([]byte{0, 0, 1, 4, 0, 0, 0, 0})
		if err := unix.SetsockoptString(fd, unix.IPPROTO_IPV6, unix.IPV6_DSTOPTS, opt); err != nil {
			return fmt.Errorf("IPV6_DSTOPTS: %w", err)
		}
	}
	tv := unix.Timeval{Sec: 1}
	unix.SetsockoptTimeval(fd, unix.SOL_SOCKET, unix.SO_SNDTIMEO, &tv)
	unix.SetsockoptTimeval(fd, unix.SOL_SOCKET, unix.SO_RCVTIMEO, &tv)
	if from != "" {
		// Free bind: the namespace's addresses are routes (AnyIP), which
		// IPv6 binds only with it.
		unix.SetsockoptInt(fd, unix.SOL_IP, unix.IP_FREEBIND, 1)
		src := netip.MustParseAddr(from)
		var bsa unix.Sockaddr = &unix.SockaddrInet6{Addr: src.As16(), Port: fromPort}
		if fam == unix.AF_INET {
			bsa = &unix.SockaddrInet4{Addr: src.As4(), Port: fromPort}
		}
		// A port an earlier socket of the test used may be in TIME_WAIT.
		unix.SetsockoptInt(fd, unix.SOL_SOCKET, unix.SO_REUSEADDR, 1)
		if err := unix.Bind(fd, bsa); err != nil {
			return fmt.Errorf("bind %s: %w", from, err)
		}
	}
	switch c.op {
	case udpSendto, udpliteSendto, udpSendtoExt:
		return unix.Sendto(fd, []byte(payload), 0, sa)
	case rawUDP, rawTCP, rawUDPExt:
		// The header by hand (checksum 0: none for UDP over IPv4, wrong
		// for TCP, which the receiver drops); the kernel adds the IP
		// header. The address's port means nothing here.
		d := binary.BigEndian.AppendUint16(binary.BigEndian.AppendUint16(nil, 40000), uint16(c.port))
		if c.op != rawTCP {
			d = append(d, byte((8+len(payload))>>8), byte(8+len(payload)), 0, 0)
		} else {
			// seq, ack, data offset 5 words, ACK, window, checksum, urgent
			d = append(d, 0, 0, 0, 1, 0, 0, 0, 1, 5<<4, 0x10, 0xff, 0xff, 0, 0, 0, 0)
		}
		switch a := sa.(type) {
		case *unix.SockaddrInet4:
			a.Port = 0
		case *unix.SockaddrInet6:
			a.Port = 0
		}
		return unix.Sendto(fd, append(d, payload...), 0, sa)
	case udpConnect, udpliteConnect:
		if err := unix.Connect(fd, sa); err != nil {
			return err
		}
		_, err := unix.Write(fd, []byte(payload))
		return err
	}
	if err := connect(fd, sa); err != nil {
		return err
	}
	msg := []byte("hello")
	if _, err := retryEINTR(func() (int, error) { return unix.Write(fd, msg) }); err != nil {
		return err
	}
	got := make([]byte, len(msg))
	if n, err := retryEINTR(func() (int, error) { return unix.Read(fd, got) }); err != nil || n != len(msg) {
		return fmt.Errorf("echo: %d bytes, %v", n, err)
	}
	return nil
}

// connect is connect(2) that outlasts signals. With a send timeout set, a
// signal (Go's preemption, SIGURG) ends the wait for the handshake with
// EINTR, which connect(2) does not restart (seen on 6.1 under qemu, where
// handshakes are slow); the handshake goes on, and its outcome is waited
// for as a non-blocking connect's is.
func connect(fd int, sa unix.Sockaddr) error {
	err := unix.Connect(fd, sa)
	if err != unix.EINTR {
		return err
	}
	deadline := time.Now().Add(time.Second)
	for {
		fds := []unix.PollFd{{Fd: int32(fd), Events: unix.POLLOUT}}
		n, err := unix.Poll(fds, max(0, int(time.Until(deadline).Milliseconds())))
		if err == unix.EINTR {
			continue
		}
		if err != nil {
			return err
		}
		if n == 0 {
			return unix.ETIMEDOUT
		}
		soerr, err := unix.GetsockoptInt(fd, unix.SOL_SOCKET, unix.SO_ERROR)
		if err != nil {
			return err
		}
		if soerr != 0 {
			return unix.Errno(soerr)
		}
		return nil
	}
}

// retryEINTR runs a read or write again when a signal interrupted it
// before any byte moved (a socket timeout makes them return EINTR).
func retryEINTR(call func() (int, error)) (int, error) {
	for {
		n, err := call()
		if err != unix.EINTR {
			return n, err
		}
	}
}

// The ruleset of the verdict table and, below, the same intent as
// nftables rules, written in the order policy.md says rules take
// precedence (first match wins in both).
const tableRules = `
scopes:
  - cgroup: %s
    egress:
      - {action: deny, cidr: 10.9.0.0/24, port: 80, proto: tcp}
      - {action: allow, cidr: 10.9.0.7}
      - {action: deny, cidr: 10.9.0.0/16, port: 5432}
      - {action: deny, cidr: "fd09::/64", proto: udp}
      - {action: allow, cidr: "fd09::5", port: 443, proto: udp}
      - {action: deny, cidr: 127.0.0.1, port: 81-82}
      - {action: allow, cidr: 127.0.0.1, port: 81, proto: tcp}
      - {action: deny, cidr: "::1", port: 82}
`

const tableNft = `
table inet shunt_test {
	chain out {
		type filter hook output priority 0; policy accept;
		ct direction reply accept
		ip daddr 10.9.0.7 accept
		ip daddr 10.9.0.0/24 tcp dport 80 drop
		ip daddr 10.9.0.0/16 th dport 5432 drop
		ip6 daddr fd09::5 udp dport 443 accept
		ip6 daddr fd09::/64 meta l4proto udp drop
		ip daddr 127.0.0.1 tcp dport 81 accept
		ip daddr 127.0.0.1 th dport 81-82 drop
		ip6 daddr ::1 th dport 82 drop
	}
}
`

var table = []verdictCase{
	{tcpConnect, "10.9.0.1", 80, false, "10.9.0.0/24 tcp 80"},
	{tcpConnect, "10.9.0.7", 80, true, "the longer 10.9.0.7/32"},
	{tcpConnect, "10.9.0.1", 443, true, "no rule: default"},
	{tcpConnect, "10.9.0.1", 5432, false, "the covering 10.9.0.0/16"},
	{tcpConnect, "10.9.3.1", 5432, false, "10.9.0.0/16 alone"},
	{tcpConnect, "10.9.0.7", 5432, true, "10.9.0.7/32 before its covering prefixes"},
	{tcpConnect, "::ffff:10.9.0.1", 80, false, "IPv4-mapped meets IPv4 rules"},
	{tcpConnect, "::ffff:10.9.0.7", 80, true, "IPv4-mapped, the longer prefix"},
	{tcpConnect, "fd09::1", 80, true, "fd09::/64 denies udp only"},
	{tcpConnect, "::1", 81, true, "IPv6 loopback is not 127.0.0.1"},
	{tcpConnect, "127.0.0.1", 81, true, "the narrower 81 tcp"},
	{tcpConnect, "127.0.0.1", 82, false, "81-82"},
	{udpConnect, "10.9.0.1", 80, true, "80 is denied for tcp only"},
	{udpConnect, "10.9.0.1", 5432, false, "10.9.0.0/16 any protocol"},
	{udpConnect, "::ffff:127.0.0.1", 81, false, "81 is allowed for tcp only"},
	{udpConnect, "fd09::5", 443, true, "fd09::5 udp 443"},
	{udpSendto, "fd09::1", 53, false, "fd09::/64 udp"},
	{udpSendto, "fd09::5", 443, true, "fd09::5/128 before fd09::/64"},
	{udpSendto, "fd09::5", 444, false, "fd09::5 allows 443 only"},
	{udpSendto, "::ffff:10.9.0.1", 5432, false, "IPv4-mapped sendto"},
	{udpSendto, "127.0.0.1", 81, false, "81 udp"},
	{udpSendto, "127.0.0.1", 83, true, "past the range"},
	{udpSendto, "10.9.0.9", 9, true, "default"},
	// The unspecified address as a destination is this host: Linux
	// connects and sends to 127.0.0.1 (IPv4, IPv4-mapped) and ::1.
	{tcpConnect, "0.0.0.0", 82, false, "0.0.0.0 is 127.0.0.1"},
	{tcpConnect, "::ffff:0.0.0.0", 82, false, "::ffff:0.0.0.0 is 127.0.0.1"},
	{tcpConnect, "::", 82, false, ":: is ::1"},
	{tcpConnect, "0.0.0.0", 81, true, "0.0.0.0 is 127.0.0.1, allowed on 81 for tcp"},
	{udpConnect, "0.0.0.0", 82, false, "0.0.0.0 is 127.0.0.1, connected UDP"},
	{udpSendto, "0.0.0.0", 81, false, "0.0.0.0 is 127.0.0.1, sendto"},
	{udpSendto, "::", 82, false, ":: is ::1, sendto"},
	{udpSendto, "::ffff:0.0.0.0", 82, false, "::ffff:0.0.0.0 is 127.0.0.1, sendto"},
	// What the connect and sendmsg hooks never see: judged per packet.
	{udpliteConnect, "10.9.0.1", 5432, false, "10.9.0.0/16 any protocol, UDP-Lite connected"},
	{udpliteConnect, "fd09::1", 53, true, "fd09::/64 denies udp, not UDP-Lite"},
	{udpliteConnect, "10.9.0.9", 9, true, "default"},
	{udpliteSendto, "10.9.0.1", 5432, false, "10.9.0.0/16 any protocol, UDP-Lite sendto"},
	{rawUDP, "10.9.0.1", 5432, false, "a hand-built datagram: 10.9.0.0/16"},
	{rawUDP, "10.9.0.1", 80, true, "80 is denied for tcp only"},
	{rawUDP, "127.0.0.1", 82, false, "81-82, raw"},
	{rawUDP, "10.9.0.9", 9, true, "default"},
	{rawTCP, "10.9.0.1", 80, false, "10.9.0.0/24 tcp 80: any segment, not only a SYN"},
	{rawTCP, "10.9.0.1", 443, true, "default"},
	{rawUDPExt, "fd09::1", 53, false, "fd09::/64 udp, behind an extension header"},
	{rawUDPExt, "fd09::5", 443, true, "fd09::5 udp 443, behind an extension header"},
}

// runTable runs every case from side and reports which were let through.
func runTable(t *testing.T, side testenv.Side) map[string]error {
	t.Helper()
	got := map[string]error{}
	for _, c := range table {
		side.Make(t, func() { got[c.String()] = attempt(c) })
	}
	return got
}

func checkTable(t *testing.T, got map[string]error, what string) {
	t.Helper()
	for _, c := range table {
		err := got[c.String()]
		if (err == nil) != c.allow {
			t.Errorf("%s: %s: allowed=%v (%v), want %v: %s", what, c, err == nil, err, c.allow, c.reason)
		}
		// A refusal at connect or send is EPERM, as netfilter's drop.
		if !c.allow && err != nil && !errors.Is(err, unix.EPERM) {
			t.Errorf("%s: %s: denied with %v, want EPERM", what, c, err)
		}
	}
}

// TestVerdicts runs the table over TCP and UDP, IPv4, IPv6 and IPv4-mapped,
// with and without shunt's bypass on the connections.
func TestVerdicts(t *testing.T) {
	for _, mode := range []string{"tcp path", "bypassed"} {
		t.Run(mode, func(t *testing.T) {
			p := mustPolicy(t)
			cg := testenv.MustCgroup(t)
			var in *bypass.Install
			if mode == "bypassed" {
				in = mustBypass(t, cg)
			}
			side := testenv.Side{NS: mustAddressNS(t), CG: cg}
			listeners(t, side, 80, 81, 82, 443, 5432)
			mustApply(t, p, mustParse(t, fmt.Sprintf(tableRules, cg.Path)))
			checkTable(t, runTable(t, side), mode)
			if in != nil {
				st, err := in.Stats()
				if err != nil {
					t.Fatal(err)
				}
				if st.Counters.Paired == 0 {
					t.Errorf("no connection was bypassed: the table did not test the bypass (%+v)", st)
				}
			}
		})
	}
}

// TestSameVerdictsAsNftables runs the table against nftables rules of the
// same intent, with no shunt policy, and expects the same verdicts.
func TestSameVerdictsAsNftables(t *testing.T) {
	testenv.RequireRoot(t)
	testenv.NeedProgram(t, "nft")
	ns := mustAddressNS(t)
	side := testenv.Side{NS: ns}
	listeners(t, side, 80, 81, 82, 443, 5432)
	ns.Nft(t, tableNft)
	got := runTable(t, side)
	for _, c := range table {
		err := got[c.String()]
		if (err == nil) != c.allow {
			t.Errorf("nftables: %s: allowed=%v (%v), want %v: %s", c, err == nil, err, c.allow, c.reason)
		}
	}
}

// TestNestedScopesMustAllAllow: a child scope cannot allow what its
// parent denies, and a parent's default does not override a child's deny.
func TestNestedScopesMustAllAllow(t *testing.T) {
	p := mustPolicy(t)
	parent := testenv.MustCgroup(t)
	child := host.Cgroup{Path: parent.Path + "/child"}
	if err := os.Mkdir(child.Path, 0o755); err != nil {
		t.Fatal(err)
	}
	t.Cleanup(func() { os.Remove(child.Path) })
	ns := mustAddressNS(t)
	listeners(t, testenv.Side{NS: ns}, 80, 443)
	mustApply(t, p, mustParse(t, fmt.Sprintf(`
scopes:
  - cgroup: %s
    egress: [{action: deny, cidr: 10.9.0.0/24, port: 80}]
  - cgroup: %s
    default: deny
    egress: [{action: allow, cidr: 10.9.0.0/16}]
`, parent.Path, child.Path)))
	side := testenv.Side{NS: ns, CG: child}
	for _, c := range []verdictCase{
		{tcpConnect, "10.9.0.1", 80, false, "the parent denies"},
		{tcpConnect, "10.9.0.1", 443, true, "both allow"},
		{tcpConnect, "127.0.0.1", 443, false, "the child's default denies"},
	} {
		var err error
		side.Make(t, func() { err = attempt(c) })
		if (err == nil) != c.allow {
			t.Errorf("%s: allowed=%v (%v), want %v: %s", c, err == nil, err, c.allow, c.reason)
		}
	}
}

// TestApplyClosesDeniedConnections: after an apply, connections the new
// rules deny fail at their next call and move no further byte, TCP or
// bypassed or connected UDP; the others go on.
func TestApplyClosesDeniedConnections(t *testing.T) {
	eachCloseMethod(t, testApplyClosesDeniedConnections)
}

// eachCloseMethod runs test with the sweep destroying by kfunc (6.5+) and
// through sock_diag (as before 6.5), where this kernel has the kfunc.
func eachCloseMethod(t *testing.T, test func(t *testing.T)) {
	t.Run("this-kernel", test)
	if host.HasSockDestroy() {
		t.Run("sock_diag", func(t *testing.T) {
			old := mechanisms
			mechanisms = host.Mechanisms{DiagDestroy: true}
			t.Cleanup(func() { mechanisms = old })
			test(t)
		})
	}
}

func testApplyClosesDeniedConnections(t *testing.T) {
	p := mustPolicy(t)
	cg := testenv.MustCgroup(t)
	in := mustBypass(t, cg)
	ns := mustAddressNS(t)
	side := testenv.Side{NS: ns, CG: cg}
	listeners(t, side, 80, 443)
	// A scope must hold the connections when they connect, for the apply
	// to know them for its own.
	mustApply(t, p, mustParse(t, fmt.Sprintf("scopes: [{cgroup: %s, egress: [{action: allow, cidr: 10.9.0.0/16}]}]", cg.Path)))

	dial := func(network, addr string) net.Conn {
		var c net.Conn
		var err error
		side.Make(t, func() { c, err = net.DialTimeout(network, addr, time.Second) })
		if err != nil {
			t.Fatal(err)
		}
		t.Cleanup(func() { c.Close() })
		return c
	}
	denied := dial("tcp", "10.9.0.1:80")
	bypassed := dial("tcp", "10.9.0.2:80")
	kept := dial("tcp", "10.9.0.1:443")
	udp := dial("udp", "10.9.0.1:80")
	for _, c := range []net.Conn{denied, bypassed, kept} {
		if err := echo(c); err != nil {
			t.Fatal(err)
		}
	}
	if st, _ := in.Stats(); st.Counters.Paired == 0 {
		t.Fatalf("no connection bypassed: %+v", st)
	}

	res := mustApply(t, p, mustParse(t, fmt.Sprintf("scopes: [{cgroup: %s, egress: [{action: deny, cidr: 10.9.0.0/16, port: 80}]}]", cg.Path)))
	if len(res.Closed) != 3 {
		t.Errorf("apply closed %d connections, want 3 (two TCP, one UDP): %+v", len(res.Closed), res.Closed)
	}
	for _, c := range []net.Conn{denied, bypassed} {
		if err := echo(c); err == nil {
			t.Errorf("%v -> %v: still echoes after the apply denied it", c.LocalAddr(), c.RemoteAddr())
		} else if !errors.Is(err, unix.ECONNABORTED) && !errors.Is(err, unix.ECONNRESET) && !errors.Is(err, io.EOF) {
			t.Errorf("%v -> %v: %v, want ECONNABORTED", c.LocalAddr(), c.RemoteAddr(), err)
		}
	}
	// A destroyed UDP socket is disconnected: sends fail for want of an
	// address, a read reports the abort.
	if _, err := udp.Write([]byte("x")); !errors.Is(err, unix.EDESTADDRREQ) {
		t.Errorf("connected UDP after the apply: send: %v, want EDESTADDRREQ", err)
	}
	udp.SetReadDeadline(time.Now().Add(time.Second))
	if _, err := udp.Read(make([]byte, 1)); !errors.Is(err, unix.ECONNABORTED) {
		t.Errorf("connected UDP after the apply: recv: %v, want ECONNABORTED", err)
	}
	if err := echo(kept); err != nil {
		t.Errorf("a connection the new rules allow: %v", err)
	}
	rep, err := p.Show()
	if err != nil {
		t.Fatal(err)
	}
	if got := rep.Scopes[0].Egress.Rules[0].Counts.Closed; got != 3 {
		t.Errorf("the rule counts %d closed connections, want 3", got)
	}
}

// TestApplyIsAtomic flips between two rulesets that both allow port 80 and
// deny port 443, by different rules, while 1,000 connections open and send:
// a moment when neither ruleset held would let one through or stop one.
func TestApplyIsAtomic(t *testing.T) {
	p := mustPolicy(t)
	cg := testenv.MustCgroup(t)
	ns := mustAddressNS(t)
	side := testenv.Side{NS: ns, CG: cg}
	listeners(t, side, 80, 443)
	a := mustParse(t, fmt.Sprintf(`
scopes:
  - cgroup: %s
    default: deny
    egress: [{action: allow, cidr: 10.9.0.1, port: 80, proto: tcp}]
`, cg.Path))
	b := mustParse(t, fmt.Sprintf(`
scopes:
  - cgroup: %s
    egress:
      - {action: allow, cidr: 10.9.0.0/24, port: 80}
      - {action: deny, cidr: 10.9.0.0/16}
`, cg.Path))
	// Rules for elsewhere make each apply write long enough for a gap
	// between the rulesets to be met.
	for _, rs := range []*policy.Ruleset{&a, &b} {
		for i := range 2000 {
			rs.Scopes[0].Egress = append(rs.Scopes[0].Egress, policy.Rule{
				Action: policy.Deny, CIDR: netip.PrefixFrom(netip.AddrFrom4([4]byte{10, 8, byte(i >> 8), byte(i)}), 32),
			})
		}
	}
	mustApply(t, p, a)

	const conns = 1000
	var wrong []string
	var mu sync.Mutex
	var wg sync.WaitGroup
	stop := make(chan struct{})
	flips := 0
	wg.Add(1)
	go func() {
		defer wg.Done()
		for i := 0; ; i++ {
			select {
			case <-stop:
				return
			default:
			}
			rs := a
			if i%2 == 0 {
				rs = b
			}
			if _, err := p.Apply(context.Background(), rs); err != nil {
				t.Error(err)
				return
			}
			flips++
		}
	}()
	deadline := time.Now().Add(60 * time.Second)
	side.Make(t, func() {
		for i := 0; i < conns && time.Now().Before(deadline); i++ {
			c := verdictCase{op: tcpConnect, dst: "10.9.0.1", port: 80, allow: true}
			if i%2 == 1 {
				c.port, c.allow = 443, false
			}
			if err := attempt(c); (err == nil) != c.allow {
				mu.Lock()
				wrong = append(wrong, fmt.Sprintf("%s: %v", c, err))
				mu.Unlock()
			}
			// Paced so that the connections span many applies.
			time.Sleep(3 * time.Millisecond)
		}
	})
	close(stop)
	wg.Wait()
	if flips < 10 {
		t.Errorf("only %d applies ran during the connections: the test did not test", flips)
	}
	if len(wrong) > 0 {
		t.Errorf("%d of %d connections met neither ruleset (%d applies), first: %s", len(wrong), conns, flips, wrong[0])
	}
	t.Logf("%d connections, %d applies", conns, flips)
}

// TestCounters: each rule and each default counts exactly what it decided.
func TestCounters(t *testing.T) {
	p := mustPolicy(t)
	cg := testenv.MustCgroup(t)
	ns := mustAddressNS(t)
	side := testenv.Side{NS: ns, CG: cg}
	listeners(t, side, 80)
	mustApply(t, p, mustParse(t, fmt.Sprintf(`
scopes:
  - cgroup: %s
    egress:
      - {action: deny, cidr: 10.9.0.0/24, proto: tcp}
      - {action: deny, cidr: 10.9.0.0/24, port: 53, proto: udp}
`, cg.Path)))
	side.Make(t, func() {
		for range 3 {
			attempt(verdictCase{op: tcpConnect, dst: "10.9.0.1", port: 80})
		}
		for range 2 {
			attempt(verdictCase{op: udpSendto, dst: "10.9.0.1", port: 53})
		}
		attempt(verdictCase{op: tcpConnect, dst: "10.9.1.1", port: 80})
	})
	rep, err := p.Show()
	if err != nil {
		t.Fatal(err)
	}
	s := rep.Scopes[0]
	if s.Cgroup != cg.Path || len(s.Egress.Rules) != 2 {
		t.Fatalf("show: %+v", rep)
	}
	if got := s.Egress.Rules[0].Counts; got != (policy.Counts{Connects: 3}) {
		t.Errorf("tcp rule: %+v, want 3 connects", got)
	}
	if got := s.Egress.Rules[1].Counts; got != (policy.Counts{Sends: 2}) {
		t.Errorf("udp rule: %+v, want 2 sends", got)
	}
	if got := s.Egress.DefaultCounts; got != (policy.Counts{Connects: 1}) {
		t.Errorf("default: %+v, want 1 connect", got)
	}
	// A rule that stays across an apply keeps its counts.
	rs := rep.Ruleset()
	rs.Scopes[0].Egress = rs.Scopes[0].Egress[:1]
	mustApply(t, p, rs)
	if rep, err = p.Show(); err != nil {
		t.Fatal(err)
	}
	if got := rep.Scopes[0].Egress.Rules[0].Counts; got != (policy.Counts{Connects: 3}) {
		t.Errorf("after an apply that kept it: %+v, want 3 connects", got)
	}
}
