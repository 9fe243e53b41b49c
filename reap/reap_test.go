package reap_test

import (
	"context"
	"errors"
	"fmt"
	"io"
	"net"
	"net/netip"
	"syscall"
	"testing"
	"time"
	"unsafe"

	"golang.org/x/sys/unix"

	"github.com/shunt-project/shunt/bypass"
	"github.com/shunt-project/shunt/bypass/bypasstest"
	"github.com/shunt-project/shunt/host"
	"github.com/shunt-project/shunt/internal/testenv"
	"github.com/shunt-project/shunt/reap"
	"github.com/shunt-project/shunt/sockindex"
)

// mustIndex enables the index for a fresh cgroup at a fresh pin dir.
func mustIndex(t *testing.T) (*sockindex.Index, host.Cgroup, string) {
	t.Helper()
	testenv.RequireRoot(t)
	testenv.WatchKernelLog(t)
	dir := bypasstest.MustPinDir(t)
	cg := testenv.MustCgroup(t)
	ix, _, err := sockindex.Create(dir, cg)
	if err != nil {
		t.Fatal(err)
	}
	t.Cleanup(func() { ix.Close() })
	return ix, cg, dir
}

// conn is a client socket of either protocol with its far end.
type conn struct {
	c      net.Conn
	far    net.Conn // TCP: the accepted socket; UDP: the server socket
	cookie uint64
}

// server listens on addr (TCP or UDP) inside side.
type server struct {
	proto string
	ln    *net.TCPListener
	pc    *net.UDPConn
}

func mustServer(t *testing.T, side testenv.Side, proto, addr string) *server {
	t.Helper()
	s := &server{proto: proto}
	if proto == "tcp" {
		s.ln = testenv.Listen(t, side, "tcp", addr)
		return s
	}
	var err error
	side.Make(t, func() {
		var ua *net.UDPAddr
		if ua, err = net.ResolveUDPAddr("udp", addr); err == nil {
			s.pc, err = net.ListenUDP("udp", ua)
		}
	})
	if err != nil {
		t.Fatalf("listen udp %s: %v", addr, err)
	}
	t.Cleanup(func() { s.pc.Close() })
	return s
}

// dial connects a client in side to host:port and checks one message gets
// through (for UDP that first send also lets the index learn the local port).
func (s *server) dial(t *testing.T, side testenv.Side, hostport string) conn {
	t.Helper()
	if s.proto == "tcp" {
		c := testenv.Dial(t, side, "tcp", hostport, nil)
		far := testenv.Accept(t, s.ln)
		return conn{c: c, far: far, cookie: testenv.Cookie(t, c)}
	}
	var c *net.UDPConn
	var err error
	side.Make(t, func() {
		var ua *net.UDPAddr
		if ua, err = net.ResolveUDPAddr("udp", hostport); err == nil {
			c, err = net.DialUDP("udp", nil, ua)
		}
	})
	if err != nil {
		t.Fatalf("dial udp %s: %v", hostport, err)
	}
	t.Cleanup(func() { c.Close() })
	if _, err := c.Write([]byte("hello")); err != nil {
		t.Fatal(err)
	}
	return conn{c: c, far: s.pc, cookie: testenv.Cookie(t, c)}
}

// alive checks that the client can still exchange a message.
func alive(t *testing.T, k conn) {
	t.Helper()
	if _, ok := k.c.(*net.TCPConn); ok {
		if _, err := k.c.Write([]byte("ping")); err != nil {
			t.Fatalf("write on a socket that should live: %v", err)
		}
		buf := make([]byte, 4)
		k.far.SetReadDeadline(time.Now().Add(5 * time.Second))
		if _, err := k.far.Read(buf); err != nil {
			t.Fatalf("read on a socket that should live: %v", err)
		}
		return
	}
	// UDP: the server answers the client's address.
	pc := k.far.(*net.UDPConn)
	if _, err := pc.WriteTo([]byte("pong"), k.c.LocalAddr()); err != nil {
		t.Fatal(err)
	}
	k.c.SetReadDeadline(time.Now().Add(5 * time.Second))
	buf := make([]byte, 16)
	if _, err := k.c.Read(buf); err != nil {
		t.Fatalf("read on a UDP socket that should live: %v", err)
	}
}

// dead checks the application sees ECONNABORTED.
func dead(t *testing.T, k conn) {
	t.Helper()
	k.c.SetReadDeadline(time.Now().Add(5 * time.Second))
	_, err := k.c.Read(make([]byte, 16))
	if !errors.Is(err, syscall.ECONNABORTED) {
		t.Fatalf("read on a reaped socket: got %v, want ECONNABORTED", err)
	}
}

