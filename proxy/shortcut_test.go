package proxy_test

import (
	"errors"
	"io"
	"net"
	"net/netip"
	"testing"

	"github.com/shunt-project/shunt/bypass"
	"github.com/shunt-project/shunt/bypass/bypasstest"
	"github.com/shunt-project/shunt/internal/testenv"
	"github.com/shunt-project/shunt/proxy"
)

// Client, proxy and upstream all in one enabled cgroup: bypass pairs both
// legs, and kernel mode with Shortcuts lets the client's bytes go straight
// to the upstream's socket and back. The PROXY header and the request head
// the proxy read to route stay first, both streams arrive whole and in
// order, and the proxy counts every byte, those that passed it by too.
func TestShortcutsPassTheProxyBy(t *testing.T) {
	in, cg := bypasstest.MustEnabled(t, bypass.Options{NoProbation: true}) // every end: this process, past its probation
	for _, f := range families {
		t.Run(f.name, func(t *testing.T) {
			testenv.InCgroup(t, cg, func() { streamThroughShortcuts(t, in, f.loopback) })
		})
	}
}

func streamThroughShortcuts(t *testing.T, in *bypass.Install, loopback string) {
	ns := testenv.MustNetNS(t)
	size := int64(64 << 20)
	up := testenv.Stream{Seed: 31, Size: size, MaxChunk: 100 << 10}
	down := testenv.Stream{Seed: 32, Size: size, MaxChunk: 100 << 10}
	head := "GET /x HTTP/1.1\r\nHost: a.example\r\n\r\n"
	upstreamErr := make(chan error, 1)
	start := make(chan struct{})
	server := mustUpstream(t, ns, loopback, func(c *net.TCPConn) {
		upstreamErr <- serveStreams(c, head, start, up, down)
	})
	other := mustUpstream(t, ns, loopback, func(c *net.TCPConn) {
		upstreamErr <- errors.New("request went to the default upstream, not its route")
	})
	p := mustProxy(t, ns, proxy.Config{
		Listen:    netip.AddrPortFrom(netip.MustParseAddr(loopback), 0),
		Upstreams: []netip.AddrPort{other},
		Routes:    []proxy.Route{{Host: "a.example", Upstreams: []netip.AddrPort{server}}},
		Mode:      proxy.Kernel,
		Proxy:     proxy.ProxyV2,
		Shortcuts: in,
	})
	c := dial(t, ns, p.Addr())
	if _, err := io.WriteString(c, head); err != nil {
		t.Fatal(err)
	}
	// As in TestStreamsBothWays: the streams start once the kernel forwards
	// both directions (a run whose readers lag from the start can stay in
	// user space, where no byte passes the join by).
	waitInKernel(t, p, 2)
	close(start)
	sent := make(chan error, 1)
	go func() { sent <- up.WriteAndClose(c) }()
	if err := down.Check(c, true); err != nil {
		t.Fatal(err)
	}
	if err := <-sent; err != nil {
		t.Fatal(err)
	}
	if err := <-upstreamErr; err != nil {
		t.Fatal(err)
	}
	st := checkTotals(t, p, uint64(len(head))+uint64(size), uint64(size))
	if st.ShortcutConns == 0 || st.PassedBy == 0 {
		t.Fatalf("stats %+v: no byte passed the proxy by, though bypass paired both legs", st)
	}
}
