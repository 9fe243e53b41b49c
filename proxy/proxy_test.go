package proxy_test

import (
	"bufio"
	"bytes"
	"context"
	"errors"
	"fmt"
	"io"
	"net"
	"net/netip"
	"os"
	"strconv"
	"strings"
	"sync"
	"syscall"
	"testing"
	"time"

	"github.com/shunt-project/shunt/internal/testenv"
	"github.com/shunt-project/shunt/proxy"
)

var modes = []proxy.Mode{proxy.Kernel, proxy.Copy, proxy.Pipe}

var families = []struct{ name, loopback string }{
	{"ipv4", "127.0.0.1"},
	{"ipv6", "::1"},
}

// mustProxy runs a proxy in ns, dialing its upstreams there, until the
// test ends.
func mustProxy(t *testing.T, ns *testenv.NetNS, cfg proxy.Config) *proxy.Proxy {
	t.Helper()
	cfg.Dial = func(ctx context.Context, network, addr string) (c net.Conn, err error) {
		ns.Do(t, func() { c, err = (&net.Dialer{}).DialContext(ctx, network, addr) })
		return c, err
	}
	p, logs := newProxy(t, ns, cfg)
	runUntilCleanup(t, p.Run, p.Close, logs)
	return p
}

// newProxy makes a proxy in ns (listening on loopback unless cfg says) and
// the buffer its log goes to.
func newProxy(t *testing.T, ns *testenv.NetNS, cfg proxy.Config) (*proxy.Proxy, *testenv.SyncBuffer) {
	t.Helper()
	if !cfg.Listen.IsValid() {
		cfg.Listen = netip.MustParseAddrPort("127.0.0.1:0")
	}
	var p *proxy.Proxy
	var err error
	logs := &testenv.SyncBuffer{}
	ns.Do(t, func() { p, err = proxy.New(cfg, logs.Logf) })
	if err != nil {
		t.Fatal(err)
	}
	return p, logs
}

// runUntilCleanup runs a proxy until the test ends, then closes it and, if
// the test failed, shows its log.
func runUntilCleanup(t *testing.T, run func(context.Context) error, close func() error, logs *testenv.SyncBuffer) {
	ctx, cancel := context.WithCancel(context.Background())
	done := make(chan error, 1)
	go func() { done <- run(ctx) }()
	t.Cleanup(func() {
		cancel()
		if err := <-done; err != nil {
			t.Error(err)
		}
		if err := close(); err != nil {
			t.Error(err)
		}
		if t.Failed() {
			t.Logf("proxy log:\n%s", logs.String())
		}
	})
}

// mustUpstream serves each connection with handle in ns; it returns the
// address.
func mustUpstream(t *testing.T, ns *testenv.NetNS, addr string, handle func(c *net.TCPConn)) netip.AddrPort {
	t.Helper()
	ln := testenv.Listen(t, testenv.Side{NS: ns}, "tcp", net.JoinHostPort(addr, "0"))
	testenv.Serve(ln, handle)
	return ln.Addr().(*net.TCPAddr).AddrPort()
}

func dial(t *testing.T, ns *testenv.NetNS, to netip.AddrPort) *net.TCPConn {
	t.Helper()
	return testenv.Dial(t, testenv.Side{NS: ns}, "tcp", to.String(), nil)
}

