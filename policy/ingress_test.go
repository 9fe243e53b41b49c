package policy_test

import (
	"errors"
	"fmt"
	"io"
	"net"
	"testing"
	"time"

	"golang.org/x/sys/unix"

	"github.com/shunt-project/shunt/bypass"
	"github.com/shunt-project/shunt/internal/testenv"
)

// The ingress table: a server scope's rules on who may connect and send to
// it, and the same intent as an nftables input chain, in the order
// policy.md says rules take precedence.
const ingressRules = `
scopes:
  - cgroup: %s
    ingress:
      - {action: deny, cidr: 10.9.0.0/24, port: 80, proto: tcp}
      - {action: allow, cidr: 10.9.0.7}
      - {action: deny, cidr: "fd09::/64", proto: udp}
      - {action: deny, cidr: 127.0.0.1, port: 81}
`

const ingressNft = `
table inet shunt_test {
	chain in {
		type filter hook input priority 0; policy accept;
		ct direction reply accept
		ip saddr 10.9.0.7 accept
		ip saddr 10.9.0.0/24 tcp dport 80 drop
		ip6 saddr fd09::/64 meta l4proto udp drop
		ip saddr 127.0.0.1 th dport 81 drop
	}
}
`

type ingressCase struct {
	verdictCase        // what the client does, allow: whether it reaches the server
	from        string // the client's source address
}

var ingressTable = []ingressCase{
	{verdictCase{tcpConnect, "10.9.0.1", 80, false, "10.9.0.0/24 tcp 80"}, "10.9.0.2"},
	{verdictCase{tcpConnect, "10.9.0.1", 80, true, "the longer 10.9.0.7/32"}, "10.9.0.7"},
	{verdictCase{tcpConnect, "10.9.0.1", 443, true, "no rule: default"}, "10.9.0.2"},
	{verdictCase{tcpConnect, "10.9.0.1", 80, true, "outside 10.9.0.0/24"}, "10.9.1.2"},
	{verdictCase{tcpConnect, "::ffff:10.9.0.1", 80, false, "IPv4-mapped is IPv4"}, "::ffff:10.9.0.2"},
	{verdictCase{tcpConnect, "fd09::1", 80, true, "fd09::/64 denies udp only"}, "fd09::2"},
	{verdictCase{tcpConnect, "127.0.0.1", 81, false, "127.0.0.1 to 81"}, "127.0.0.1"},
	{verdictCase{tcpConnect, "127.0.0.1", 82, true, "other port"}, "127.0.0.1"},
	{verdictCase{udpSendto, "fd09::1", 53, false, "fd09::/64 udp"}, "fd09::2"},
	{verdictCase{udpSendtoExt, "fd09::1", 53, false, "fd09::/64 udp, behind an extension header"}, "fd09::2"},
	{verdictCase{udpSendto, "10.9.0.1", 80, true, "80 is denied for tcp only"}, "10.9.0.2"},
	{verdictCase{udpConnect, "127.0.0.1", 81, false, "127.0.0.1 to 81, connected UDP"}, "127.0.0.1"},
	{verdictCase{udpSendto, "::ffff:10.9.0.7", 53, true, "IPv4-mapped, 10.9.0.7"}, "::ffff:10.9.0.7"},
	{verdictCase{udpliteSendto, "127.0.0.1", 81, false, "127.0.0.1 to 81, UDP-Lite"}, "127.0.0.1"},
	{verdictCase{udpliteSendto, "fd09::1", 53, true, "fd09::/64 denies udp, not UDP-Lite"}, "fd09::2"},
	{verdictCase{udpliteConnect, "10.9.0.1", 443, true, "no rule: default, UDP-Lite"}, "10.9.0.2"},
}

// runIngressTable runs each case from client to the listeners on server and
// reports whether it got through to them.
func runIngressTable(t *testing.T, client testenv.Side, rec *received) map[string]error {
	t.Helper()
	got := map[string]error{}
	for _, c := range ingressTable {
		var err error
		client.Make(t, func() { err = attemptFrom(c.verdictCase, c.from) })
		if err == nil && c.op != tcpConnect && !rec.within(c.String(), 500*time.Millisecond) {
			err = errors.New("the datagram did not arrive")
		}
		got[c.String()+" from "+c.from] = err
	}
	return got
}

