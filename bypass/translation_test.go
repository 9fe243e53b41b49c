package bypass_test

import (
	"fmt"
	"io"
	"net"
	"os"
	"os/exec"
	"strings"
	"testing"
	"time"

	"golang.org/x/sys/unix"

	"github.com/shunt-project/shunt/bypass"
	"github.com/shunt-project/shunt/bypass/bypasstest"
	"github.com/shunt-project/shunt/host"
	"github.com/shunt-project/shunt/internal/testenv"
)

// A translated connection: the client dials vip, address translation in
// between delivers it to the server listening on listen. Both ends are in
// the enabled cgroup.
type translation struct {
	client, server *testenv.NetNS
	router         *testenv.NetNS // between them, if routed
	listen, vip    string
	// seenFrom is the client address the server sees, when translation
	// rewrites it too (masquerade); "" when it is the client's own.
	seenFrom string
	// sameNetns: the server is in the namespace that translates, where
	// conntrack answers its SO_ORIGINAL_DST (elsewhere: ENOENT, shunt or
	// not).
	sameNetns bool
	// ln: the server's listener, if made already (else checkTranslated
	// listens on listen).
	ln *net.TCPListener
}

// Connections through the address translation a node runs already (a
// Service's DNAT in a router, that and masquerade, a sidecar's REDIRECT, a
// published port's DNAT on output) are bypassed, byte-exact, with what each
// end sees (its addresses, SO_ORIGINAL_DST) as without shunt.
func TestBypassThroughTranslation(t *testing.T) {
	testenv.NeedProgram(t, "nft")
	testenv.NeedProgram(t, "iptables")
	in, cg := mustInstall(t)
	for _, fam := range []string{"ipv4", "ipv6"} {
		for _, tc := range []struct {
			name  string
			build func(t *testing.T, v6 bool) translation
		}{
			{"dnat-in-router", func(t *testing.T, v6 bool) translation { return routed(t, v6, false) }},
			{"dnat-and-masquerade-in-router", func(t *testing.T, v6 bool) translation { return routed(t, v6, true) }},
			{"hairpin-through-router", hairpin},
			{"iptables-service-chains-in-router", routedByIptables},
			{"kube-proxy-nftables-chains-in-router", routedByKubeProxyNftables},
			{"kube-proxy-nftables-hairpin", func(t *testing.T, v6 bool) translation {
				// The endpoint's own chain marks it for masquerade.
				tr := routedByKubeProxyNftables(t, v6)
				tr.client, tr.seenFrom = tr.server, pick(v6, "10.202.0.1", "fd00:202::1")
				return tr
			}},
			{"redirect-on-output", redirected},
			{"dnat-on-output-over-veth", publishedPort},
		} {
			if testing.Short() && !inKernelMatrix[fam+"/"+tc.name] {
				continue // not a skip: the matrix counts skips as failures
			}
			t.Run(fam+"/"+tc.name, func(t *testing.T) {
				tr := tc.build(t, fam == "ipv6")
				checkTranslated(t, in, cg, tr)
			})
		}
	}
}

// inKernelMatrix: the cases -short runs (the kernel matrix under qemu, where
// each takes 20-40 s): a routed DNAT over IPv6, kube-proxy's nftables layout
// with a masqueraded hairpin (DNAT, masquerade, verdict maps), and a
// REDIRECT on output over loopback. The host runs them all.
var inKernelMatrix = map[string]bool{
	"ipv6/dnat-in-router":              true,
	"ipv4/kube-proxy-nftables-hairpin": true,
	"ipv4/redirect-on-output":          true,
}