// reapMethods are the ways a reap can go on this kernel: by the index, and
// by the iterators, destroying with the kfunc where the kernel has it (6.5)
// and through sock_diag (as before 6.5, forced where it has).
func reapMethods() []reapMethod {
	m := []reapMethod{{"index", reap.Index, "sock_diag"}, {"iter-diag", reap.Iter, "sock_diag"}}
	if host.HasSockDestroy() {
		m = append(m, reapMethod{"iter", reap.Iter, "kfunc"})
	}
	return m
}

type reapMethod struct {
	name      string
	method    reap.Method
	destroyBy string
}

// options reap with this method, destroying as it names.
func (m reapMethod) options(indexDir string) reap.Options {
	diag := m.method == reap.Iter && m.destroyBy == "sock_diag"
	return reap.Options{IndexDir: indexDir, Method: m.method, Mechanisms: host.Mechanisms{DiagDestroy: diag}}
}

func dryRun(o reap.Options) reap.Options {
	o.DryRun = true
	return o
}

func TestReapExactlyTheBackendsSockets(t *testing.T) {
	for _, m := range reapMethods() {
		for _, tc := range []struct{ proto, ip, other string }{
			{"tcp", "127.0.0.1", "127.0.0.2"},
			{"tcp", "::1", "127.0.0.1"},
			{"udp", "127.0.0.1", "127.0.0.2"},
			{"udp", "::1", "127.0.0.1"},
		} {
			t.Run(fmt.Sprintf("%s/%s/%s", m.name, tc.proto, tc.ip), func(t *testing.T) {
				testReapExact(t, m, tc.proto, tc.ip, tc.other)
			})
		}
	}
}

// Two namespaces hold identical addresses. In each: sockets to the backend,
// to the same address on another port, and to another address on the same
// port. Only the first kind dies, in both namespaces.
func testReapExact(t *testing.T, m reapMethod, proto, ip, other string) {
	method := m.method
	_, cg, dir := mustIndex(t)
	const port, otherPort = 7001, 7002
	hp := func(h string, p int) string { return net.JoinHostPort(h, fmt.Sprint(p)) }

	var victims, bystanders []conn
	var sides []testenv.Side
	var targets []*server
	for range 2 {
		side := testenv.Side{NS: testenv.MustNetNS(t), CG: cg}
		sides = append(sides, side)
		target := mustServer(t, side, proto, hp(ip, port))
		sameAddr := mustServer(t, side, proto, hp(ip, otherPort))
		otherAddr := mustServer(t, side, proto, hp(other, port))
		targets = append(targets, target)
		for range 3 {
			victims = append(victims, target.dial(t, side, hp(ip, port)))
		}
		for range 2 {
			bystanders = append(bystanders, sameAddr.dial(t, side, hp(ip, otherPort)))
			bystanders = append(bystanders, otherAddr.dial(t, side, hp(other, port)))
		}
	}

	pr := sockindex.TCP
	if proto == "udp" {
		pr = sockindex.UDP
	}
	target := reap.Target{Addr: netip.MustParseAddr(ip), Port: port, Protos: []sockindex.Proto{pr}}
	res, err := reap.Reap(context.Background(), target, m.options(dir))
	if err != nil {
		t.Fatal(err)
	}
	if res.DestroyBy != m.destroyBy {
		t.Errorf("destroyed by %q, want %q", res.DestroyBy, m.destroyBy)
	}
	want := map[uint64]bool{}
	for _, v := range victims {
		want[v.cookie] = true
	}
	got := map[uint64]bool{}
	for _, s := range res.Sockets {
		if !s.Destroyed {
			t.Errorf("not destroyed: %+v", s)
		}
		got[s.Cookie] = true
	}
	for c := range want {
		if !got[c] {
			t.Errorf("socket %d connected to the backend was not destroyed", c)
		}
	}
	for c := range got {
		if !want[c] {
			t.Errorf("socket %d was destroyed but is not connected to the backend", c)
		}
	}
	if method == reap.Index && res.Namespaces != 2 {
		t.Errorf("reaped in %d namespaces, want 2", res.Namespaces)
	}
	for _, v := range victims {
		dead(t, v)
	}
	for _, b := range bystanders {
		alive(t, b)
	}

	// Sockets connected after the reap are untouched, and the next reap
	// (a dry run) finds exactly them: nothing of the reaped ones is left.
	later := map[uint64]conn{}
	for i, side := range sides {
		k := targets[i].dial(t, side, hp(ip, port))
		later[k.cookie] = k
	}
	again, err := reap.Reap(context.Background(), target, dryRun(m.options(dir)))
	if err != nil {
		t.Fatal(err)
	}
	if len(again.Sockets) != len(later) {
		t.Errorf("dry run after the reap found %d sockets, want the %d made since: %+v", len(again.Sockets), len(later), again.Sockets)
	}
	for _, s := range again.Sockets {
		if _, ok := later[s.Cookie]; !ok || s.Destroyed {
			t.Errorf("dry run after the reap: unexpected %+v", s)
		}
	}
	for _, k := range later {
		alive(t, k)
	}
}

