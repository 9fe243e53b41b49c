package policy_test

import (
	"errors"
	"fmt"
	"io"
	"net"
	"os"
	"path/filepath"
	"strings"
	"testing"
	"time"

	"golang.org/x/sys/unix"

	"github.com/shunt-project/shunt/host"
	"github.com/shunt-project/shunt/internal/lab"
	"github.com/shunt-project/shunt/internal/testenv"
	"github.com/shunt-project/shunt/policy"
)

// Peer rules: the backend scope takes connections from the frontend
// subtree only, except that its canary may not reach port 81, and from
// 10.9.0.7 by address.
const peerRules = `
scopes:
  - cgroup: %s
    ingress_default: deny
    ingress:
      - {action: allow, peer_cgroup: %s}
      - {action: deny, peer_cgroup: %s, port: 81}
      - {action: allow, cidr: 10.9.0.7}
`

// peerCase is a verdictCase made by a client in one of the test's cgroups.
type peerCase struct {
	verdictCase
	from   string // source address
	client string // frontend, canary (inside frontend) or other
}

var peerTable = []peerCase{
	{verdictCase{tcpConnect, "127.0.0.1", 80, true, "frontend is allowed"}, "127.0.0.1", "frontend"},
	{verdictCase{tcpConnect, "127.0.0.1", 80, true, "canary is in frontend"}, "127.0.0.1", "canary"},
	{verdictCase{tcpConnect, "127.0.0.1", 81, false, "canary's own rule, the deeper cgroup, first"}, "127.0.0.1", "canary"},
	{verdictCase{tcpConnect, "127.0.0.1", 81, true, "frontend has no port rule"}, "127.0.0.1", "frontend"},
	{verdictCase{tcpConnect, "127.0.0.1", 80, false, "other cgroup: the default"}, "127.0.0.1", "other"},
	{verdictCase{tcpConnect, "10.9.0.1", 80, true, "other, from the allowed address"}, "10.9.0.7", "other"},
	{verdictCase{tcpConnect, "10.9.0.1", 81, false, "peer rules before address rules"}, "10.9.0.7", "canary"},
	{verdictCase{tcpConnect, "fd09::1", 80, true, "frontend over IPv6"}, "fd09::2", "frontend"},
	{verdictCase{tcpConnect, "::ffff:10.9.0.1", 80, true, "frontend, IPv4-mapped"}, "::ffff:10.9.0.2", "frontend"},
	{verdictCase{tcpConnect, "::ffff:10.9.0.1", 80, false, "other, IPv4-mapped"}, "::ffff:10.9.0.2", "other"},
	{verdictCase{udpSendto, "fd09::1", 53, true, "frontend, a datagram"}, "fd09::2", "frontend"},
	{verdictCase{udpSendto, "fd09::1", 82, false, "other, a datagram"}, "fd09::2", "other"}, // a port of its own: the payload says the case
	{verdictCase{udpConnect, "127.0.0.1", 81, false, "canary, connected UDP to 81"}, "127.0.0.1", "canary"},
	{verdictCase{udpConnect, "127.0.0.1", 82, true, "canary, connected UDP to 82"}, "127.0.0.1", "canary"},
}

// peerCgroups are the test's client cgroups, by name.
func peerCgroups(t *testing.T) map[string]host.Cgroup {
	frontend := testenv.MustCgroup(t)
	return map[string]host.Cgroup{
		"frontend": frontend,
		"canary":   testenv.MustChildCgroup(t, frontend, "canary"),
		"other":    testenv.MustCgroup(t),
	}
}

