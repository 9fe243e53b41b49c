package main

import (
	"context"
	"errors"
	"fmt"
	"net/netip"
	"path/filepath"
	"strings"
	"time"

	"github.com/spf13/cobra"

	"github.com/shunt-project/shunt/bypass"
	"github.com/shunt-project/shunt/host"
	"github.com/shunt-project/shunt/proxy"
)

func newProxyCmd(e *env, g *globals) *cobra.Command {
	var fl proxyFlags
	c := &cobra.Command{
		Use:   "proxy --listen ADDR:PORT --upstream ADDR:PORT[,ADDR:PORT...]",
		Short: "A TCP proxy whose connections are joined in the kernel",
		Long: `proxy accepts TCP connections on --listen, connects each to an upstream
(round robin over --upstream, skipping one that refuses), and moves the
connection's bytes:

  --mode kernel   joined in the kernel (sk_skb redirect): no copy and no
                  wake-up per chunk; user space only forwards FIN and RST and
                  takes over while the far reader is slow (flow control)
  --mode copy     through a user-space buffer (read, then write)
  --mode pipe     through a pipe with splice(2), as HAProxy does

Where bypass is enabled (--pin-dir) for the client, the proxy and the
upstream alike, so that it pairs both legs of a connection, kernel mode goes
further: the client's sends go straight into the upstream's socket and back,
as if there were no proxy, whenever nothing that took TCP is still on its
way through the join (which keeps forwarding the rest, and the connection's
end and reset). --shortcuts=false keeps every byte in the join.

With --route HOST=ADDR:PORT[,...] the proxy reads the first request head
(HTTP/1) and sends requests for that Host to those upstreams; others, and
anything that is not HTTP, go to --upstream. The bytes it read go to the
upstream first, then the connection is handed over. --proxy-protocol v1 or v2
puts a PROXY protocol header with the client's address before them.

With --udp it proxies UDP instead: each client's first datagram opens a flow,
a socket connected to the client (bound beside the listener) and one
connected to an upstream, joined in the kernel (--mode kernel: each datagram
whole, dropped past --max-inflight of kernel memory waiting to leave) or
relayed (--mode copy); a flow that carries nothing for --idle is closed. A
flow whose upstream refuses (ICMP port unreachable) is closed and, if that
upstream never answered it, reopened on the next one with what it had sent;
a refusing upstream is tried last by new flows for 10 s. A wildcard listener
answers each client from the address the client sent to.

It runs until interrupted (Ctrl-C, SIGTERM), then resets the connections it
still holds. Kernel mode needs root. --metrics-addr serves its counters to
Prometheus (docs/METRICS.md).`,
		Example: `  shunt proxy --listen 127.0.0.1:8080 --upstream 127.0.0.1:9000,127.0.0.1:9001
  shunt proxy --listen [::]:443 --upstream 10.0.0.5:443 --proxy-protocol v2
  shunt proxy --listen 0.0.0.0:80 --upstream 10.0.0.9:80 --route api.example=10.0.0.7:80
  shunt proxy --udp --listen 0.0.0.0:53 --upstream 10.0.0.2:53,10.0.0.3:53`,
		Args: noArgs,
		RunE: func(c *cobra.Command, _ []string) error {
			cfg, err := fl.config()
			if err != nil {
				return usageError{fmt.Errorf("%w (see '%s --help')", err, c.CommandPath())}
			}
			if cfg.Mode == proxy.Kernel {
				if err := host.CheckPrivileges(); err != nil {
					return fmt.Errorf("--mode kernel: %w (or use --mode copy)", err)
				}
			}
			if fl.udp {
				return runUDPProxy(c.Context(), e, cfg, fl.idle, fl.metricsAddr)
			}
			if cfg.Mode == proxy.Kernel && fl.shortcuts {
				in, note, err := openShortcuts(g.pinDir)
				if err != nil {
					return err
				}
				if note != "" {
					fmt.Fprintf(e.stderr, "proxy: %s\n", note)
				}
				if in != nil {
					defer in.Close()
					cfg.Shortcuts = in
				}
			}
			return runTCPProxy(c.Context(), e, cfg, fl.metricsAddr)
		},
	}
	f := c.Flags()
	f.StringVar(&fl.listen, "listen", "", "address to accept connections on, like 127.0.0.1:8080 or [::]:8080")
	f.StringVar(&fl.upstreams, "upstream", "", "upstream addresses, comma separated, taken in turn")
	f.StringVar(&fl.mode, "mode", "kernel", "kernel (joined in the kernel), copy (read and write) or pipe (splice(2) through a pipe): how bytes move once connected")
	f.StringVar(&fl.proxyProto, "proxy-protocol", "none", "none, v1 or v2: announce the client to the upstream")
	f.StringArrayVar(&fl.routes, "route", nil, "HOST=ADDR:PORT[,ADDR:PORT]: HTTP requests for HOST go there (repeatable)")
	f.StringVar(&fl.maxInflight, "max-inflight", "4M", "kernel mode: bytes one direction may have unacknowledged in the outgoing socket before user space paces it")
	f.IntVar(&fl.maxConns, "max-conns", 10000, "connections (UDP: flows) at once; more are refused")
	f.BoolVar(&fl.shortcuts, "shortcuts", true, "kernel mode: where bypass (installed at --pin-dir) paired both legs of a connection, the client's bytes go straight to the upstream's socket and back, passing the join by")
	f.BoolVar(&fl.udp, "udp", false, "proxy UDP datagrams instead of TCP connections (modes kernel and copy)")
	f.DurationVar(&fl.idle, "idle", proxy.DefaultUDPIdle, "--udp: close a flow that carried nothing for this long")
	metricsAddrFlag(c, &fl.metricsAddr)
	return c
}