// A UDP socket that disconnects (connect AF_UNSPEC, which no hook sees) is
// no longer connected to the backend and must survive the reap, whether it
// keeps its port (bound before connect) or loses it (bound by connect).
func TestReapSparesDisconnectedUDP(t *testing.T) {
	_, cg, dir := mustIndex(t)
	side := testenv.Side{NS: testenv.MustNetNS(t), CG: cg}
	srv := mustServer(t, side, "udp", "127.0.0.1:7001")
	var fds []int
	side.Make(t, func() {
		for _, bind := range []bool{true, false} {
			fd, err := unix.Socket(unix.AF_INET, unix.SOCK_DGRAM|unix.SOCK_CLOEXEC, 0)
			if err != nil {
				t.Fatal(err)
			}
			t.Cleanup(func() { unix.Close(fd) })
			if bind {
				// An explicit port survives the disconnect, and the
				// wildcard address then matches any tuple with it.
				if err := unix.Bind(fd, &unix.SockaddrInet4{Port: 7555}); err != nil {
					t.Fatal(err)
				}
			}
			if err := unix.Connect(fd, &unix.SockaddrInet4{Port: 7001, Addr: [4]byte{127, 0, 0, 1}}); err != nil {
				t.Fatal(err)
			}
			unix.Write(fd, []byte("x"))
			disconnect(t, fd)
			fds = append(fds, fd)
		}
	})
	_ = srv // the backend exists, so the sends above are not refused
	res, err := reap.Reap(context.Background(), reap.Target{Addr: netip.MustParseAddr("127.0.0.1"), Port: 7001}, reap.Options{IndexDir: dir, Method: reap.Index})
	if err != nil {
		t.Fatal(err)
	}
	if res.Destroyed() != 0 {
		t.Errorf("destroyed %d disconnected sockets: %+v", res.Destroyed(), res.Sockets)
	}
	for _, fd := range fds {
		if v, err := unix.GetsockoptInt(fd, unix.SOL_SOCKET, unix.SO_ERROR); err != nil || v != 0 {
			t.Errorf("socket error %d (%v) on a socket that was not reaped", v, err)
		}
	}
}

// disconnect dissolves a UDP socket's association: connect(AF_UNSPEC).
func disconnect(t *testing.T, fd int) {
	t.Helper()
	var sa [16]byte // sa_family AF_UNSPEC (0)
	if _, _, e := unix.Syscall(unix.SYS_CONNECT, uintptr(fd), uintptr(unsafe.Pointer(&sa[0])), uintptr(len(sa))); e != 0 {
		t.Fatalf("disconnect: %v", e)
	}
}

// Bypass and the index share the sockops hook of a cgroup: a bypassed
// connection is indexed, and reaping it aborts both ends as over plain TCP
// and leaves nothing behind in either install.
func TestReapBypassedConnection(t *testing.T) {
	ix, cg, dir := mustIndex(t)
	in, err := bypass.Create(bypasstest.MustPinDir(t), bypass.Options{})
	if err != nil {
		t.Fatal(err)
	}
	defer in.Close()
	if _, err := in.Attach(cg); err != nil {
		t.Fatal(err)
	}
	side := testenv.Side{NS: testenv.MustNetNS(t), CG: cg}
	c, s := testenv.ConnPair(t, "tcp4", side, "127.0.0.1:7003", side, "127.0.0.1:7003")
	c.Write([]byte("hello"))
	if _, err := io.ReadFull(s, make([]byte, 5)); err != nil {
		t.Fatal(err)
	}
	if st, _ := in.Stats(); st.Counters.Paired != 1 {
		t.Fatalf("connection not bypassed: %+v", st.Counters)
	}

	res, err := reap.Reap(context.Background(), reap.Target{Addr: netip.MustParseAddr("127.0.0.1"), Port: 7003}, reap.Options{IndexDir: dir, Method: reap.Index})
	if err != nil || res.Destroyed() != 1 {
		t.Fatalf("reap: %v %+v", err, res)
	}
	dead(t, conn{c: c})
	s.SetReadDeadline(time.Now().Add(5 * time.Second))
	if _, err := s.Read(make([]byte, 8)); !errors.Is(err, syscall.ECONNRESET) {
		t.Errorf("server read after its client was reaped: %v, want ECONNRESET", err)
	}
	// Both ends stay listed, closed, while the application holds them.
	if flows, err := in.Flows(); err != nil || len(flows) != 1 || flows[0].Client.TCPState != "CLOSE" || flows[0].Server.TCPState != "CLOSE" {
		t.Errorf("flows after the reap: %+v %v, want the connection closed at both ends", flows, err)
	}
	c.Close()
	s.Close()
	if flows, err := in.Flows(); err != nil || len(flows) != 0 {
		t.Errorf("bypass still lists %d flows after close (%v)", len(flows), err)
	}
	if left, err := ix.List(); err != nil || len(left) != 0 {
		t.Errorf("index still holds %+v (%v)", left, err)
	}
}

