package testenv

import (
	"fmt"
	"os/exec"
	"strings"
	"testing"
)

// IP runs ip(8) in the namespace.
func (n *NetNS) IP(t testing.TB, args ...string) {
	t.Helper()
	out, err := exec.Command("ip", append([]string{"-n", n.Name}, args...)...).CombinedOutput()
	if err != nil {
		t.Fatalf("ip -n %s %s: %v: %s", n.Name, strings.Join(args, " "), err, out)
	}
}

// VethLink joins a and b with a veth pair named an and bn, addressed net.1
// on a and net.2 on b (IPv4 10.N.0.0/24 and IPv6 fd00:N::/64).
func VethLink(t testing.TB, a *NetNS, an string, b *NetNS, bn string, n int) {
	t.Helper()
	out, err := exec.Command("ip", "link", "add", an, "netns", a.Name, "type", "veth", "peer", "name", bn, "netns", b.Name).CombinedOutput()
	if err != nil {
		t.Fatalf("veth %s-%s: %v: %s", an, bn, err, out)
	}
	for _, e := range []struct {
		ns   *NetNS
		name string
		host int
	}{{a, an, 1}, {b, bn, 2}} {
		e.ns.IP(t, "addr", "add", fmt.Sprintf("10.%d.0.%d/24", n, e.host), "dev", e.name)
		e.ns.IP(t, "addr", "add", fmt.Sprintf("fd00:%d::%d/64", n, e.host), "dev", e.name, "nodad")
		e.ns.IP(t, "link", "set", e.name, "up")
	}
	// Routed only once both ends are up (AddAddress says why).
	a.WaitLocal(t, fmt.Sprintf("fd00:%d::1", n))
	b.WaitLocal(t, fmt.Sprintf("fd00:%d::2", n))
}

// Routed is a client and a server namespace routed through a router
// namespace, as pods on a node are through its host: the client is
// 10.201.0.2 (fd00:201::2), the server 10.202.0.2 (fd00:202::2), the
// router .1 on each link.
type Routed struct{ Client, Router, Server *NetNS }

// A Service's virtual address in a routed topology, and the address and
// port its DNAT sends to.
const (
	ServiceIPv4  = "10.96.0.10"
	ServiceIPv6  = "fd00:96::10"
	ServicePort  = 80
	EndpointIPv4 = "10.202.0.2"
	EndpointIPv6 = "fd00:202::2"
	EndpointPort = 8080
)

// MustRouted makes the three namespaces, links and routes.
func MustRouted(t testing.TB) Routed {
	t.Helper()
	r := Routed{Client: MustNetNS(t), Router: MustNetNS(t), Server: MustNetNS(t)}
	VethLink(t, r.Router, "r0", r.Client, "c0", 201)
	VethLink(t, r.Router, "r1", r.Server, "s0", 202)
	r.Client.IP(t, "route", "add", "default", "via", "10.201.0.1")
	r.Client.IP(t, "-6", "route", "add", "default", "via", "fd00:201::1")
	r.Server.IP(t, "route", "add", "default", "via", "10.202.0.1")
	r.Server.IP(t, "-6", "route", "add", "default", "via", "fd00:202::1")
	out, err := exec.Command("ip", "netns", "exec", r.Router.Name, "sysctl", "-qw",
		"net.ipv4.ip_forward=1", "net.ipv6.conf.all.forwarding=1").CombinedOutput()
	if err != nil {
		t.Fatalf("forwarding in %s: %v: %s", r.Router.Name, err, out)
	}
	return r
}

// ServiceDNAT makes the router DNAT the Service's address and port to the
// endpoint in prerouting (kube-proxy's nftables shape) and, with masq,
// masquerade what it sends to the server (a pod reaching a Service that
// picks itself, or a node that masquerades all Service traffic): the
// server then sees the router's 10.202.0.1 (fd00:202::1).
func (r Routed) ServiceDNAT(t testing.TB, masq bool) {
	t.Helper()
	post := ""
	if masq {
		post = `chain post { type nat hook postrouting priority srcnat; oifname "r1" masquerade; }`
	}
	r.Router.Nft(t, fmt.Sprintf(`table inet shunt_test {
	chain pre {
		type nat hook prerouting priority dstnat;
		ip daddr %[1]s tcp dport %[3]d dnat ip to %[4]s:%[6]d
		ip6 daddr %[2]s tcp dport %[3]d dnat ip6 to [%[5]s]:%[6]d
	}
	%[7]s
}`, ServiceIPv4, ServiceIPv6, ServicePort, EndpointIPv4, EndpointIPv6, EndpointPort, post))
}