// TestStreamsBothWays: random-sized streams both ways at once, after a
// PROXY header and an HTTP head the proxy reads itself to route, arrive
// intact with FIN after the last byte, in every mode and family. In kernel
// mode the streams start once the kernel forwards both directions, so that
// its first bytes are the kernel's: how much more it forwards depends on
// which end is slowest (flow control, docs/ARCHITECTURE.md), and a run
// whose readers lag from the start may stay in user space throughout.
func TestStreamsBothWays(t *testing.T) {
	testenv.RequireRoot(t)
	for _, f := range families {
		for _, mode := range modes {
			t.Run(f.name+"/"+mode.String(), func(t *testing.T) {
				size := int64(32 << 20)
				if mode == proxy.Kernel {
					size = 256 << 20
				}
				ns := testenv.MustNetNS(t)
				up := testenv.Stream{Seed: 11, Size: size, MaxChunk: 100 << 10}
				down := testenv.Stream{Seed: 12, Size: size, MaxChunk: 100 << 10}
				head := "GET /x HTTP/1.1\r\nHost: A.example:80\r\n\r\n"
				upstreamErr := make(chan error, 1)
				start := make(chan struct{})
				server := mustUpstream(t, ns, f.loopback, func(c *net.TCPConn) {
					upstreamErr <- serveStreams(c, head, start, up, down)
				})
				other := mustUpstream(t, ns, f.loopback, func(c *net.TCPConn) {
					upstreamErr <- errors.New("request went to the default upstream, not its route")
				})
				p := mustProxy(t, ns, proxy.Config{
					Listen:    netip.AddrPortFrom(netip.MustParseAddr(f.loopback), 0),
					Upstreams: []netip.AddrPort{other},
					Routes:    []proxy.Route{{Host: "a.example", Upstreams: []netip.AddrPort{server}}},
					Mode:      mode,
					Proxy:     proxy.ProxyV2,
				})
				c := dial(t, ns, p.Addr())
				if _, err := io.WriteString(c, head); err != nil {
					t.Fatal(err)
				}
				if mode == proxy.Kernel {
					waitInKernel(t, p, 2)
				}
				close(start)
				errs := make(chan error, 2)
				go func() {
					if err := up.Write(c); err != nil {
						errs <- err
						return
					}
					errs <- c.CloseWrite()
				}()
				go func() { errs <- down.Check(c, true) }()
				for range 2 {
					if err := <-errs; err != nil {
						t.Fatal(err)
					}
				}
				if err := <-upstreamErr; err != nil {
					t.Fatal(err)
				}
				st := checkTotals(t, p, uint64(len(head))+uint64(size), uint64(size))
				if mode == proxy.Kernel && st.Kernel == 0 {
					t.Fatal("kernel mode moved no byte in the kernel, although it forwarded both directions when the streams began")
				}
			})
		}
	}
}

// serveStreams checks the PROXY v2 header and the HTTP head, then, once
// start is closed, checks the client's stream while sending its own, and
// closes after both.
func serveStreams(c *net.TCPConn, head string, start <-chan struct{}, up, down testenv.Stream) error {
	hdr := make([]byte, 16)
	if _, err := io.ReadFull(c, hdr); err != nil {
		return err
	}
	if !bytes.HasPrefix(hdr, []byte("\r\n\r\n\x00\r\nQUIT\n\x21")) {
		return fmt.Errorf("no PROXY v2 header: % x", hdr)
	}
	rest := make([]byte, int(hdr[14])<<8|int(hdr[15]))
	if _, err := io.ReadFull(c, rest); err != nil {
		return err
	}
	got := make([]byte, len(head))
	if _, err := io.ReadFull(c, got); err != nil || string(got) != head {
		return fmt.Errorf("request head %q, %v", got, err)
	}
	<-start
	errs := make(chan error, 1)
	go func() {
		if err := down.Write(c); err != nil {
			errs <- err
			return
		}
		errs <- c.CloseWrite()
	}()
	if err := up.Check(c, true); err != nil {
		return err
	}
	return <-errs
}

// waitInKernel waits until the kernel forwards n directions.
func waitInKernel(t *testing.T, p *proxy.Proxy, n int) {
	t.Helper()
	deadline := time.Now().Add(10 * time.Second)
	for p.Stats().InKernel != n {
		if time.Now().After(deadline) {
			t.Fatalf("%+v: the kernel forwards %d directions 10 s after the connection went idle, want %d", p.Stats(), p.Stats().InKernel, n)
		}
		time.Sleep(time.Millisecond)
	}
}

// checkTotals waits until the proxy holds no connection and checks that it
// counted up and down bytes and no failure.
func checkTotals(t *testing.T, p *proxy.Proxy, up, down uint64) proxy.Stats {
	t.Helper()
	waitIdle(t, p)
	st := p.Stats()
	t.Logf("%+v", st)
	if st.Up != up || st.Down != down || st.Failed != 0 {
		t.Fatalf("stats %+v, want %d bytes up and %d down, no failure", st, up, down)
	}
	return st
}

// waitIdle waits until the proxy holds no connection.
func waitIdle(t *testing.T, p *proxy.Proxy) {
	t.Helper()
	deadline := time.Now().Add(10 * time.Second)
	for p.Stats().Active != 0 {
		if time.Now().After(deadline) {
			t.Fatalf("%d connections still open 10 s after their ends closed", p.Stats().Active)
		}
		time.Sleep(5 * time.Millisecond)
	}
}