// A Reaper kept by a control plane reaches namespaces made after its first
// reap, and lets go of namespaces it no longer reaps in (its socket would
// keep a dead namespace alive).
func TestReaperOverTime(t *testing.T) {
	ix, cg, _ := mustIndex(t)
	rp := reap.NewReaper(ix)
	defer rp.Close()
	target := reap.Target{Addr: netip.MustParseAddr("127.0.0.1"), Port: 7004, Protos: []sockindex.Proto{sockindex.TCP}}
	reapOne := func() {
		t.Helper()
		side := testenv.Side{NS: testenv.MustNetNS(t), CG: cg}
		srv := mustServer(t, side, "tcp", "127.0.0.1:7004")
		k := srv.dial(t, side, "127.0.0.1:7004")
		res, err := rp.Reap(context.Background(), target, reap.Options{})
		if err != nil || res.Destroyed() != 1 {
			t.Fatalf("reap in a new namespace: %v %+v", err, res)
		}
		dead(t, k)
	}
	reapOne()
	reapOne() // a namespace the first reap's scan did not see
	if rp.Cached() != 2 {
		t.Errorf("reaper holds %d namespaces, want 2", rp.Cached())
	}
	for i := 0; i < 17; i++ {
		if _, err := rp.Reap(context.Background(), target, reap.Options{}); err != nil {
			t.Fatal(err)
		}
	}
	if rp.Cached() != 0 {
		t.Errorf("reaper still holds %d namespaces after 17 reaps without them", rp.Cached())
	}
}

// A dual-stack socket (AF_INET6) connected to an IPv4 backend through its
// mapped address is connected to that backend: reaping the IPv4 address
// destroys it, by either method.
func TestReapDualStackSockets(t *testing.T) {
	for _, m := range reapMethods() {
		for _, proto := range []int{unix.SOCK_STREAM, unix.SOCK_DGRAM} {
			name := map[int]string{unix.SOCK_STREAM: "tcp", unix.SOCK_DGRAM: "udp"}[proto]
			t.Run(fmt.Sprintf("%s/%s", m.name, name), func(t *testing.T) {
				_, cg, dir := mustIndex(t)
				side := testenv.Side{NS: testenv.MustNetNS(t), CG: cg}
				mustServer(t, side, name, "127.0.0.1:7005")
				var fd int
				side.Make(t, func() {
					var err error
					if fd, err = unix.Socket(unix.AF_INET6, proto|unix.SOCK_CLOEXEC, 0); err != nil {
						t.Fatal(err)
					}
					t.Cleanup(func() { unix.Close(fd) })
					mapped := netip.MustParseAddr("::ffff:127.0.0.1").As16()
					if err := unix.Connect(fd, &unix.SockaddrInet6{Port: 7005, Addr: mapped}); err != nil {
						t.Fatal(err)
					}
					unix.Write(fd, []byte("x"))
				})
				cookie, _ := unix.GetsockoptUint64(fd, unix.SOL_SOCKET, unix.SO_COOKIE)
				res, err := reap.Reap(context.Background(), reap.Target{Addr: netip.MustParseAddr("127.0.0.1"), Port: 7005}, m.options(dir))
				if err != nil || res.Destroyed() != 1 || res.Sockets[0].Cookie != cookie || res.DestroyBy != m.destroyBy {
					t.Fatalf("reap: %v %+v, want socket %d destroyed by %s", err, res, cookie, m.destroyBy)
				}
				if v, _ := unix.GetsockoptInt(fd, unix.SOL_SOCKET, unix.SO_ERROR); v != int(unix.ECONNABORTED) {
					t.Errorf("SO_ERROR %d after the reap, want ECONNABORTED", v)
				}
			})
		}
	}
}

