package policy_test

import (
	"context"
	"errors"
	"fmt"
	"io"
	"net"
	"net/netip"
	"testing"
	"time"

	"golang.org/x/sys/unix"

	"github.com/shunt-project/shunt/internal/testenv"
	"github.com/shunt-project/shunt/proxy"
)

// TestApplyClosesSplicedConnection: a connection `shunt proxy --mode
// kernel` joined in the kernel, whose upstream side a new egress rule of
// the proxy's scope denies, is closed at the apply: the client gets a reset
// and no byte more crosses.
func TestApplyClosesSplicedConnection(t *testing.T) {
	p := mustPolicy(t)
	cg := testenv.MustCgroup(t)
	ns := mustAddressNS(t)
	listeners(t, testenv.Side{NS: ns}, 80)
	mustApply(t, p, mustParse(t, fmt.Sprintf("scopes: [{cgroup: %s}]", cg.Path)))

	proxySide := testenv.Side{NS: ns, CG: cg}
	cfg := proxy.Config{
		Listen:    netip.MustParseAddrPort("127.0.0.1:0"),
		Upstreams: []netip.AddrPort{netip.MustParseAddrPort("10.9.0.1:80")},
		Mode:      proxy.Kernel,
		// The proxy's upstream sockets are made in the scope.
		Dial: func(ctx context.Context, network, addr string) (c net.Conn, err error) {
			proxySide.Make(t, func() { c, err = (&net.Dialer{}).DialContext(ctx, network, addr) })
			return c, err
		},
	}
	var px *proxy.Proxy
	var err error
	ns.Do(t, func() { px, err = proxy.New(cfg, t.Logf) })
	if err != nil {
		t.Fatal(err)
	}
	ctx, cancel := context.WithCancel(context.Background())
	done := make(chan error, 1)
	go func() { done <- px.Run(ctx) }()
	t.Cleanup(func() {
		cancel()
		<-done
		px.Close()
	})

	c := testenv.Dial(t, testenv.Side{NS: ns}, "tcp", px.Addr().String(), nil)
	if err := echo(c); err != nil {
		t.Fatal(err)
	}
	for deadline := time.Now().Add(5 * time.Second); px.Stats().InKernel < 2; time.Sleep(10 * time.Millisecond) {
		if time.Now().After(deadline) {
			t.Fatalf("the proxy did not join the connection in the kernel: %+v", px.Stats())
		}
	}
	if err := echo(c); err != nil {
		t.Fatalf("through the kernel join: %v", err)
	}

	res := mustApply(t, p, mustParse(t, fmt.Sprintf("scopes: [{cgroup: %s, egress: [{action: deny, cidr: 10.9.0.0/16, port: 80}]}]", cg.Path)))
	if len(res.Closed) != 1 {
		t.Errorf("apply closed %d connections, want the proxy's upstream one: %+v", len(res.Closed), res.Closed)
	}
	if err := echo(c); !errors.Is(err, unix.ECONNRESET) && !errors.Is(err, io.EOF) {
		t.Errorf("the client after the apply: %v, want a reset", err)
	}
}
