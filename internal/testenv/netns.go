package testenv

import (
	"testing"

	"github.com/shunt-project/shunt/internal/lab"
)

// NetNS is a network namespace made for one test.
type NetNS struct{ *lab.NetNS }

// MustNetNS creates a network namespace with loopback up, deleted in cleanup.
func MustNetNS(t testing.TB) *NetNS {
	t.Helper()
	n, err := lab.NewNetNS(Name())
	if err != nil {
		t.Fatal(err)
	}
	t.Cleanup(func() { n.Close() })
	return &NetNS{n}
}

// Do runs fn on an OS thread inside the namespace (nil: the test's own).
func (n *NetNS) Do(t testing.TB, fn func()) {
	t.Helper()
	var ns *lab.NetNS
	if n != nil {
		ns = n.NetNS
	}
	if err := ns.Do(func() error { fn(); return nil }); err != nil {
		t.Fatal(err)
	}
}

// AddAddress gives dev the address prefix ("fd00:53::1/128") and waits
// until the namespace routes to it (lab.NetNS.AddAddress).
func (n *NetNS) AddAddress(t testing.TB, dev, prefix string) {
	t.Helper()
	if err := n.NetNS.AddAddress(dev, prefix); err != nil {
		t.Fatal(err)
	}
}

// WaitLocal waits until the namespace routes addr, one of its own, to
// itself (lab.NetNS.WaitLocal).
func (n *NetNS) WaitLocal(t testing.TB, addr string) {
	t.Helper()
	if err := n.NetNS.WaitLocal(addr); err != nil {
		t.Fatal(err)
	}
}

// Veth joins a and b (see lab.Veth for the addresses).
func Veth(t testing.TB, a, b *NetNS) {
	t.Helper()
	if err := lab.Veth(a.NetNS, b.NetNS); err != nil {
		t.Fatal(err)
	}
}
