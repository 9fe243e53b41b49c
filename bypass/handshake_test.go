package bypass_test

import (
	"net"
	"net/netip"
	"testing"
	"time"

	"github.com/shunt-project/shunt/bypass"
	"github.com/shunt-project/shunt/internal/testenv"
)

// Tuple registrations (a listener older than the install pairs by its
// tuple alone where the attach could not ask for its SYN-ACKs: before
// 6.12, modelled by an Attach without WatchListeners) left by handshakes that never completed must not pile up nor
// block later connections, and a live one from another namespace must still
// keep an identical tuple off the redirect path. A listener made since pairs
// by sequence numbers, which such a collision does not confuse.
func TestHandshakeRegistryCleanup(t *testing.T) {
	testenv.RequireRoot(t)
	pin, cg := testenv.MustPinDir(t), testenv.MustCgroup(t)
	ns := testenv.MustNetNS(t)
	side := testenv.Side{NS: ns, CG: cg}
	ln := testenv.Listen(t, side, "tcp4", "127.0.0.1:0") // before the install: tuple only
	in, err := bypass.Create(pin, bypass.Options{})
	if err != nil {
		t.Fatal(err)
	}
	t.Cleanup(func() { in.Close() })
	if _, err := in.Attach(cg); err != nil {
		t.Fatal(err)
	}
	srv := netip.MustParseAddrPort(ln.Addr().String())
	const foreignNetns = 0xdead

	t.Run("sweep removes only stale entries", func(t *testing.T) {
		stale := netip.MustParseAddrPort("127.0.0.1:40001")
		fresh := netip.MustParseAddrPort("127.0.0.1:40002")
		if err := in.InjectHandshake(stale, srv, foreignNetns, bypass.HandshakeTTL+time.Minute); err != nil {
			t.Fatal(err)
		}
		if err := in.InjectHandshake(fresh, srv, foreignNetns, time.Second); err != nil {
			t.Fatal(err)
		}
		if n := in.SweepHandshakes(); n != 1 {
			t.Errorf("swept %d entries, want the 1 stale one", n)
		}
		if n := in.HandshakeEntries(); n != 1 {
			t.Errorf("%d entries left, want the fresh one", n)
		}
	})

	connect := func(t *testing.T, ln *net.TCPListener, port int) bool {
		c := testenv.Dial(t, side, "tcp4", ln.Addr().String(), &net.TCPAddr{IP: net.IPv4(127, 0, 0, 1), Port: port})
		s := testenv.Accept(t, ln)
		testenv.Warm(t, c, s)
		exchange(t, c, s, "hello")
		f := flowOf(t, in, testenv.Cookie(t, c))
		return f != nil && f.Client != nil && f.Client.TxBytes == 5
	}

	t.Run("stale registration is reclaimed", func(t *testing.T) {
		client := netip.MustParseAddrPort("127.0.0.1:40003")
		if err := in.InjectHandshake(client, srv, foreignNetns, bypass.HandshakeTTL+time.Minute); err != nil {
			t.Fatal(err)
		}
		if !connect(t, ln, int(client.Port())) {
			t.Error("a dead handshake's leftover kept a later connection with its tuple off the redirect path")
		}
	})

	t.Run("live registration from another namespace is a collision", func(t *testing.T) {
		client := netip.MustParseAddrPort("127.0.0.1:40004")
		if err := in.InjectHandshake(client, srv, foreignNetns, time.Second); err != nil {
			t.Fatal(err)
		}
		if connect(t, ln, int(client.Port())) {
			t.Error("a connection was bypassed although another namespace had a handshake with its tuple under way")
		}
	})

	t.Run("a listener made since the install pairs by sequence numbers", func(t *testing.T) {
		ln := testenv.Listen(t, side, "tcp4", "127.0.0.1:0")
		srv := netip.MustParseAddrPort(ln.Addr().String())
		client := netip.MustParseAddrPort("127.0.0.1:40005")
		if err := in.InjectHandshake(client, srv, foreignNetns, time.Second); err != nil {
			t.Fatal(err)
		}
		if !connect(t, ln, int(client.Port())) {
			t.Error("a connection to a listener made since the install was not bypassed: a tuple registration from another namespace confused its sequence numbers")
		}
	})
}
