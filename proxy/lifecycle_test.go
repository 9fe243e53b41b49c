package proxy_test

import (
	"context"
	"net"
	"net/netip"
	"strings"
	"testing"
	"time"

	"github.com/shunt-project/shunt/internal/testenv"
	"github.com/shunt-project/shunt/proxy"
)

// startProxy runs a proxy in ns with cfg as given (its Dial included) and
// returns it with its log and what stops Run; the caller closes it.
func startProxy(t *testing.T, ns *testenv.NetNS, cfg proxy.Config) (*proxy.Proxy, *testenv.SyncBuffer, func() error) {
	t.Helper()
	p, logs := newProxy(t, ns, cfg)
	ctx, cancel := context.WithCancel(context.Background())
	done := make(chan error, 1)
	go func() { done <- p.Run(ctx) }()
	stop := func() error {
		cancel()
		return <-done
	}
	return p, logs, stop
}

// Close resets every connection, also those whose handler still reads the
// request head or dials the upstream, and returns at once. Before, those
// handlers registered their connections only once relaying, so Close's
// wait lasted until the head timeout or the dial's (30 s here), and a
// handler could start relaying after Close.
func TestCloseWhileHandlersWait(t *testing.T) {
	for _, mode := range []proxy.Mode{proxy.Copy, proxy.Pipe} {
		t.Run(mode.String(), func(t *testing.T) {
			ns := testenv.MustNetNS(t)
			dialing := make(chan struct{}, 1)
			cfg := proxy.Config{
				Mode:        mode,
				Upstreams:   []netip.AddrPort{netip.MustParseAddrPort("127.0.0.1:9")},
				Routes:      []proxy.Route{{Host: "slow", Upstreams: []netip.AddrPort{netip.MustParseAddrPort("127.0.0.1:9")}}},
				HeadTimeout: 30 * time.Second,
				DialTimeout: 30 * time.Second,
				// An upstream that never answers: the dial waits for its
				// context.
				Dial: func(ctx context.Context, _, _ string) (net.Conn, error) {
					dialing <- struct{}{}
					<-ctx.Done()
					return nil, ctx.Err()
				},
			}
			p, _, stop := startProxy(t, ns, cfg)
			addr := p.Addr()
			// One client sends half a head (its handler reads on), one a
			// whole one (its handler dials).
			reading := dial(t, ns, addr)
			reading.Write([]byte("GET / HTTP/1.1\r\n"))
			waiting := dial(t, ns, addr)
			waiting.Write([]byte("GET / HTTP/1.1\r\nHost: slow\r\n\r\n"))
			select {
			case <-dialing:
			case <-time.After(5 * time.Second):
				t.Fatal("the proxy did not dial within 5 s")
			}
			start := time.Now()
			if err := stop(); err != nil {
				t.Fatal(err)
			}
			if err := p.Close(); err != nil {
				t.Fatal(err)
			}
			if took := time.Since(start); took > 3*time.Second {
				t.Errorf("Close took %v with handlers reading and dialing", took)
			}
			for name, c := range map[string]*net.TCPConn{"reading": reading, "dialing": waiting} {
				c.SetReadDeadline(time.Now().Add(2 * time.Second))
				if _, err := c.Read(make([]byte, 1)); err == nil || strings.Contains(err.Error(), "timeout") {
					t.Errorf("%s client after Close: %v, want its connection ended", name, err)
				}
			}
		})
	}
}

// A Config.Dial that returns some other net.Conn than a TCP one gets the
// client refused and a log line; before, the proxy panicked.
func TestDialThatIsNotTCP(t *testing.T) {
	ns := testenv.MustNetNS(t)
	cfg := proxy.Config{
		Mode:      proxy.Copy,
		Upstreams: []netip.AddrPort{netip.MustParseAddrPort("127.0.0.1:9")},
		Dial: func(context.Context, string, string) (net.Conn, error) {
			a, _ := net.Pipe()
			return a, nil
		},
	}
	p, logs, stop := startProxy(t, ns, cfg)
	defer func() { stop(); p.Close() }()
	var c net.Conn
	var err error
	ns.Do(t, func() { c, err = net.Dial("tcp", p.Addr().String()) })
	if err == nil {
		// The reset may come before connect returns, or after.
		defer c.Close()
		c.SetReadDeadline(time.Now().Add(5 * time.Second))
		_, err = c.Read(make([]byte, 1))
	}
	if err == nil || strings.Contains(err.Error(), "timeout") {
		t.Errorf("client: %v, want its connection refused", err)
	}
	for deadline := time.Now().Add(2 * time.Second); !strings.Contains(logs.String(), "not a *net.TCPConn") && time.Now().Before(deadline); {
		time.Sleep(10 * time.Millisecond)
	}
	if !strings.Contains(logs.String(), "Config.Dial returned a *net.pipe, not a *net.TCPConn") {
		t.Errorf("log %q does not say why", logs.String())
	}
}