func checkTranslated(t *testing.T, in *bypass.Install, cg host.Cgroup, tr translation) {
	before, err := in.Stats()
	if err != nil {
		t.Fatal(err)
	}
	ln := tr.ln
	if ln == nil {
		ln = testenv.Listen(t, testenv.Side{NS: tr.server, CG: cg}, "tcp", tr.listen)
	}
	c := testenv.Dial(t, testenv.Side{NS: tr.client, CG: cg}, "tcp", tr.vip, nil)
	s := testenv.Accept(t, ln)
	defer c.Close()
	defer s.Close()

	// What each end sees is the translation's doing, not shunt's.
	if got := c.RemoteAddr().String(); got != tr.vip {
		t.Errorf("client's peer %s, want %s", got, tr.vip)
	}
	wantFrom := c.LocalAddr().(*net.TCPAddr).IP.String()
	if tr.seenFrom != "" {
		wantFrom = tr.seenFrom
	}
	if got := s.RemoteAddr().(*net.TCPAddr); got.IP.String() != wantFrom {
		t.Errorf("server sees the client as %s, want %s", got, wantFrom)
	}
	if tr.sameNetns {
		if got, err := testenv.OriginalDst(s); err != nil || got.String() != tr.vip {
			t.Errorf("server's SO_ORIGINAL_DST %s (%v), want %s", got, err, tr.vip)
		}
	}

	testenv.Warm(t, c, s)
	streamBothWays(t, c, s, 4<<20)
	f := flowOf(t, in, testenv.Cookie(t, c))
	if f == nil || f.Client == nil || f.Server == nil {
		st, _ := in.Stats()
		t.Fatalf("not bypassed: flow %+v; counters %+v", f, st.Counters)
	}
	// Half of each direction goes by redirect whatever the pace, or, where
	// flow control's bound is smaller (a quarter of tcp_rmem[2]: 1.5 MiB
	// on 6.1 and 6.12), the bound: a writer's sends take TCP only once its
	// reader holds that much unread.
	if least := redirectedAtLeast(t, tr.server, 4<<20); f.Client.TxBytes < least {
		t.Errorf("redirected %d bytes of 4 MiB up, want at least %d", f.Client.TxBytes, least)
	}
	if least := redirectedAtLeast(t, tr.client, 4<<20); f.Server.TxBytes < least {
		t.Errorf("redirected %d bytes of 4 MiB down, want at least %d", f.Server.TxBytes, least)
	}
	after, _ := in.Stats()
	if n := after.Counters.Translated - before.Counters.Translated; n != 1 {
		t.Errorf("%d connections counted as translated, want 1", n)
	}
}

// redirectedAtLeast is what flow control lets go by redirect of a stream of
// size bytes to a reader in ns at the least: half of it, or the bound on
// that reader's unread bytes if that is less.
func redirectedAtLeast(t *testing.T, ns *testenv.NetNS, size uint64) uint64 {
	t.Helper()
	var bufs bypass.TCPBuffers
	ns.Do(t, func() {
		var err error
		if bufs, err = bypass.ReadTCPBuffers(); err != nil {
			t.Fatal(err)
		}
	})
	return min(size/2, bufs.Bound(bypass.DefaultMaxBacklog))
}

// streamBothWays sends size bytes from c to s, then back, and checks them.
func streamBothWays(t *testing.T, c, s *net.TCPConn, size int64) (up, down testenv.Stream) {
	t.Helper()
	up = testenv.Stream{Seed: 21, Size: size, MaxChunk: 64 << 10}
	down = testenv.Stream{Seed: 22, Size: size, MaxChunk: 64 << 10}
	for _, d := range []struct {
		st   testenv.Stream
		w, r *net.TCPConn
	}{{up, c, s}, {down, s, c}} {
		wrote := make(chan error, 1)
		go func() { wrote <- d.st.Write(d.w) }()
		if err := d.st.Check(d.r, false); err != nil {
			t.Fatal(err)
		}
		if err := <-wrote; err != nil {
			t.Fatal(err)
		}
	}
	return up, down
}

func run(t *testing.T, cmd *exec.Cmd, stdin string) {
	t.Helper()
	cmd.Stdin = strings.NewReader(stdin)
	if out, err := cmd.CombinedOutput(); err != nil {
		t.Fatalf("%s: %v: %s", strings.Join(cmd.Args, " "), err, out)
	}
}

func pick(v6 bool, v4addr, v6addr string) string {
	if v6 {
		return v6addr
	}
	return v4addr
}

