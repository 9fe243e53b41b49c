package policy_test

import (
	"fmt"
	"net"
	"strconv"
	"testing"
	"time"

	"github.com/shunt-project/shunt/internal/testenv"
)

// TestPeerRulesThroughServiceDNAT: a client reaches the server through a
// Service's address that a router translates (and masquerades), so the
// flow the server sees is not the one its client sent. A peer rule still
// judges the connection by the client's cgroup: at the SYN, and in the
// sweep of a later apply, which keeps the allowed connection open and
// closes the denied one.
func TestPeerRulesThroughServiceDNAT(t *testing.T) {
	testenv.NeedProgram(t, "nft")
	for _, v6 := range []bool{false, true} {
		for _, masq := range []bool{false, true} {
			if testing.Short() && v6 == masq {
				continue // the kernel matrix: IPv4 masqueraded, IPv6 not
			}
			name := map[bool]string{false: "ipv4", true: "ipv6"}[v6] + map[bool]string{false: "/dnat", true: "/dnat-masquerade"}[masq]
			t.Run(name, func(t *testing.T) { testPeerRulesThroughServiceDNAT(t, v6, masq) })
		}
	}
}

func testPeerRulesThroughServiceDNAT(t *testing.T, v6, masq bool) {
	p := mustPolicy(t)
	server := testenv.MustCgroup(t)
	clients := peerCgroups(t)
	in := mustBypass(t, server, clients["frontend"], clients["other"])
	r := testenv.MustRouted(t)
	r.ServiceDNAT(t, masq)
	listeners(t, testenv.Side{NS: r.Server, CG: server}, testenv.EndpointPort)
	vip := net.JoinHostPort(testenv.ServiceIPv4, strconv.Itoa(testenv.ServicePort))
	if v6 {
		vip = net.JoinHostPort(testenv.ServiceIPv6, strconv.Itoa(testenv.ServicePort))
	}
	// The first IPv6 connection through the router takes a second
	// (its first SYN is lost, shunt or not); a denied one is tried once
	// the paths are warm.
	dial := func(who string, timeout time.Duration) (net.Conn, error) {
		var c net.Conn
		var err error
		d := net.Dialer{Timeout: timeout}
		testenv.Side{NS: r.Client, CG: clients[who]}.Make(t, func() { c, err = d.Dial("tcp", vip) })
		if err == nil {
			t.Cleanup(func() { c.Close() })
		}
		return c, err
	}

	// Open before any peer rule: the scope holds the server when it accepts.
	mustApply(t, p, mustParse(t, fmt.Sprintf("scopes: [{cgroup: %s}]", server.Path)))
	var open []net.Conn
	for _, who := range []string{"frontend", "other"} {
		c, err := dial(who, 5*time.Second)
		if err != nil {
			t.Fatalf("%s to %s before any peer rule: %v", who, vip, err)
		}
		if err := echo(c); err != nil {
			t.Fatal(err)
		}
		open = append(open, c)
	}
	st, _ := in.Stats()
	if st.Counters.Translated < 2 {
		t.Errorf("%d connections paired through the translation, want 2: the test no longer runs bypassed", st.Counters.Translated)
	}

	applyFrontendOnly(t, p, server, clients, open)

	if c, err := dial("canary", 5*time.Second); err != nil {
		t.Errorf("canary (in frontend) through the Service: %v", err)
	} else if err := echo(c); err != nil {
		t.Errorf("canary through the Service: %v", err)
	}
	if _, err := dial("other", time.Second); err == nil {
		t.Errorf("other got through the Service")
	}
}
