package proxy

import (
	"github.com/shunt-project/shunt/bypass"

	"context"
	"errors"
	"fmt"
	"net"
	"net/netip"
	"strings"
	"time"
)

// Mode says how a connection's bytes move once its upstream is chosen.
type Mode int

const (
	// Kernel joins client and upstream sockets in the kernel (package splice).
	Kernel Mode = iota
	// Copy moves bytes through a user-space buffer: read, then write.
	Copy
	// Pipe moves bytes through a pipe with splice(2), as HAProxy does.
	Pipe
)

func (m Mode) String() string {
	switch m {
	case Kernel:
		return "kernel"
	case Copy:
		return "copy"
	case Pipe:
		return "pipe"
	}
	return fmt.Sprintf("mode(%d)", int(m))
}

// ParseMode reads "kernel", "copy" or "pipe".
func ParseMode(s string) (Mode, error) {
	for _, m := range []Mode{Kernel, Copy, Pipe} {
		if s == m.String() {
			return m, nil
		}
	}
	if s == "splice" {
		// In shunt "splice" names the kernel join (package splice,
		// shunt splice): splice(2) through a pipe is "pipe".
		return 0, fmt.Errorf(`unknown mode "splice": splice(2) through a pipe is --mode pipe; the kernel join is --mode kernel`)
	}
	return 0, fmt.Errorf("unknown mode %q: want kernel, copy or pipe", s)
}

// ProxyProtocol is the PROXY protocol header sent to the upstream first.
type ProxyProtocol int

const (
	NoProxyProtocol ProxyProtocol = iota
	ProxyV1                       // text header
	ProxyV2                       // binary header
)

func (p ProxyProtocol) String() string {
	return [...]string{"none", "v1", "v2"}[p]
}

// ParseProxyProtocol reads "none", "v1" or "v2".
func ParseProxyProtocol(s string) (ProxyProtocol, error) {
	for _, p := range []ProxyProtocol{NoProxyProtocol, ProxyV1, ProxyV2} {
		if s == p.String() {
			return p, nil
		}
	}
	return 0, fmt.Errorf("unknown PROXY protocol version %q: want none, v1 or v2", s)
}

// Route sends HTTP requests for Host to its own upstreams.
type Route struct {
	Host      string
	Upstreams []netip.AddrPort
}

// ParseRoute reads HOST=ADDR:PORT[,ADDR:PORT...].
func ParseRoute(s string) (Route, error) {
	host, list, ok := strings.Cut(s, "=")
	if !ok || host == "" {
		return Route{}, fmt.Errorf("route %q: want HOST=ADDR:PORT[,ADDR:PORT]", s)
	}
	ups, err := ParseUpstreams(list)
	if err != nil {
		return Route{}, fmt.Errorf("route %q: %w", s, err)
	}
	return Route{Host: strings.ToLower(host), Upstreams: ups}, nil
}

// ParseUpstreams reads ADDR:PORT[,ADDR:PORT...] (IPv6 in brackets).
func ParseUpstreams(s string) ([]netip.AddrPort, error) {
	var ups []netip.AddrPort
	for _, f := range strings.Split(s, ",") {
		ap, err := ParseAddrPort(strings.TrimSpace(f))
		if err != nil {
			return nil, err
		}
		ups = append(ups, ap)
	}
	return ups, nil
}

// ParseAddrPort reads an IP address and a port, like 127.0.0.1:8080 or
// [::1]:8080.
func ParseAddrPort(s string) (netip.AddrPort, error) {
	ap, err := netip.ParseAddrPort(s)
	if err != nil {
		return netip.AddrPort{}, fmt.Errorf("address %q: want IP:PORT, like 127.0.0.1:8080 or [::1]:8080", s)
	}
	return ap, nil
}

// Config describes a proxy.
type Config struct {
	Listen    netip.AddrPort
	Upstreams []netip.AddrPort // round robin; the default when routes are set
	Routes    []Route          // by the HTTP Host header of the first request
	Mode      Mode
	Proxy     ProxyProtocol
	// MaxInflight bounds what the kernel may hand to one outgoing socket
	// unacknowledged (Kernel mode; 0: the splice package's default).
	MaxInflight uint32
	// DialTimeout bounds connecting to one upstream (0: 5 s).
	DialTimeout time.Duration
	// HeadTimeout bounds reading the request head when routes are set (0: 5 s).
	HeadTimeout time.Duration
	// MaxConns bounds connections at once (0: 10,000).
	MaxConns int
	// Dial connects to an upstream (nil: net.Dialer with DialTimeout). A
	// caller whose upstreams live in another network namespace dials there.
	Dial func(ctx context.Context, network, addr string) (net.Conn, error)
	// Shortcuts (Kernel mode; nil: none): where this bypass install
	// paired both legs of a connection (client, proxy and upstream in
	// enabled cgroups), the client's sends go straight into the upstream's
	// socket and back whenever nothing that took TCP is on its way
	// through the join, which keeps the rest, the end and the reset.
	Shortcuts *bypass.Install
}

// maxHead bounds the request head read for routing.
const maxHead = 8 << 10

func (c *Config) check() error {
	if !c.Listen.IsValid() {
		return errors.New("a listen address is required")
	}
	if len(c.Upstreams) == 0 {
		return errors.New("at least one upstream is required")
	}
	for _, u := range c.Upstreams {
		if u.Port() == 0 || u.Addr().IsUnspecified() {
			return fmt.Errorf("upstream %s: want a concrete address and port", u)
		}
	}
	for _, r := range c.Routes {
		if len(r.Upstreams) == 0 {
			return fmt.Errorf("route %s has no upstream", r.Host)
		}
	}
	if c.Mode < Kernel || c.Mode > Pipe {
		return fmt.Errorf("unknown mode %d", c.Mode)
	}
	if c.DialTimeout == 0 {
		c.DialTimeout = 5 * time.Second
	}
	if c.HeadTimeout == 0 {
		c.HeadTimeout = 5 * time.Second
	}
	if c.MaxConns == 0 {
		c.MaxConns = 10000
	}
	if c.Dial == nil {
		c.Dial = (&net.Dialer{}).DialContext
	}
	return nil
}