// routed: client and server namespaces routed through a third that DNATs a
// virtual address to the server in prerouting (kube-proxy's shape), and
// with masq also rewrites the client's address to its own.
func routed(t *testing.T, v6, masq bool) translation {
	tr := routedTopology(t, v6)
	r := testenv.Routed{Client: tr.client, Router: tr.router, Server: tr.server}
	r.ServiceDNAT(t, masq)
	if masq {
		tr.seenFrom = pick(v6, "10.202.0.1", "fd00:202::1")
	}
	return tr
}

// hairpin: a pod reaching a Service that picks the pod itself. Its SYN
// goes out to the router, whose DNAT sends it back over the same link,
// masqueraded (kube-proxy marks hairpin traffic for masquerade: else the
// pod would answer itself directly, from an address its client never
// dialled). Both ends are in one namespace; neither sees the other's tuple.
func hairpin(t *testing.T, v6 bool) translation {
	tr := routed(t, v6, true)
	tr.client = tr.server
	return tr
}

// routedByIptables: the router's DNAT written with iptables (iptables-nft)
// in the chains kube-proxy's iptables mode makes: KUBE-SERVICES jumps to a
// Service's chain, which jumps to an endpoint's chain, which DNATs (and
// marks for masquerade what comes from the endpoint itself).
func routedByIptables(t *testing.T, v6 bool) translation {
	tr := routedTopology(t, v6)
	tool, vip, epIP, ep := "iptables", "10.96.0.10", "10.202.0.2", "10.202.0.2:8080"
	if v6 {
		tool, vip, epIP, ep = "ip6tables", "fd00:96::10", "fd00:202::2", "[fd00:202::2]:8080"
	}
	for _, rule := range [][]string{
		{"-N", "KUBE-SERVICES"}, {"-N", "KUBE-SVC-TEST"}, {"-N", "KUBE-SEP-TEST"}, {"-N", "KUBE-MARK-MASQ"},
		{"-A", "KUBE-MARK-MASQ", "-j", "MARK", "--or-mark", "0x4000"},
		{"-A", "PREROUTING", "-m", "comment", "--comment", "kubernetes service portals", "-j", "KUBE-SERVICES"},
		{"-A", "KUBE-SERVICES", "-d", vip, "-p", "tcp", "--dport", "80", "-j", "KUBE-SVC-TEST"},
		{"-A", "KUBE-SVC-TEST", "-j", "KUBE-SEP-TEST"},
		{"-A", "KUBE-SEP-TEST", "-s", epIP, "-j", "KUBE-MARK-MASQ"},
		{"-A", "KUBE-SEP-TEST", "-p", "tcp", "-j", "DNAT", "--to-destination", ep},
	} {
		run(t, exec.Command("ip", append([]string{"netns", "exec", tr.router.Name, tool, "-t", "nat"}, rule...)...), "")
	}
	return tr
}

// routedByKubeProxyNftables: the router's DNAT in the layout kube-proxy's
// nftables mode writes: a verdict map from (address, protocol, port) to a
// Service's chain, which picks an endpoint's chain by a random number
// (numgen), which marks hairpin traffic for masquerade and DNATs; the
// postrouting chain masquerades what is marked, with random ports.
func routedByKubeProxyNftables(t *testing.T, v6 bool) translation {
	tr := routedTopology(t, v6)
	fam, addrType, ip, vip, ep := "ip", "ipv4_addr", "ip", testenv.ServiceIPv4, testenv.EndpointIPv4+":8080"
	if v6 {
		fam, addrType, ip, vip, ep = "ip6", "ipv6_addr", "ip6", testenv.ServiceIPv6, "["+testenv.EndpointIPv6+"]:8080"
	}
	epIP := testenv.EndpointIPv4
	if v6 {
		epIP = testenv.EndpointIPv6
	}
	tr.router.Nft(t, fmt.Sprintf(`table %[1]s kube-proxy {
	map service-ips {
		type %[2]s . inet_proto . inet_service : verdict
		elements = { %[4]s . tcp . 80 : goto service-TEST-tcp }
	}
	chain nat-prerouting {
		type nat hook prerouting priority dstnat;
		jump services
	}
	chain nat-postrouting {
		type nat hook postrouting priority srcnat;
		jump masquerading
	}
	chain services {
		%[3]s daddr . meta l4proto . th dport vmap @service-ips
	}
	chain mark-for-masquerade {
		mark set mark or 0x4000
	}
	chain masquerading {
		mark and 0x4000 == 0 return
		mark set mark xor 0x4000
		masquerade fully-random
	}
	chain service-TEST-tcp {
		numgen random mod 1 vmap { 0 : goto endpoint-TEST-tcp }
	}
	chain endpoint-TEST-tcp {
		%[3]s saddr %[6]s jump mark-for-masquerade
		meta l4proto tcp dnat to %[5]s
	}
}`, fam, addrType, ip, vip, ep, epIP))
	return tr
}