// A connected UDP socket that never sent: the index does not know its local
// port (the kernel picks it at connect, after the hook), so reap learns it
// from its namespace's socket list and still destroys exactly it.
func TestReapUDPThatNeverSent(t *testing.T) {
	ix, cg, dir := mustIndex(t)
	side := testenv.Side{NS: testenv.MustNetNS(t), CG: cg}
	mustServer(t, side, "udp", "127.0.0.1:7006")
	var quiet, other int
	side.Make(t, func() {
		for _, fd := range []*int{&quiet, &other} {
			var err error
			if *fd, err = unix.Socket(unix.AF_INET, unix.SOCK_DGRAM|unix.SOCK_CLOEXEC, 0); err != nil {
				t.Fatal(err)
			}
			t.Cleanup(func() { unix.Close(*fd) })
		}
		if err := unix.Connect(quiet, &unix.SockaddrInet4{Port: 7006, Addr: [4]byte{127, 0, 0, 1}}); err != nil {
			t.Fatal(err)
		}
		// Same address, another port: must survive.
		if err := unix.Connect(other, &unix.SockaddrInet4{Port: 7007, Addr: [4]byte{127, 0, 0, 1}}); err != nil {
			t.Fatal(err)
		}
	})
	got, err := ix.Lookup(sockindex.Backend{Addr: netip.MustParseAddr("127.0.0.1"), Port: 7006, Proto: sockindex.UDP})
	if err != nil || len(got) != 1 || got[0].LocalKnown {
		t.Fatalf("index holds %+v (%v), want one entry without a local address", got, err)
	}
	res, err := reap.Reap(context.Background(), reap.Target{Addr: netip.MustParseAddr("127.0.0.1"), Port: 7006}, reap.Options{IndexDir: dir, Method: reap.Index})
	cookie, _ := unix.GetsockoptUint64(quiet, unix.SOL_SOCKET, unix.SO_COOKIE)
	if err != nil || res.Destroyed() != 1 || res.Sockets[0].Cookie != cookie {
		t.Fatalf("reap: %v %+v, want socket %d destroyed", err, res, cookie)
	}
	if v, _ := unix.GetsockoptInt(quiet, unix.SOL_SOCKET, unix.SO_ERROR); v != int(unix.ECONNABORTED) {
		t.Errorf("SO_ERROR %d on the reaped socket, want ECONNABORTED", v)
	}
	if v, _ := unix.GetsockoptInt(other, unix.SOL_SOCKET, unix.SO_ERROR); v != 0 {
		t.Errorf("SO_ERROR %d on the socket to another port", v)
	}
}

// The process that connected a socket may be gone while the socket lives on
// in another (passed by SCM_RIGHTS, or inherited): reap then reaches the
// socket's namespace another way (another pid the index knows, then every
// namespace of the host) and destroys it all the same.
func TestReapAfterTheConnectingProcessExited(t *testing.T) {
	ix, cg, dir := mustIndex(t)
	ns := testenv.MustNetNS(t)
	side := testenv.Side{NS: ns, CG: cg}
	srv := mustServer(t, side, "tcp", "127.0.0.1:0")
	addr := srv.ln.Addr().(*net.TCPAddr)

	// A short-lived process connects, hands the socket over and exits.
	c, pid := testenv.DialFromChild(t, side, addr)
	defer c.Close()
	far := testenv.Accept(t, srv.ln)

	if err := syscall.Kill(pid, 0); !errors.Is(err, syscall.ESRCH) {
		t.Fatalf("the connecting process %d still runs: %v", pid, err)
	}
	socks, err := ix.Lookup(sockindex.Backend{Addr: netip.MustParseAddr("127.0.0.1"), Port: uint16(addr.Port), Proto: sockindex.TCP})
	if err != nil || len(socks) != 1 || socks[0].Owner != pid {
		t.Fatalf("the index holds %+v (%v); want the one socket, owned by the exited pid %d", socks, err, pid)
	}
	target := reap.Target{Addr: netip.MustParseAddr("127.0.0.1"), Port: uint16(addr.Port), Protos: []sockindex.Proto{sockindex.TCP}}
	res, err := reap.Reap(context.Background(), target, reap.Options{IndexDir: dir, Method: reap.Index})
	if err != nil {
		t.Fatal(err)
	}
	if res.Destroyed() != 1 {
		t.Fatalf("destroyed %d sockets, want the one whose connecting process exited: %+v", res.Destroyed(), res.Sockets)
	}
	dead(t, conn{c: c, far: far})
}
