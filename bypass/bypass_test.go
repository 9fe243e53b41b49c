package bypass_test

import (
	"net"
	"strings"
	"testing"

	"github.com/shunt-project/shunt/bypass"
	"github.com/shunt-project/shunt/internal/testenv"
)

// topology says where client and server live.
type topology int

const (
	loopback topology = iota // both in one namespace, over lo
	veth                     // client in A, server in B, joined by veth
)

var connCases = []struct {
	name            string
	topo            topology
	listenNet       string
	listenAddr      string
	dialNet, dialTo string
	wantServerAddr  string
}{
	{"ipv4/loopback", loopback, "tcp4", "127.0.0.1:0", "tcp4", "127.0.0.1", "127.0.0.1"},
	{"ipv6/loopback", loopback, "tcp6", "[::1]:0", "tcp6", "::1", "::1"},
	{"ipv4-mapped/loopback", loopback, "tcp", "[::]:0", "tcp4", "127.0.0.1", "127.0.0.1"},
	{"ipv4/veth", veth, "tcp4", "10.199.0.2:0", "tcp4", "10.199.0.2", "10.199.0.2"},
	{"ipv6/veth", veth, "tcp6", "[fd00:199::2]:0", "tcp6", "fd00:199::2", "fd00:199::2"},
	{"ipv4-mapped/veth", veth, "tcp", "[::]:0", "tcp4", "10.199.0.2", "10.199.0.2"},
}

// Requirement 1: these connections are bypassed and the counters prove it.
func TestConnectionsAreBypassed(t *testing.T) {
	in, cg := mustInstall(t)
	for _, tc := range connCases {
		t.Run(tc.name, func(t *testing.T) {
			a := testenv.MustNetNS(t)
			b := a
			if tc.topo == veth {
				b = testenv.MustNetNS(t)
				testenv.Veth(t, a, b)
			}
			client, server := testenv.Side{NS: a, CG: cg}, testenv.Side{NS: b, CG: cg}
			c, s := testenv.ConnPair(t, tc.listenNet, server, tc.listenAddr, client, net.JoinHostPort(tc.dialTo, "0"))

			// Until a reader has called recv, sends to it take TCP.
			exchange(t, c, s, "w")
			exchange(t, s, c, "w")
			f := flowOf(t, in, testenv.Cookie(t, c))
			if f == nil || f.Client == nil || f.Server == nil {
				t.Fatalf("connection not listed as a bypassed flow: %+v", f)
			}
			if f.Client.TCPMsgs != 1 || f.Server.TCPMsgs != 1 || f.Client.TxMsgs+f.Server.TxMsgs != 0 {
				t.Errorf("first round trip: client %d redirected %d tcp, server %d redirected %d tcp; want 0/1 each",
					f.Client.TxMsgs, f.Client.TCPMsgs, f.Server.TxMsgs, f.Server.TCPMsgs)
			}
			if f.Client.Reader != bypass.ReaderRecv || f.Server.Reader != bypass.ReaderRecv {
				t.Errorf("readers %q / %q after a round trip, want recv", f.Client.Reader, f.Server.Reader)
			}

			up := strings.Repeat("ping", 1000)
			down := strings.Repeat("pong!", 7)
			for i := 0; i < 10; i++ {
				exchange(t, c, s, up)
				exchange(t, s, c, down)
			}

			f = flowOf(t, in, testenv.Cookie(t, c))
			if f == nil || f.Client == nil || f.Server == nil {
				t.Fatalf("connection not listed as a bypassed flow: %+v", f)
			}
			if f.Client.Cookie != testenv.Cookie(t, c) || f.Server.Cookie != testenv.Cookie(t, s) {
				t.Fatalf("flow pairs the wrong sockets: %+v", f)
			}
			if got, want := f.Client.TxBytes, uint64(10*len(up)); got != want {
				t.Errorf("client->server redirected %d bytes, want %d", got, want)
			}
			if got, want := f.Server.TxBytes, uint64(10*len(down)); got != want {
				t.Errorf("server->client redirected %d bytes, want %d", got, want)
			}
			if f.Client.TxMsgs != 10 || f.Server.TxMsgs != 10 || f.Client.TCPMsgs != 1 || f.Server.TCPMsgs != 1 {
				t.Errorf("sends: client %d redirected %d tcp, server %d redirected %d tcp; want 10/1 each",
					f.Client.TxMsgs, f.Client.TCPMsgs, f.Server.TxMsgs, f.Server.TCPMsgs)
			}
			if got := f.Server.Addr.Addr().String(); got != tc.wantServerAddr {
				t.Errorf("server address %s, want %s", got, tc.wantServerAddr)
			}
			if got, want := f.Client.Addr.Port(), uint16(c.LocalAddr().(*net.TCPAddr).Port); got != want {
				t.Errorf("client port %d, want %d", got, want)
			}
			sameNS := f.Client.Netns == f.Server.Netns
			if sameNS != (tc.topo == loopback) {
				t.Errorf("client netns %d, server netns %d: wrong for %s", f.Client.Netns, f.Server.Netns, tc.name)
			}
			// Guards the map counting that the no-stale-state tests rely on.
			if n := mapEntries(t, in, "sock_hash"); n != 2 {
				t.Errorf("sock_hash holds %d sockets with one connection open, want 2", n)
			}
			if f.Client.NetnsName != a.Name || f.Server.NetnsName != b.Name {
				t.Errorf("namespace names %q / %q, want %q / %q", f.Client.NetnsName, f.Server.NetnsName, a.Name, b.Name)
			}
			if f.Client.Cgroup != cg.Path || f.Server.Cgroup != cg.Path {
				t.Errorf("cgroups %q / %q, want %q", f.Client.Cgroup, f.Server.Cgroup, cg.Path)
			}
		})
	}
}