// routedTopology: testenv.MustRouted, the client dialling the Service's
// virtual address that the router's rules translate.
func routedTopology(t *testing.T, v6 bool) translation {
	r := testenv.MustRouted(t)
	return translation{client: r.Client, server: r.Server, router: r.Router,
		listen: pick(v6, "10.202.0.2:8080", "[fd00:202::2]:8080"),
		vip:    pick(v6, "10.96.0.10:80", "[fd00:96::10]:80")}
}

// redirected: one namespace whose output REDIRECTs a virtual address's
// port to a local listener, as a mesh captures an application's traffic
// for its sidecar.
func redirected(t *testing.T, v6 bool) translation {
	ns := testenv.MustNetNS(t)
	ns.IP(t, "addr", "add", "10.96.0.11/32", "dev", "lo")
	ns.AddAddress(t, "lo", "fd00:96::11/128")
	ns.Nft(t, `table inet shunt_test {
	chain out {
		type nat hook output priority -100;
		ip daddr 10.96.0.11 tcp dport 80 redirect to :15001
		ip6 daddr fd00:96::11 tcp dport 80 redirect to :15001
	}
}`)
	return translation{client: ns, server: ns, sameNetns: true,
		listen: pick(v6, "0.0.0.0:15001", "[::]:15001"),
		vip:    pick(v6, "10.96.0.11:80", "[fd00:96::11]:80")}
}

// publishedPort: the client's namespace DNATs a virtual address on output
// to a server one veth away (a container's published port, reached from
// the host).
func publishedPort(t *testing.T, v6 bool) translation {
	client, server := testenv.MustNetNS(t), testenv.MustNetNS(t)
	testenv.VethLink(t, client, "c0", server, "s0", 203)
	client.IP(t, "route", "add", "10.96.0.12/32", "dev", "c0")
	client.IP(t, "-6", "route", "add", "fd00:96::12/128", "dev", "c0")
	client.Nft(t, `table inet shunt_test {
	chain out {
		type nat hook output priority -100;
		ip daddr 10.96.0.12 tcp dport 80 dnat ip to 10.203.0.2:8080
		ip6 daddr fd00:96::12 tcp dport 80 dnat ip6 to [fd00:203::2]:8080
	}
}`)
	return translation{client: client, server: server,
		listen: pick(v6, "10.203.0.2:8080", "[fd00:203::2]:8080"),
		vip:    pick(v6, "10.96.0.12:80", "[fd00:96::12]:80")}
}

