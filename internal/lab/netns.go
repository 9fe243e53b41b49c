package lab

import (
	"fmt"
	"os/exec"
	"runtime"
	"strings"
	"time"

	"golang.org/x/sys/unix"
)

// NetNS is a named network namespace.
type NetNS struct {
	Name string
	fd   int
}

// NewNetNS creates a network namespace with loopback up.
func NewNetNS(name string) (*NetNS, error) {
	if err := ip("netns", "add", name); err != nil {
		return nil, err
	}
	n := &NetNS{Name: name, fd: -1}
	if err := ip("-n", name, "link", "set", "lo", "up"); err != nil {
		n.Close()
		return nil, err
	}
	fd, err := unix.Open("/run/netns/"+name, unix.O_RDONLY|unix.O_CLOEXEC, 0)
	if err != nil {
		n.Close()
		return nil, fmt.Errorf("open netns %s: %w", name, err)
	}
	n.fd = fd
	return n, nil
}

// Close deletes the namespace.
func (n *NetNS) Close() error {
	if n.fd >= 0 {
		unix.Close(n.fd)
		n.fd = -1
	}
	return ip("netns", "del", n.Name)
}

// Do runs fn on an OS thread inside the namespace; sockets fn makes belong to
// it for life. A nil namespace runs fn where the caller is.
func (n *NetNS) Do(fn func() error) error {
	if n == nil {
		return fn()
	}
	runtime.LockOSThread()
	orig, err := unix.Open("/proc/thread-self/ns/net", unix.O_RDONLY|unix.O_CLOEXEC, 0)
	if err != nil {
		runtime.UnlockOSThread()
		return fmt.Errorf("open own netns: %w", err)
	}
	defer unix.Close(orig)
	if err := unix.Setns(n.fd, unix.CLONE_NEWNET); err != nil {
		runtime.UnlockOSThread()
		return fmt.Errorf("enter netns %s: %w", n.Name, err)
	}
	defer func() {
		if err := unix.Setns(orig, unix.CLONE_NEWNET); err != nil {
			// Stay locked: Go retires the thread with the goroutine rather
			// than reuse one stuck in a foreign namespace.
			panic(fmt.Sprintf("return from netns %s: %v", n.Name, err))
		}
		runtime.UnlockOSThread()
	}()
	return fn()
}

// Addresses given to the two ends of a Veth link.
const (
	VethIPv4A = "10.199.0.1"
	VethIPv4B = "10.199.0.2"
	VethIPv6A = "fd00:199::1"
	VethIPv6B = "fd00:199::2"
)

// Veth joins a and b with a veth pair and gives a VethIPv4A/VethIPv6A and b
// VethIPv4B/VethIPv6B. The addresses exist only inside these namespaces.
// Deleting either namespace removes the link.
func Veth(a, b *NetNS) error {
	if err := ip("link", "add", "veth-a", "netns", a.Name, "type", "veth", "peer", "name", "veth-b", "netns", b.Name); err != nil {
		return err
	}
	for _, s := range []struct{ ns, ifc, v4, v6 string }{
		{a.Name, "veth-a", VethIPv4A + "/24", VethIPv6A + "/64"},
		{b.Name, "veth-b", VethIPv4B + "/24", VethIPv6B + "/64"},
	} {
		for _, args := range [][]string{
			{"-n", s.ns, "addr", "add", s.v4, "dev", s.ifc},
			{"-n", s.ns, "addr", "add", s.v6, "dev", s.ifc, "nodad"},
			{"-n", s.ns, "link", "set", s.ifc, "up"},
		} {
			if err := ip(args...); err != nil {
				return err
			}
		}
	}
	// Up on both ends (carrier) first: only then are the addresses routed.
	if err := waitLocal(a.Name, VethIPv6A); err != nil {
		return err
	}
	return waitLocal(b.Name, VethIPv6B)
}

// AddAddress gives dev (up, with its carrier: lo) the address prefix (as
// "ip addr add" takes it) without duplicate address detection, and returns
// once the kernel routes to it.
func (n *NetNS) AddAddress(dev, prefix string) error {
	args := []string{"-n", n.Name, "addr", "add", prefix, "dev", dev}
	if strings.Contains(prefix, ":") {
		args = append(args, "nodad")
	}
	if err := ip(args...); err != nil {
		return err
	}
	return n.WaitLocal(prefix[:strings.IndexByte(prefix+"/", '/')])
}

// WaitLocal waits until the namespace routes addr, one of its own
// addresses, to itself (waitLocal): for an address on a link that is up
// and has its carrier.
func (n *NetNS) WaitLocal(addr string) error { return waitLocal(n.Name, addr) }

// waitLocal waits up to 5 s until the namespace routes addr to itself. An
// IPv6 address's local route is added by a work item after "ip addr add"
// returns, nodad or not; under load that took long enough for a test's
// first datagram to be dropped with no route (Ip6OutNoRoutes).
func waitLocal(ns, addr string) error {
	var out []byte
	for deadline := time.Now().Add(5 * time.Second); time.Now().Before(deadline); time.Sleep(5 * time.Millisecond) {
		var err error
		out, err = exec.Command("ip", "-n", ns, "route", "get", addr).CombinedOutput()
		if err == nil && strings.HasPrefix(string(out), "local ") {
			return nil
		}
	}
	return fmt.Errorf("netns %s: no local route to %s after 5 s: %s", ns, addr, strings.TrimSpace(string(out)))
}