// proxyFlags are proxy's flags as given.
type proxyFlags struct {
	listen, upstreams, mode, proxyProto, maxInflight string
	metricsAddr                                      string
	routes                                           []string
	maxConns                                         int
	udp, shortcuts                                   bool
	idle                                             time.Duration
}

// config checks the flags and makes the proxy's configuration; each error
// names the flag to fix. It touches nothing.
func (fl proxyFlags) config() (proxy.Config, error) {
	var cfg proxy.Config
	if fl.listen == "" || fl.upstreams == "" {
		return cfg, errors.New("--listen and --upstream are required")
	}
	var err error
	if cfg.Listen, err = proxy.ParseAddrPort(fl.listen); err != nil {
		return cfg, fmt.Errorf("--listen: %w", err)
	}
	if cfg.Upstreams, err = proxy.ParseUpstreams(fl.upstreams); err != nil {
		return cfg, fmt.Errorf("--upstream: %w", err)
	}
	for _, r := range fl.routes {
		rt, err := proxy.ParseRoute(r)
		if err != nil {
			return cfg, fmt.Errorf("--route: %w", err)
		}
		cfg.Routes = append(cfg.Routes, rt)
	}
	if cfg.Mode, err = proxy.ParseMode(fl.mode); err != nil {
		return cfg, fmt.Errorf("--mode: %w", err)
	}
	if cfg.Proxy, err = proxy.ParseProxyProtocol(fl.proxyProto); err != nil {
		return cfg, fmt.Errorf("--proxy-protocol: %w", err)
	}
	sizes, err := parseSizes("--max-inflight", fl.maxInflight)
	if err != nil || len(sizes) != 1 || sizes[0] > 1<<30 {
		return cfg, fmt.Errorf("--max-inflight: want one size up to 1G, like 4M, got %q", fl.maxInflight)
	}
	cfg.MaxInflight = uint32(sizes[0])
	if fl.maxConns < 1 || fl.maxConns > 1<<20 {
		return cfg, fmt.Errorf("--max-conns: want 1 to %d, got %d", 1<<20, fl.maxConns)
	}
	cfg.MaxConns = fl.maxConns
	if err := checkMetricsAddr(fl.metricsAddr); err != nil {
		return cfg, err
	}
	if fl.udp && fl.idle <= 0 {
		return cfg, errors.New("--idle: want a positive duration, like 60s")
	}
	return cfg, nil
}