// A socket elsewhere that shares the tuple a translated connection's server
// sees (same addresses and port, another namespace, connected while that
// handshake is under way) is never paired with that server: the server pairs
// with the client that holds the handshake's sequence numbers and releases
// the look-alike, which then runs as plain TCP with its own peer.
func TestTranslatedLookAlikeNotPaired(t *testing.T) {
	testenv.NeedProgram(t, "nft")
	in, cg := mustInstall(t)
	tr := routed(t, false, false)
	// Hold the real handshake open: the router drops the client's ACKs
	// (the SYN-ACK passes, so the client is established and has claimed).
	router := tr.router
	router.Nft(t, `table inet shunt_hold { chain hold { type filter hook forward priority 0; ip saddr 10.201.0.2 tcp dport 8080 tcp flags & (syn|ack) == ack drop; }; }`)

	// The look-alike: 10.201.0.2 too, in a namespace of its own, whose
	// route leads to another 10.202.0.2:8080, a listener shunt does not
	// hold (the test's own cgroup).
	x, y := testenv.MustNetNS(t), testenv.MustNetNS(t)
	testenv.VethLink(t, y, "y0", x, "x0", 201) // x: 10.201.0.2, y: 10.201.0.1
	x.IP(t, "route", "add", "default", "via", "10.201.0.1")
	y.IP(t, "addr", "add", "10.202.0.2/32", "dev", "lo")
	other := testenv.Listen(t, testenv.Side{NS: y}, "tcp4", "10.202.0.2:8080")

	ln := testenv.Listen(t, testenv.Side{NS: tr.server, CG: cg}, "tcp4", tr.listen)
	c := testenv.Dial(t, testenv.Side{NS: tr.client, CG: cg}, "tcp4", tr.vip, nil)
	port := c.LocalAddr().(*net.TCPAddr).Port
	look := testenv.Dial(t, testenv.Side{NS: x, CG: cg}, "tcp4", "10.202.0.2:8080", &net.TCPAddr{IP: net.IPv4(10, 201, 0, 2), Port: port})
	lookPeer := testenv.Accept(t, other)

	router.Nft(t, "delete table inet shunt_hold")
	s := testenv.Accept(t, ln) // after the SYN-ACK's retransmission, about a second
	testenv.Warm(t, c, s)
	testenv.Warm(t, look, lookPeer)
	for i := 0; i < 20; i++ {
		exchange(t, c, s, fmt.Sprintf("real %d", i))
		exchange(t, s, c, fmt.Sprintf("back %d", i))
		exchange(t, look, lookPeer, fmt.Sprintf("look-alike %d", i))
	}

	f := flowOf(t, in, testenv.Cookie(t, s))
	if f == nil || f.Client == nil || f.Client.Cookie != testenv.Cookie(t, c) {
		t.Fatalf("the server is paired with %+v, want its client (cookie %d)", f, testenv.Cookie(t, c))
	}
	if g := flowOf(t, in, testenv.Cookie(t, look)); g != nil {
		t.Errorf("the look-alike is still held: %+v", g)
	}
}

// Bypassed bytes never advance TCP's sequence numbers, so the segments that
// still cross (handshake, FIN) stay inside the window conntrack tracks: a
// translated connection's entry ends with it, as without shunt (kube-proxy's
// rules drop what conntrack calls invalid, and an entry left established
// would hold the table for days). After 10,000 connections the router's
// table holds what it holds after as many plain ones. Every one is paired
// (PairBrief: they are brief).
func TestTranslatedConnectionsEndInConntrack(t *testing.T) {
	testenv.NeedProgram(t, "nft")
	in, cg := mustInstallWith(t, bypass.Options{PairBrief: true})
	plain := testenv.MustCgroup(t) // not enabled
	conns := 10000
	if testing.Short() {
		conns = 50
	}
	byMode := map[string]map[string]int{}
	for _, mode := range []string{"shunt", "plain"} {
		tr := routed(t, false, false)
		side := testenv.Side{NS: tr.client, CG: cg}
		srv := testenv.Side{NS: tr.server, CG: cg}
		if mode == "plain" {
			side.CG, srv.CG = plain, plain
		}
		ln := testenv.Listen(t, srv, "tcp4", tr.listen)
		before, _ := in.Stats()
		for i := 0; i < conns; i++ {
			c := testenv.Dial(t, side, "tcp4", tr.vip, nil)
			s := testenv.Accept(t, ln)
			testenv.Warm(t, c, s)
			exchange(t, c, s, strings.Repeat("x", 16<<10))
			exchange(t, s, c, strings.Repeat("y", 16<<10))
			c.Close()
			s.Close()
		}
		ln.Close()
		after, _ := in.Stats()
		want := uint64(conns)
		if mode == "plain" {
			want = 0
		}
		if n := after.Counters.Translated - before.Counters.Translated; n != want {
			t.Errorf("%s: %d of %d connections paired through the translation, want %d", mode, n, conns, want)
		}
		var states map[string]int
		for deadline := time.Now().Add(10 * time.Second); ; time.Sleep(50 * time.Millisecond) {
			states = conntrackStates(t, tr.router, "sport=8080") // the reply tuple
			if states["TIME_WAIT"]+states["CLOSE"] == conns || time.Now().After(deadline) {
				break
			}
		}
		byMode[mode] = states
	}
	t.Logf("router's conntrack entries by state after %d connections: shunt %v, plain %v", conns, byMode["shunt"], byMode["plain"])
	if got := byMode["shunt"]; got["TIME_WAIT"]+got["CLOSE"] != conns || len(got) > 2 {
		t.Errorf("conntrack entries of the %d closed connections by state: %v, want all TIME_WAIT or CLOSE (plain TCP: %v)", conns, got, byMode["plain"])
	}
	total := func(m map[string]int) (n int) {
		for _, v := range m {
			n += v
		}
		return n
	}
	if a, b := total(byMode["shunt"]), total(byMode["plain"]); a != b {
		t.Errorf("the router holds %d conntrack entries after %d bypassed connections, %d after as many plain ones (%v against %v)", a, conns, b, byMode["shunt"], byMode["plain"])
	}
}