// TestPeerVerdicts runs the peer table against a backend scope, on the TCP
// path and with every end bypassed: a peer rule decides by the cgroup of
// the socket that connects or sends, not its address.
func TestPeerVerdicts(t *testing.T) {
	for _, mode := range []string{"tcp path", "bypassed"} {
		t.Run(mode, func(t *testing.T) {
			p := mustPolicy(t)
			server := testenv.MustCgroup(t)
			clients := peerCgroups(t)
			if mode == "bypassed" {
				mustBypass(t, server, clients["frontend"], clients["other"])
			}
			ns := mustAddressNS(t)
			rec := listeners(t, testenv.Side{NS: ns, CG: server}, 53, 80, 81, 82)
			mustApply(t, p, mustParse(t, fmt.Sprintf(peerRules, server.Path, clients["frontend"].Path, clients["canary"].Path)))
			checkPeerTable(t, runPeerTable(t, ns, clients, rec), mode)
			rep, err := p.Show()
			if err != nil {
				t.Fatal(err)
			}
			rules := rep.Scopes[0].Ingress.Rules
			if rules[0].Peer != clients["frontend"].Path || rules[0].Counts.Connects == 0 {
				t.Errorf("show: the first rule is %+v, want the frontend's, counting", rules[0])
			}
		})
	}
}

// runPeerTable runs each case from its client's cgroup and reports whether
// it got through to the listeners.
func runPeerTable(t *testing.T, ns *testenv.NetNS, clients map[string]host.Cgroup, rec *received) map[string]error {
	t.Helper()
	got := map[string]error{}
	for _, c := range peerTable {
		var err error
		testenv.Side{NS: ns, CG: clients[c.client]}.Make(t, func() { err = attemptFrom(c.verdictCase, c.from) })
		if err == nil && c.op != tcpConnect && !rec.within(c.String(), 500*time.Millisecond) {
			err = errors.New("the datagram did not arrive")
		}
		got[c.key()] = err
	}
	return got
}

func (c peerCase) key() string { return c.String() + " from " + c.from + " in " + c.client }

func checkPeerTable(t *testing.T, got map[string]error, what string) {
	t.Helper()
	for _, c := range peerTable {
		err := got[c.key()]
		if (err == nil) != c.allow {
			t.Errorf("%s: %s: got through=%v (%v), want %v: %s", what, c.key(), err == nil, err, c.allow, c.reason)
		}
	}
}

// peerNft is the peer rules' intent as netfilter can say it: on the
// senders' output path, where the packet still has its socket (on the
// receiver's input path it has none), new flows to the listeners' ports
// judged by the sender's cgroup (nft's socket cgroupv2, by level), in the
// documented order: the deeper cgroup, then the shallower, then the
// address, then the default.
const peerNft = `
table inet shunt_test {
	chain out {
		type filter hook output priority 0; policy accept;
		ct state != new accept
		th dport != { 53, 80, 81, 82 } accept
		socket cgroupv2 level %[2]d "%[3]s" th dport 81 drop
		socket cgroupv2 level %[1]d "%[4]s" accept
		ip saddr 10.9.0.7 accept
		drop
	}
}
`

// TestSamePeerVerdictsAsNftables runs the peer table against that chain,
// with no shunt policy, and expects the same verdicts.
func TestSamePeerVerdictsAsNftables(t *testing.T) {
	testenv.RequireRoot(t)
	testenv.NeedProgram(t, "nft")
	ns := mustAddressNS(t)
	clients := peerCgroups(t)
	rec := listeners(t, testenv.Side{NS: ns}, 53, 80, 81, 82)
	// nft finds a cgroupv2 path under /sys/fs/cgroup, wherever cgroup2 is
	// mounted (here it may be /sys/fs/cgroup/unified), and takes its id;
	// the level is the kernel's, below cgroup2's root.
	rel := func(cg host.Cgroup) string {
		r, err := filepath.Rel("/sys/fs/cgroup", cg.Path)
		if err != nil {
			t.Fatal(err)
		}
		return r
	}
	ruleset := fmt.Sprintf(peerNft, clients["frontend"].Level(), clients["canary"].Level(), rel(clients["canary"]), rel(clients["frontend"]))
	ns.Nft(t, ruleset)
	checkPeerTable(t, runPeerTable(t, ns, clients, rec), "nftables")
}