func checkIngressTable(t *testing.T, got map[string]error, what string) {
	t.Helper()
	for _, c := range ingressTable {
		err := got[c.String()+" from "+c.from]
		if (err == nil) != c.allow {
			t.Errorf("%s: %s from %s: got through=%v (%v), want %v: %s", what, c, c.from, err == nil, err, c.allow, c.reason)
		}
	}
}

// TestIngressVerdicts runs the ingress table against a server scope, with
// the client on the TCP path and with both ends bypassed by shunt. A denied
// connection request is dropped as a firewall drops it: the client's
// connect() times out.
func TestIngressVerdicts(t *testing.T) {
	for _, mode := range []string{"tcp path", "bypassed"} {
		t.Run(mode, func(t *testing.T) {
			p := mustPolicy(t)
			server, client := testenv.MustCgroup(t), testenv.MustCgroup(t)
			var in *bypass.Install
			if mode == "bypassed" {
				in = mustBypass(t, server, client)
			}
			ns := mustAddressNS(t)
			rec := listeners(t, testenv.Side{NS: ns, CG: server}, 53, 80, 81, 82, 443)
			mustApply(t, p, mustParse(t, fmt.Sprintf(ingressRules, server.Path)))
			checkIngressTable(t, runIngressTable(t, testenv.Side{NS: ns, CG: client}, rec), mode)
			if in != nil {
				if st, _ := in.Stats(); st.Counters.Paired == 0 {
					t.Errorf("no connection was bypassed: the table did not test the bypass (%+v)", st.Counters)
				}
			}
		})
	}
}

// TestSameIngressVerdictsAsNftables runs the ingress table against an
// nftables input chain of the same intent, with no shunt policy.
func TestSameIngressVerdictsAsNftables(t *testing.T) {
	testenv.RequireRoot(t)
	testenv.NeedProgram(t, "nft")
	ns := mustAddressNS(t)
	rec := listeners(t, testenv.Side{NS: ns}, 53, 80, 81, 82, 443)
	ns.Nft(t, ingressNft)
	checkIngressTable(t, runIngressTable(t, testenv.Side{NS: ns}, rec), "nftables")
}

// TestApplyClosesDeniedInbound: an accepted connection that a new ingress
// rule denies is closed at the apply (its client gets a reset), bypassed or
// not; one the rules still allow goes on.
func TestApplyClosesDeniedInbound(t *testing.T) {
	eachCloseMethod(t, testApplyClosesDeniedInbound)
}

func testApplyClosesDeniedInbound(t *testing.T) {
	p := mustPolicy(t)
	server, client := testenv.MustCgroup(t), testenv.MustCgroup(t)
	in := mustBypass(t, server, client)
	ns := mustAddressNS(t)
	listeners(t, testenv.Side{NS: ns, CG: server}, 443)
	// The scope holds the server when it accepts, so the apply knows the
	// connections for its own.
	mustApply(t, p, mustParse(t, fmt.Sprintf("scopes: [{cgroup: %s}]", server.Path)))
	dial := func(from string) net.Conn {
		t.Helper()
		var c net.Conn
		var err error
		d := net.Dialer{Timeout: time.Second, LocalAddr: &net.TCPAddr{IP: net.ParseIP(from)}}
		testenv.Side{NS: ns, CG: client}.Make(t, func() { c, err = d.Dial("tcp", "10.9.0.1:443") })
		if err != nil {
			t.Fatal(err)
		}
		t.Cleanup(func() { c.Close() })
		return c
	}
	denied, kept := dial("10.9.0.2"), dial("10.9.1.2")
	for _, c := range []net.Conn{denied, kept} {
		if err := echo(c); err != nil {
			t.Fatal(err)
		}
	}
	if st, _ := in.Stats(); st.Counters.Paired < 2 {
		t.Fatalf("the connections were not bypassed: %+v", st.Counters)
	}
	res := mustApply(t, p, mustParse(t, fmt.Sprintf("scopes: [{cgroup: %s, ingress: [{action: deny, cidr: 10.9.0.0/24, port: 443}]}]", server.Path)))
	if len(res.Closed) != 1 {
		t.Errorf("apply closed %d connections, want 1: %+v", len(res.Closed), res.Closed)
	}
	if err := echo(denied); !errors.Is(err, unix.ECONNRESET) && !errors.Is(err, io.EOF) {
		t.Errorf("the denied client after the apply: %v, want a reset", err)
	}
	if err := echo(kept); err != nil {
		t.Errorf("a connection the new rules allow: %v", err)
	}
}