// conntrackStates counts a namespace's TCP conntrack entries by state,
// those whose line contains match.
func conntrackStates(t *testing.T, ns *testenv.NetNS, match string) map[string]int {
	t.Helper()
	var b []byte
	var err error
	ns.Do(t, func() { b, err = os.ReadFile("/proc/thread-self/net/nf_conntrack") })
	if err != nil {
		t.Fatal(err)
	}
	states := map[string]int{}
	for _, line := range strings.Split(string(b), "\n") {
		f := strings.Fields(line)
		if len(f) > 5 && f[2] == "tcp" && strings.Contains(line, match) {
			states[f[5]]++
		}
	}
	return states
}

// TCP Fast Open: the server's child is made at the SYN, before its client
// holds the SYN-ACK, so a connection whose SYN carried data is not paired;
// it runs as plain TCP, nothing left half held. (The first connection only
// asks for a cookie: an ordinary handshake, paired.)
func TestFastOpenNotHalfHeld(t *testing.T) {
	in, cg := mustInstall(t)
	ns := testenv.MustNetNS(t)
	run(t, exec.Command("ip", "netns", "exec", ns.Name, "sysctl", "-qw", "net.ipv4.tcp_fastopen=3"), "")
	side := testenv.Side{NS: ns, CG: cg}
	ln := testenv.Listen(t, side, "tcp4", "127.0.0.1:0")
	raw, err := ln.SyscallConn()
	if err != nil {
		t.Fatal(err)
	}
	raw.Control(func(fd uintptr) { err = unix.SetsockoptInt(int(fd), unix.IPPROTO_TCP, unix.TCP_FASTOPEN, 16) })
	if err != nil {
		t.Fatal(err)
	}
	dst := ln.Addr().(*net.TCPAddr)
	for i := 0; i < 3; i++ { // the first gets a cookie, the next use it
		var fd int
		side.Make(t, func() {
			fd, err = unix.Socket(unix.AF_INET, unix.SOCK_STREAM|unix.SOCK_CLOEXEC, 0)
			if err == nil {
				err = unix.Sendto(fd, []byte("hello"), unix.MSG_FASTOPEN, &unix.SockaddrInet4{Port: dst.Port, Addr: [4]byte{127, 0, 0, 1}})
			}
		})
		if err != nil {
			t.Fatalf("TFO connect %d: %v", i, err)
		}
		s := testenv.Accept(t, ln)
		got := make([]byte, 5)
		if _, err := io.ReadFull(s, got); err != nil || string(got) != "hello" {
			t.Fatalf("connection %d: server read %q %v", i, got, err)
		}
		s.Write([]byte("world"))
		if n, err := unix.Read(fd, got); n != 5 || err != nil || string(got) != "world" {
			t.Fatalf("connection %d: client read %q %v", i, got[:max(n, 0)], err)
		}
		cookie, _ := unix.GetsockoptUint64(fd, unix.SOL_SOCKET, unix.SO_COOKIE)
		if f := flowOf(t, in, cookie); f != nil && (f.Client == nil || f.Server == nil) {
			t.Errorf("connection %d left half held: %+v", i, f)
		}
		unix.Close(fd)
		s.Close()
	}
	st, _ := in.Stats()
	t.Logf("TFO connections: %d paired, %d unpaired", st.Counters.Paired, st.Counters.Unpaired)
	if st.Counters.Paired > 1 {
		t.Errorf("%d connections paired, want only the cookie request's", st.Counters.Paired)
	}
}

