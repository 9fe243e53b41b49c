package bypass_test

import (
	"io"
	"net"
	"testing"
	"time"

	"github.com/shunt-project/shunt/host"
	"github.com/shunt-project/shunt/internal/testenv"
)

// Requirement 4: sockets outside the enabled cgroups, and connections whose
// peer is not on this host, are never redirected or even inserted, and behave
// as without shunt. A peer in another namespace outside the enabled cgroups
// stands in for a remote host: to the client's socket they look the same.
func TestUntouchedConnections(t *testing.T) {
	in, enabled := mustInstall(t)
	other := testenv.MustCgroup(t)

	cases := []struct {
		name            string
		clientCG, srvCG host.Cgroup
	}{
		{"client-outside", other, enabled},
		{"server-outside", enabled, other},
		{"both-outside", other, other},
	}
	for _, tc := range cases {
		t.Run(tc.name, func(t *testing.T) {
			a, b := testenv.MustNetNS(t), testenv.MustNetNS(t)
			testenv.Veth(t, a, b)
			c, s := testenv.ConnPair(t, "tcp4", testenv.Side{NS: b, CG: tc.srvCG}, "10.199.0.2:0", testenv.Side{NS: a, CG: tc.clientCG}, "10.199.0.2:0")

			// FIONREAD reports bytes that came the TCP way; a socket merely
			// inserted in a sockhash would report 0 on 6.18.
			for _, d := range [][2]*net.TCPConn{{c, s}, {s, c}} {
				from, to := d[0], d[1]
				if _, err := from.Write([]byte("0123456789")); err != nil {
					t.Fatal(err)
				}
				deadline := time.Now().Add(2 * time.Second)
				for testenv.InQueue(t, to) < 10 && time.Now().Before(deadline) {
					time.Sleep(time.Millisecond)
				}
				if n := testenv.InQueue(t, to); n != 10 {
					t.Errorf("FIONREAD = %d, want 10 as without shunt", n)
				}
				got := make([]byte, 10)
				if _, err := io.ReadFull(to, got); err != nil || string(got) != "0123456789" {
					t.Errorf("read %q, %v", got, err)
				}
			}
			if f := flowOf(t, in, testenv.Cookie(t, c)); f != nil {
				t.Errorf("client socket is held by shunt: %+v", f)
			}
			if f := flowOf(t, in, testenv.Cookie(t, s)); f != nil {
				t.Errorf("server socket is held by shunt: %+v", f)
			}
		})
	}
	if n := mapEntries(t, in, "sock_hash"); n != 0 {
		t.Errorf("sockhash holds %d sockets, want 0", n)
	}
}