// openShortcuts opens the bypass install at dir for the kernel mode's
// shortcuts, and says what the user should know about them; nil if there is
// no install, or one that cannot take them.
func openShortcuts(dir string) (*bypass.Install, string, error) {
	in, err := bypass.Open(dir)
	if errors.Is(err, bypass.ErrNotInstalled) {
		if parent := filepath.Dir(filepath.Clean(dir)); !host.IsBPFFS(parent) {
			// Silent otherwise: a proxy started by 'ip netns exec' (which
			// mounts a sysfs of its own) would lose its shortcuts unsaid.
			return nil, fmt.Sprintf("no bpffs at %s in this mount namespace, so no bypass install is seen: every byte takes the join ('ip netns exec' hides the host's bpffs; 'nsenter --net=/run/netns/NAME' does not)", parent), nil
		}
		return nil, "", nil
	}
	if err != nil {
		return nil, "", fmt.Errorf("--shortcuts: %w (or --shortcuts=false)", err)
	}
	if !in.HasShortcuts() {
		in.Close()
		return nil, fmt.Sprintf("bypass at %s was installed by an older shunt and cannot pass the join by (disable --all and enable again to get shortcuts)", dir), nil
	}
	return in, fmt.Sprintf("bypass is installed at %s: a connection whose two legs it pairs passes the join by (--shortcuts=false keeps every byte in the join)", dir), nil
}

// runTCPProxy runs a TCP proxy until ctx ends, and says what it did.
func runTCPProxy(ctx context.Context, e *env, cfg proxy.Config, metricsAddr string) error {
	p, err := proxy.New(cfg, func(format string, args ...any) {
		fmt.Fprintf(e.stderr, format+"\n", args...)
	})
	if err != nil {
		return err
	}
	stopMetrics, err := serveProcessMetrics(e, metricsAddr, proxy.Collector(p.Stats))
	if err != nil {
		p.Close()
		return err
	}
	fmt.Fprintf(e.stderr, "proxy: listening on %s, mode %s, upstreams %s%s\n",
		p.Addr(), cfg.Mode, joinAddrs(cfg.Upstreams), describeRoutes(cfg.Routes))
	runErr := p.Run(ctx)
	closeErr := errors.Join(p.Close(), stopMetrics())
	st := p.Stats() // after Close: connections count when they end
	fmt.Fprintf(e.stderr, "proxy: stopped after %d connections (%d refused, %d failed); %d bytes up, %d down, %d of them moved by the kernel",
		st.Accepted, st.Refused, st.Failed, st.Up, st.Down, st.Kernel)
	if cfg.Shortcuts != nil {
		fmt.Fprintf(e.stderr, " (%d straight between client and upstream, on %d connections with both legs paired)", st.PassedBy, st.ShortcutConns)
	}
	fmt.Fprintln(e.stderr)
	if runErr != nil {
		return runErr
	}
	return closeErr
}

func runUDPProxy(ctx context.Context, e *env, cfg proxy.Config, idle time.Duration, metricsAddr string) error {
	p, err := proxy.NewUDP(cfg, idle, func(format string, args ...any) {
		fmt.Fprintf(e.stderr, format+"\n", args...)
	})
	if err != nil {
		return err
	}
	stopMetrics, err := serveProcessMetrics(e, metricsAddr, proxy.UDPCollector(p.Stats))
	if err != nil {
		p.Close()
		return err
	}
	fmt.Fprintf(e.stderr, "proxy: listening on udp %s, mode %s, upstreams %s, idle %v\n", p.Addr(), cfg.Mode, joinAddrs(cfg.Upstreams), idle)
	runErr := p.Run(ctx)
	closeErr := errors.Join(p.Close(), stopMetrics())
	st := p.Stats()
	fmt.Fprintf(e.stderr, "proxy: stopped after %d UDP flows (%d refused, %d upstream refusals); %d datagrams up, %d down, %d of them moved by the kernel, %d dropped\n",
		st.Flows, st.Refused, st.UpstreamRefused, st.Up, st.Down, st.Kernel, st.Dropped)
	if runErr != nil {
		return runErr
	}
	return closeErr
}

func joinAddrs(addrs []netip.AddrPort) string {
	s := make([]string, len(addrs))
	for i, a := range addrs {
		s[i] = a.String()
	}
	return strings.Join(s, ",")
}

func describeRoutes(routes []proxy.Route) string {
	var b strings.Builder
	for _, r := range routes {
		fmt.Fprintf(&b, ", %s -> %s", r.Host, joinAddrs(r.Upstreams))
	}
	return b.String()
}