// TestRoundRobin: connections take the upstreams in turn, and one that
// refuses is skipped.
func TestRoundRobin(t *testing.T) {
	testenv.RequireRoot(t)
	ns := testenv.MustNetNS(t)
	var mu sync.Mutex
	hits := map[string]int{}
	named := func(name string) func(*net.TCPConn) {
		return func(c *net.TCPConn) {
			mu.Lock()
			hits[name]++
			mu.Unlock()
			io.WriteString(c, name)
		}
	}
	a := mustUpstream(t, ns, "127.0.0.1", named("a"))
	b := mustUpstream(t, ns, "127.0.0.1", named("b"))
	refusing := netip.MustParseAddrPort("127.0.0.1:1") // nothing listens on port 1 in a new namespace
	p := mustProxy(t, ns, proxy.Config{Upstreams: []netip.AddrPort{a, refusing, b}})
	for range 6 {
		c := dial(t, ns, p.Addr())
		if _, err := io.ReadAll(c); err != nil {
			t.Fatal(err)
		}
		c.Close()
	}
	mu.Lock()
	defer mu.Unlock()
	if hits["a"]+hits["b"] != 6 || hits["a"] < 2 || hits["b"] < 2 {
		t.Fatalf("connections per upstream %v, want 6 spread over a and b", hits)
	}
}

// TestRoutes: the Host header picks the upstream; anything else goes to the
// default ones.
func TestRoutes(t *testing.T) {
	testenv.RequireRoot(t)
	ns := testenv.MustNetNS(t)
	answer := func(name string) func(*net.TCPConn) {
		return func(c *net.TCPConn) {
			r := bufio.NewReader(c)
			for {
				l, err := r.ReadString('\n')
				if err != nil || l == "\r\n" || l == "\n" {
					break
				}
			}
			io.WriteString(c, name)
		}
	}
	def := mustUpstream(t, ns, "127.0.0.1", answer("default"))
	a := mustUpstream(t, ns, "127.0.0.1", answer("a"))
	b := mustUpstream(t, ns, "127.0.0.1", answer("b"))
	p := mustProxy(t, ns, proxy.Config{
		Upstreams: []netip.AddrPort{def},
		Routes: []proxy.Route{
			{Host: "a.example", Upstreams: []netip.AddrPort{a}},
			{Host: "b.example", Upstreams: []netip.AddrPort{b}},
		},
	})
	for req, want := range map[string]string{
		"GET / HTTP/1.1\r\nHost: a.example\r\n\r\n":          "a",
		"GET / HTTP/1.1\r\nhost: B.Example:8080\r\n\r\n":     "b",
		"GET / HTTP/1.1\r\nHost: c.example\r\n\r\n":          "default",
		"\x16\x03\x01 not http\r\n\r\n":                      "default",
		"POST /a HTTP/1.1\r\nX: y\r\nHost:a.example\r\n\r\n": "a",
	} {
		c := dial(t, ns, p.Addr())
		io.WriteString(c, req)
		got, err := io.ReadAll(c)
		if err != nil || string(got) != want {
			t.Errorf("%q went to %q (%v), want %q", req, got, err, want)
		}
		c.Close()
	}
}

// TestProxyHeaders: the PROXY header names the client and the address it
// reached, in both versions and families.
func TestProxyHeaders(t *testing.T) {
	testenv.RequireRoot(t)
	ns := testenv.MustNetNS(t)
	for _, f := range families {
		for _, v := range []proxy.ProxyProtocol{proxy.ProxyV1, proxy.ProxyV2} {
			got := make(chan []byte, 1)
			server := mustUpstream(t, ns, f.loopback, func(c *net.TCPConn) {
				c.CloseWrite()
				b, _ := io.ReadAll(c)
				got <- b
			})
			p := mustProxy(t, ns, proxy.Config{
				Listen:    netip.AddrPortFrom(netip.MustParseAddr(f.loopback), 0),
				Upstreams: []netip.AddrPort{server}, Proxy: v,
			})
			c := dial(t, ns, p.Addr())
			client := c.LocalAddr().(*net.TCPAddr).AddrPort()
			c.CloseWrite()
			io.ReadAll(c)
			h := <-got
			var want []byte
			if v == proxy.ProxyV1 {
				fam := map[string]string{"ipv4": "TCP4", "ipv6": "TCP6"}[f.name]
				want = fmt.Appendf(nil, "PROXY %s %s %s %d %d\r\n", fam, client.Addr(), p.Addr().Addr(), client.Port(), p.Addr().Port())
			} else {
				want = []byte("\r\n\r\n\x00\r\nQUIT\n\x21")
				ca, pa := client.Addr().AsSlice(), p.Addr().Addr().AsSlice()
				if f.name == "ipv4" {
					want = append(want, 0x11, 0, 12)
				} else {
					want = append(want, 0x21, 0, 36)
				}
				want = append(append(want, ca...), pa...)
				want = append(want, byte(client.Port()>>8), byte(client.Port()), byte(p.Addr().Port()>>8), byte(p.Addr().Port()))
			}
			if !bytes.Equal(h, want) {
				t.Errorf("%s %s: header % x, want % x", f.name, v, h, want)
			}
		}
	}
}

