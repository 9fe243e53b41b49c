package testenv

import (
	"fmt"
	"os/exec"
	"runtime"
	"testing"

	"golang.org/x/sys/unix"
)

// NetNS is a named network namespace made for one test.
type NetNS struct {
	Name string
	fd   int
}

// MustNetNS creates a network namespace with loopback up.
func MustNetNS(t testing.TB) *NetNS {
	t.Helper()
	name := Name()
	run(t, "ip", "netns", "add", name)
	t.Cleanup(func() { _ = exec.Command("ip", "netns", "del", name).Run() })
	run(t, "ip", "-n", name, "link", "set", "lo", "up")
	fd, err := unix.Open("/run/netns/"+name, unix.O_RDONLY|unix.O_CLOEXEC, 0)
	if err != nil {
		t.Fatalf("open netns %s: %v", name, err)
	}
	t.Cleanup(func() { unix.Close(fd) })
	return &NetNS{Name: name, fd: fd}
}

// Do runs fn on an OS thread that is inside the namespace. Sockets made by
// fn belong to the namespace for their whole life. A nil namespace means the
// test's own.
func (n *NetNS) Do(t testing.TB, fn func()) {
	t.Helper()
	if n == nil {
		fn()
		return
	}
	runtime.LockOSThread()
	orig, err := unix.Open("/proc/thread-self/ns/net", unix.O_RDONLY|unix.O_CLOEXEC, 0)
	if err != nil {
		runtime.UnlockOSThread()
		t.Fatalf("open own netns: %v", err)
	}
	defer unix.Close(orig)
	if err := unix.Setns(n.fd, unix.CLONE_NEWNET); err != nil {
		runtime.UnlockOSThread()
		t.Fatalf("enter netns %s: %v", n.Name, err)
	}
	defer func() {
		if err := unix.Setns(orig, unix.CLONE_NEWNET); err != nil {
			// Leave the thread locked: Go retires it with the goroutine
			// rather than reusing a thread stuck in a foreign netns.
			panic(fmt.Sprintf("return from netns %s: %v", n.Name, err))
		}
		runtime.UnlockOSThread()
	}()
	fn()
}

// Veth joins two namespaces with a veth pair and gives each end an IPv4
// address in 10.199.0.0/24 (.1 in a, .2 in b) and an IPv6 address in
// fd00:199::/64 (::1, ::2). These addresses exist only inside the test's own
// namespaces.
func Veth(t testing.TB, a, b *NetNS) {
	t.Helper()
	ifA, ifB := "veth-a", "veth-b"
	run(t, "ip", "link", "add", ifA, "netns", a.Name, "type", "veth", "peer", "name", ifB, "netns", b.Name)
	for _, s := range []struct {
		ns       *NetNS
		ifc, v4  string
		v6       string
	}{{a, ifA, "10.199.0.1/24", "fd00:199::1/64"}, {b, ifB, "10.199.0.2/24", "fd00:199::2/64"}} {
		run(t, "ip", "-n", s.ns.Name, "addr", "add", s.v4, "dev", s.ifc)
		run(t, "ip", "-n", s.ns.Name, "addr", "add", s.v6, "dev", s.ifc, "nodad")
		run(t, "ip", "-n", s.ns.Name, "link", "set", s.ifc, "up")
	}
}