// TestPeerPortReuseNotAdmitted: a peer rule admits the sockets of the peer
// cgroup, not a later socket of another cgroup that sends from the port a
// peer used. The senders map keeps a flow after the peer's socket is gone;
// before, the ingress program trusted what it found there (a connection
// from the reused port was accepted, a datagram delivered).
func TestPeerPortReuseNotAdmitted(t *testing.T) {
	p := mustPolicy(t)
	server := testenv.MustCgroup(t)
	clients := peerCgroups(t)
	ns := mustAddressNS(t)
	rec := listeners(t, testenv.Side{NS: ns, CG: server}, 53, 80, 81, 82)
	mustApply(t, p, mustParse(t, fmt.Sprintf(peerRules, server.Path, clients["frontend"].Path, clients["canary"].Path)))
	const port = 45123
	for _, c := range []verdictCase{{tcpConnect, "127.0.0.1", 80, false, ""}, {udpSendto, "127.0.0.1", 53, false, ""}} {
		t.Run(c.op.String(), func(t *testing.T) {
			for i, who := range []string{"frontend", "other"} {
				payload := fmt.Sprintf("%s from %s", c, who)
				var err error
				testenv.Side{NS: ns, CG: clients[who]}.Make(t, func() { err = attemptBound(c, "127.0.0.1", port, payload) })
				if err == nil && c.op != tcpConnect && !rec.within(payload, 500*time.Millisecond) {
					err = errors.New("the datagram did not arrive")
				}
				if through := err == nil; through != (who == "frontend") {
					t.Errorf("%s from port %d in %s: got through=%v (%v)", c, port, who, through, err)
				}
				if i == 0 && c.op != tcpConnect {
					// Past the time a datagram's sender vouches for
					// the flow (POLICY_UDP_SENDER_MS).
					time.Sleep(300 * time.Millisecond)
				}
			}
		})
	}
}

// TestPeerRulesAcrossNamespaces: pods have network namespaces of their own.
// A client in one namespace reaches a server in another over a veth pair;
// a peer rule still knows the client's cgroup. And an apply that brings
// peer rules closes the open connections they deny, made before any
// peer rule existed, and keeps the others.
func TestPeerRulesAcrossNamespaces(t *testing.T) {
	eachCloseMethod(t, func(t *testing.T) {
		p := mustPolicy(t)
		server := testenv.MustCgroup(t)
		clients := peerCgroups(t)
		in := mustBypass(t, server, clients["frontend"], clients["other"])
		serverNS, clientNS := testenv.MustNetNS(t), testenv.MustNetNS(t)
		testenv.Veth(t, clientNS, serverNS)
		listeners(t, testenv.Side{NS: serverNS, CG: server}, 80)
		// The scope holds the server when it accepts.
		mustApply(t, p, mustParse(t, fmt.Sprintf("scopes: [{cgroup: %s}]", server.Path)))
		dial := func(client string, addr string) (net.Conn, error) {
			var c net.Conn
			var err error
			d := net.Dialer{Timeout: time.Second}
			testenv.Side{NS: clientNS, CG: clients[client]}.Make(t, func() { c, err = d.Dial("tcp", addr) })
			if err == nil {
				t.Cleanup(func() { c.Close() })
			}
			return c, err
		}
		v4 := net.JoinHostPort(lab.VethIPv4B, "80")
		v6 := net.JoinHostPort(lab.VethIPv6B, "80")
		var open []net.Conn
		for _, who := range []string{"frontend", "other"} {
			c, err := dial(who, v4)
			if err != nil {
				t.Fatal(err)
			}
			if err := echo(c); err != nil {
				t.Fatal(err)
			}
			open = append(open, c)
		}
		if st, _ := in.Stats(); st.Counters.Paired < 2 {
			t.Fatalf("the connections were not bypassed: %+v", st.Counters)
		}
		applyFrontendOnly(t, p, server, clients, open)
		for _, addr := range []string{v4, v6} {
			if c, err := dial("canary", addr); err != nil {
				t.Errorf("canary (in frontend) to %s: %v", addr, err)
			} else if err := echo(c); err != nil {
				t.Errorf("canary to %s: %v", addr, err)
			}
			if _, err := dial("other", addr); err == nil {
				t.Errorf("other to %s got through", addr)
			}
		}
	})
}