// TestUpstreamRefuses: with no upstream reachable the client is reset at
// once and the refusal counted; the proxy keeps serving.
func TestUpstreamRefuses(t *testing.T) {
	testenv.RequireRoot(t)
	for _, mode := range modes {
		ns := testenv.MustNetNS(t)
		p := mustProxy(t, ns, proxy.Config{Upstreams: []netip.AddrPort{netip.MustParseAddrPort("127.0.0.1:1")}, Mode: mode})
		// The reset can beat connect() back to the client.
		var c net.Conn
		var err error
		ns.Do(t, func() { c, err = net.Dial("tcp", p.Addr().String()) })
		if err == nil {
			c.SetReadDeadline(time.Now().Add(5 * time.Second))
			_, err = c.Read(make([]byte, 1))
			c.Close()
		}
		if !errors.Is(err, syscall.ECONNRESET) {
			t.Fatalf("%s: client got %v, want ECONNRESET", mode, err)
		}
		waitIdle(t, p)
		if st := p.Stats(); st.Refused != 1 {
			t.Fatalf("%s: %+v, want 1 refused", mode, st)
		}
	}
}

// TestResetThroughProxy: an upstream that resets resets the client, and a
// client that resets resets the upstream, in every mode.
func TestResetThroughProxy(t *testing.T) {
	testenv.RequireRoot(t)
	for _, mode := range modes {
		ns := testenv.MustNetNS(t)
		upErr := make(chan error, 1)
		server := mustUpstream(t, ns, "127.0.0.1", func(c *net.TCPConn) {
			buf := make([]byte, 5)
			io.ReadFull(c, buf)
			if string(buf) == "reset" {
				c.SetLinger(0)
				return
			}
			c.SetReadDeadline(time.Now().Add(5 * time.Second))
			_, err := c.Read(buf)
			upErr <- err
		})
		p := mustProxy(t, ns, proxy.Config{Upstreams: []netip.AddrPort{server}, Mode: mode})

		c := dial(t, ns, p.Addr())
		io.WriteString(c, "reset")
		c.SetReadDeadline(time.Now().Add(5 * time.Second))
		if _, err := c.Read(make([]byte, 1)); !errors.Is(err, syscall.ECONNRESET) {
			t.Fatalf("%s: client read %v after the upstream reset, want ECONNRESET", mode, err)
		}

		c = dial(t, ns, p.Addr())
		io.WriteString(c, "hello")
		time.Sleep(20 * time.Millisecond)
		c.SetLinger(0)
		c.Close()
		if err := <-upErr; !errors.Is(err, syscall.ECONNRESET) {
			t.Fatalf("%s: upstream read %v after the client reset, want ECONNRESET", mode, err)
		}
		waitIdle(t, p)
	}
}

// TestManyConnectionsLeaveNothing: 10,000 short connections through the
// kernel mode, 64 at a time, leave no connection, no CLOSE_WAIT socket and
// no map entry behind.
func TestManyConnectionsLeaveNothing(t *testing.T) {
	testenv.RequireRoot(t)
	ns := testenv.MustNetNS(t)
	server := mustUpstream(t, ns, "127.0.0.1", func(c *net.TCPConn) {
		b, err := io.ReadAll(c)
		if err == nil {
			c.Write(b)
		}
	})
	p := mustProxy(t, ns, proxy.Config{Upstreams: []netip.AddrPort{server}})
	const n, workers = 10000, 64
	errs := make(chan error, workers)
	var wg sync.WaitGroup
	for w := range workers {
		wg.Add(1)
		go func() {
			defer wg.Done()
			for i := w; i < n; i += workers {
				if err := echoOnce(ns, p.Addr(), fmt.Sprintf("connection %d", i)); err != nil {
					errs <- err
					return
				}
			}
		}()
	}
	wg.Wait()
	close(errs)
	for err := range errs {
		t.Fatal(err)
	}
	waitIdle(t, p)
	st := p.Stats()
	if st.Accepted != n || st.Failed != 0 {
		t.Fatalf("%+v, want %d accepted and none failed", st, n)
	}
	if st.Kernel == 0 {
		t.Fatal("the kernel moved no byte")
	}
	if socks, cookies, err := p.MapEntries(); err != nil || socks+cookies != 0 {
		t.Fatalf("%d sockets and %d cookies left in the maps (%v)", socks, cookies, err)
	}
	if cw := closeWait(t, ns); cw != 0 {
		t.Fatalf("%d sockets in CLOSE_WAIT", cw)
	}
}