// A middlebox that rewrites sequence numbers (nftables' synproxy answers the
// client's SYN itself and opens its own handshake to the server, then shifts
// every segment's numbers between the two) leaves the two ends no handshake
// in common: the client holds the proxy's SYN-ACK, not the server's. They
// share a tuple (no translation), but a server that pairs by sequence
// numbers releases a claim by tuple, so the connection stays on TCP,
// byte-exact, and neither end is paired with anything.
func TestSequenceRewritingMiddleboxLeftOnTCP(t *testing.T) {
	testenv.NeedProgram(t, "nft")
	in, cg := mustInstall(t)
	fams := []string{"ipv4", "ipv6"}
	if testing.Short() {
		fams = fams[:1] // the kernel matrix under qemu
	}
	for _, fam := range fams {
		t.Run(fam, func(t *testing.T) {
			r := testenv.MustRouted(t)
			run(t, exec.Command("ip", "netns", "exec", r.Router.Name, "sysctl", "-qw", "net.netfilter.nf_conntrack_tcp_loose=0"), "")
			r.Router.Nft(t, `table inet shunt_test {
	chain pre {
		type filter hook prerouting priority raw;
		tcp dport 8080 tcp flags syn notrack
	}
	chain through {
		type filter hook forward priority filter;
		tcp dport 8080 ct state invalid,untracked synproxy mss 1400 wscale 7 timestamp sack-perm
		ct state invalid drop
	}
}`)
			addr := net.JoinHostPort(testenv.EndpointIPv4, "8080")
			if fam == "ipv6" {
				addr = net.JoinHostPort(testenv.EndpointIPv6, "8080")
			}
			before, _ := in.Stats()
			ln := testenv.Listen(t, testenv.Side{NS: r.Server, CG: cg}, "tcp", addr)
			c := testenv.Dial(t, testenv.Side{NS: r.Client, CG: cg}, "tcp", addr, nil)
			s := testenv.Accept(t, ln)
			defer c.Close()
			defer s.Close()
			testenv.Warm(t, c, s)
			streamBothWays(t, c, s, 1<<20)
			if synproxied := conntrackStates(t, r.Router, "dport=8080"); synproxied["ESTABLISHED"] == 0 {
				t.Fatalf("the router's conntrack holds no established entry (%v): synproxy did not take the connection", synproxied)
			}
			for _, end := range []*net.TCPConn{c, s} {
				if f := flowOf(t, in, testenv.Cookie(t, end)); f != nil {
					t.Errorf("%s is held: %+v", end.LocalAddr(), f)
				}
			}
			after, _ := in.Stats()
			if n := after.Counters.Paired - before.Counters.Paired; n != 0 {
				t.Errorf("%d connections paired", n)
			}
		})
	}
}

// A server that listened before its cgroup was enabled (a pod's server
// that started before the agent saw the pod) pairs its connections through
// a Service too, on every kernel: each connection request registers by its
// sequence numbers, whatever the age of its listener.
func TestListenerOlderThanEnablePairsThroughTranslation(t *testing.T) {
	testenv.NeedProgram(t, "nft")
	testenv.RequireRoot(t)
	testenv.WatchKernelLog(t)
	in, err := bypass.Create(bypasstest.MustPinDir(t), bypass.Options{NoProbation: true})
	if err != nil {
		t.Fatal(err)
	}
	t.Cleanup(func() { in.Close() })
	cg := testenv.MustCgroup(t)
	tr := routed(t, false, false)
	tr.ln = testenv.Listen(t, testenv.Side{NS: tr.server, CG: cg}, "tcp", tr.listen)
	if _, err := in.Attach(cg); err != nil {
		t.Fatal(err)
	}
	checkTranslated(t, in, cg, tr)
}