// applyFrontendOnly applies "ingress default deny, allow peer frontend" to
// server's scope, with open holding a connection from frontend and one
// from the other cgroup, made before: the apply closes the other's alone
// (its next call meets a reset) and frontend's keeps working.
func applyFrontendOnly(t *testing.T, p *policy.Policy, server host.Cgroup, clients map[string]host.Cgroup, open []net.Conn) {
	t.Helper()
	res := mustApply(t, p, mustParse(t, fmt.Sprintf(`
scopes:
  - cgroup: %s
    ingress_default: deny
    ingress: [{action: allow, peer_cgroup: %s}]
`, server.Path, clients["frontend"].Path)))
	if len(res.Closed) != 1 {
		t.Errorf("apply closed %d connections, want the other's alone: %+v", len(res.Closed), res.Closed)
	}
	if err := echo(open[1]); !errors.Is(err, unix.ECONNRESET) && !errors.Is(err, io.EOF) {
		t.Errorf("other's connection after the apply: %v, want a reset", err)
	}
	if err := echo(open[0]); err != nil {
		t.Errorf("frontend's connection, which the rules allow, after the apply: %v", err)
	}
}

// TestPeerRulesRefusedOnOlderInstall: an install made before peer rules
// (here one with their maps and collector unpinned, which is what it
// lacked) runs scope and sweep programs that never look peer rules up. It
// is opened and keeps working, but an apply with peer rules is refused in
// one line naming the remedy, and nothing changes; a fresh install takes
// them.
func TestPeerRulesRefusedOnOlderInstall(t *testing.T) {
	testenv.RequireRoot(t)
	dir := testenv.MustPinDir(t)
	p, err := policy.Create(dir, policy.Options{})
	if err != nil {
		t.Fatal(err)
	}
	t.Cleanup(func() { p.Remove() })
	p.Close()
	for _, pin := range []string{"maps/peer_rules", "maps/senders", "maps/conn_senders", "progs/collect_tcp"} {
		if err := os.Remove(filepath.Join(dir, pin)); err != nil {
			t.Fatal(err)
		}
	}
	if p, err = policy.Open(dir); err != nil {
		t.Fatalf("open an older install: %v", err)
	}
	server, client := testenv.MustCgroup(t), testenv.MustCgroup(t)
	withAddress := fmt.Sprintf("scopes: [{cgroup: %s, ingress: [{action: deny, cidr: 10.9.0.0/16}]}]", server.Path)
	mustApply(t, p, mustParse(t, withAddress))
	withPeer := fmt.Sprintf("scopes: [{cgroup: %s, ingress_default: deny, ingress: [{action: allow, peer_cgroup: %s}]}]", server.Path, client.Path)
	_, err = p.Apply(t.Context(), mustParse(t, withPeer))
	if err == nil || !strings.Contains(err.Error(), "installed by an older shunt") || !strings.Contains(err.Error(), "shunt policy clear") {
		t.Fatalf("apply of a peer rule on an older install: %v", err)
	}
	if rep, err := p.Show(); err != nil || len(rep.Scopes) != 1 || len(rep.Scopes[0].Ingress.Rules) != 1 || rep.Scopes[0].Ingress.Rules[0].IsPeer() {
		t.Fatalf("after the refusal: %+v, %v; want the address rule still in force", rep, err)
	}
	if err := p.Remove(); err != nil {
		t.Fatal(err)
	}
	if p, err = policy.Create(dir, policy.Options{}); err != nil {
		t.Fatal(err)
	}
	mustApply(t, p, mustParse(t, withPeer))
}