func echoOnce(ns *testenv.NetNS, to netip.AddrPort, msg string) error {
	var c net.Conn
	var err error
	if err := ns.NetNS.Do(func() error { c, err = net.Dial("tcp", to.String()); return err }); err != nil {
		return err
	}
	defer c.Close()
	if _, err := io.WriteString(c, msg); err != nil {
		return err
	}
	c.(*net.TCPConn).CloseWrite()
	c.SetReadDeadline(time.Now().Add(10 * time.Second))
	got, err := io.ReadAll(c)
	if err != nil || string(got) != msg {
		return fmt.Errorf("echo of %q: %q, %v", msg, got, err)
	}
	return nil
}

// closeWait counts CLOSE_WAIT sockets in ns (state 08 in /proc/net/tcp*).
func closeWait(t *testing.T, ns *testenv.NetNS) int {
	t.Helper()
	n := 0
	ns.Do(t, func() {
		for _, f := range []string{"/proc/net/tcp", "/proc/net/tcp6"} {
			b, err := os.ReadFile(f)
			if err != nil {
				t.Fatal(err)
			}
			for _, l := range strings.Split(string(b), "\n")[1:] {
				if fs := strings.Fields(l); len(fs) > 3 && fs[3] == "08" {
					n++
				}
			}
		}
	})
	return n
}

// TestSlowUpstreamHoldsClient: an upstream that stops reading stops the
// client in every mode, after about as many bytes as a plain copying proxy
// holds (socket buffers on both sides), and everything accepted arrives.
func TestSlowUpstreamHoldsClient(t *testing.T) {
	testenv.RequireRoot(t)
	accepted := map[proxy.Mode]int64{}
	for _, mode := range modes {
		ns := testenv.MustNetNS(t)
		reading := make(chan struct{})
		got := make(chan error, 1)
		var stream testenv.Stream
		server := mustUpstream(t, ns, "127.0.0.1", func(c *net.TCPConn) {
			<-reading
			got <- stream.Check(c, true)
		})
		p := mustProxy(t, ns, proxy.Config{Upstreams: []netip.AddrPort{server}, Mode: mode})
		c := dial(t, ns, p.Addr())
		if mode == proxy.Kernel {
			// Bytes the client sends before the join are forwarded from
			// user space (they were queued); a stall of the upstream met
			// there holds the client without flow control. Stream once the
			// pair is in the kernel.
			waitInKernel(t, p, 2)
		}
		stream = testenv.Stream{Seed: 41, Size: 512 << 20, MaxChunk: 64 << 10}
		n, err := stream.WriteUntilStalled(c, 500*time.Millisecond)
		if !errors.Is(err, testenv.ErrStalled) {
			t.Fatalf("%s: the client was never held back: %d bytes accepted (%v)", mode, n, err)
		}
		accepted[mode] = n
		stream.Size = n
		c.CloseWrite()
		close(reading)
		if err := <-got; err != nil {
			t.Fatalf("%s: %v", mode, err)
		}
		if mode == proxy.Kernel {
			waitIdle(t, p)
			if st := p.Stats(); st.Throttled == 0 {
				t.Errorf("kernel: stats %+v: flow control held the client back, yet no hand-off to user space was counted", st)
			}
		}
	}
	// Four socket buffers lie on the way (client send, proxy receive,
	// proxy send, upstream receive); autotuning decides how full they get,
	// so the user-space modes themselves vary 8-21 MiB here. Without flow
	// control the kernel mode would take all 512 MiB.
	bound := 2 * (2*tcpBufMax(t, "tcp_wmem") + 2*tcpBufMax(t, "tcp_rmem"))
	t.Logf("bytes accepted with the upstream not reading: %v (bound %d)", accepted, bound)
	for mode, n := range accepted {
		if n > bound {
			t.Errorf("%s: the client wrote %d bytes with nobody reading, over twice the socket buffers on the way (%d)", mode, n, bound)
		}
	}
}

// tcpBufMax is the largest buffer TCP autotuning gives (the sysctl's third value).
func tcpBufMax(t *testing.T, name string) int64 {
	b, err := os.ReadFile("/proc/sys/net/ipv4/" + name)
	if err != nil {
		t.Fatal(err)
	}
	f := strings.Fields(string(b))
	n, err := strconv.ParseInt(f[len(f)-1], 10, 64)
	if err != nil {
		t.Fatal(err)
	}
	return n
}