// A socket that holds a translated handshake's two sequence numbers (a
// forger that saw the server's SYN-ACK and chose its own ISN) and claims
// the registration before the true client is never paired with the
// server: the true client's claim, which always comes before the ACK that
// establishes the server, finds it claimed and poisons it, and the server
// pairs with neither. Modelled by marking the registration claimed by a
// socket that is not there while the SYN-ACK is held at the router.
func TestForgedClaimNotPaired(t *testing.T) {
	testenv.NeedProgram(t, "nft")
	in, cg := mustInstall(t)
	tr := routed(t, false, false)
	c, s, before := forgedClaim(t, in, cg, testenv.Side{NS: tr.client, CG: cg}, tr)
	if f := flowOf(t, in, testenv.Cookie(t, s)); f != nil {
		t.Errorf("the server is held, paired with %+v: the forged claim won", f)
	}
	if f := flowOf(t, in, testenv.Cookie(t, c)); f != nil {
		t.Errorf("the true client is held: %+v", f)
	}
	if after, _ := in.Stats(); after.Counters.Paired != before.Counters.Paired {
		t.Errorf("%d connections paired", after.Counters.Paired-before.Counters.Paired)
	}
}

// A forger that claims the handshake of a client that is not enabled (a
// remote client, whose true end never claims) is not paired with the
// server either: the ACK that establishes the server comes from the true
// client and does not carry the forger's nonce, so the server declines the
// claim and releases the forger. Modelled as above, the client in a cgroup
// shunt does not hold.
func TestForgedClaimOfRemoteClientNotPaired(t *testing.T) {
	testenv.NeedProgram(t, "nft")
	in, cg := mustInstall(t)
	tr := routed(t, false, false)
	_, s, before := forgedClaim(t, in, cg, testenv.Side{NS: tr.client}, tr)
	if f := flowOf(t, in, testenv.Cookie(t, s)); f != nil {
		t.Errorf("the server is held, paired with %+v: the forged claim won", f)
	}
	after, _ := in.Stats()
	if after.Counters.Paired != before.Counters.Paired {
		t.Errorf("%d connections paired", after.Counters.Paired-before.Counters.Paired)
	}
	if after.Counters.ClaimsUnbound != before.Counters.ClaimsUnbound+1 {
		t.Errorf("claims_unbound went from %d to %d, want one more", before.Counters.ClaimsUnbound, after.Counters.ClaimsUnbound)
	}
}

// forgedClaim holds a translated handshake's SYN-ACK at the router, marks
// its registration claimed by a forger that is not there (ForgeISNClaims),
// lets the SYN-ACK through and returns the connection, streamed both ways,
// and the counters from before the release. The client dials from client.
func forgedClaim(t *testing.T, in *bypass.Install, cg host.Cgroup, client testenv.Side, tr translation) (c, s *net.TCPConn, before bypass.Stats) {
	t.Helper()
	tr.router.Nft(t, `table inet shunt_hold { chain hold { type filter hook forward priority 0; ip saddr 10.202.0.2 tcp sport 8080 tcp flags & (syn|ack) == syn|ack drop; }; }`)
	ln := testenv.Listen(t, testenv.Side{NS: tr.server, CG: cg}, "tcp4", tr.listen)
	dialed := make(chan *net.TCPConn, 1)
	go func() {
		dialed <- testenv.Dial(t, client, "tcp4", tr.vip, nil)
	}()
	forged := 0
	for deadline := time.Now().Add(5 * time.Second); forged == 0 && time.Now().Before(deadline); time.Sleep(20 * time.Millisecond) {
		n, err := in.ForgeISNClaims()
		if err != nil {
			t.Fatal(err)
		}
		forged = n
	}
	if forged != 1 {
		t.Fatalf("%d registrations marked claimed, want the held handshake's", forged)
	}
	before, _ = in.Stats()
	tr.router.Nft(t, "delete table inet shunt_hold")
	c = <-dialed
	s = testenv.Accept(t, ln) // after the SYN-ACK's retransmission, about a second
	t.Cleanup(func() { c.Close(); s.Close() })
	testenv.Warm(t, c, s)
	streamBothWays(t, c, s, 1<<20)
	return c, s, before
}
