package proxy

import (
	"context"
	"errors"
	"fmt"
	"net"
	"net/netip"
	"os"
	"sync"
	"sync/atomic"
	"syscall"
	"time"

	"golang.org/x/sys/unix"

	"github.com/shunt-project/shunt/host"
	"github.com/shunt-project/shunt/internal/sockutil"
	"github.com/shunt-project/shunt/splice"
)

// UDP proxying. UDP has no connection to accept, so the proxy makes one per
// client: the first datagram from a client arrives on the listener, and the
// proxy opens a socket bound to the same address (SO_REUSEADDR) and
// connected to that client, which from then on receives the client's
// datagrams (the kernel's lookup prefers a connected socket), and a socket connected
// to an upstream. The two are joined in the kernel (Kernel mode,
// splice.UDPSplicer) or relayed by two goroutines (Copy mode). A flow with
// no datagram either way for the idle time is closed.

// DefaultUDPIdle is how long a UDP flow may carry nothing before it is
// closed.
const DefaultUDPIdle = 60 * time.Second

// UDPStats are a UDP proxy's counters.
type UDPStats struct {
	Flows   uint64 `json:"flows"` // clients seen, since start
	Active  int    `json:"active"`
	Refused uint64 `json:"refused"` // flows over the limit, or an upstream that could not be reached
	Up      uint64 `json:"datagrams_up"`
	Down    uint64 `json:"datagrams_down"`
	Kernel  uint64 `json:"datagrams_kernel"` // of those, moved by the kernel
	Dropped uint64 `json:"datagrams_dropped"`
	// UpstreamRefused counts flows whose upstream refused a datagram
	// (ICMP port unreachable); each such flow is closed, and reopened on
	// the next upstream with what it had sent if it had no answer yet.
	UpstreamRefused uint64 `json:"upstream_refused"`
}

// udpRefusedCooldown is how long an upstream that refused a datagram is
// tried last by new flows.
const udpRefusedCooldown = 10 * time.Second

// maxReplay bounds what a flow keeps of the datagrams it sent before its
// upstream answered, to send again to the next upstream if that one refuses.
const maxReplay = 64 << 10

// UDPProxy relays UDP flows.
type UDPProxy struct {
	cfg     Config
	idle    time.Duration
	ln      *net.UDPConn
	netns   int // the listener's network namespace: client sockets are made there
	splicer *splice.UDPSplicer
	ups     *pool
	log     func(format string, args ...any)

	mu    sync.Mutex
	flows map[netip.AddrPort]*udpFlow
	wg    sync.WaitGroup

	seen, refused           atomic.Uint64
	up, down, kernel, drops atomic.Uint64 // of flows that ended
	upRefused               atomic.Uint64
}

type udpFlow struct {
	client      netip.AddrPort
	local       netip.Addr // the address the client sent to: the front socket answers from it
	upstream    netip.AddrPort
	tries       int // upstreams this client's flows have tried in a row, this one included
	front, back *net.UDPConn
	pair        *splice.UDPPair // Kernel mode
	// Datagrams relayed in user space: by the loop before the join, and
	// by the goroutines in Copy mode.
	up, down  atomic.Uint64
	lastCount uint64
	lastMove  time.Time
	settled   chan struct{} // closed once settle has started the flow (or given up)
	closed    sync.Once
	done      chan struct{} // closed when the flow ends
	refused   sync.Once

	mu     sync.Mutex
	sent   [][]byte // what user space sent upstream before an answer (up to maxReplay)
	nbytes int
}

// remember keeps a datagram sent upstream while nothing came back, to send
// it again to another upstream if this one refuses.
func (f *udpFlow) remember(b []byte) {
	if f.down.Load() > 0 {
		return
	}
	f.mu.Lock()
	defer f.mu.Unlock()
	if f.nbytes+len(b) <= maxReplay {
		f.sent = append(f.sent, append([]byte(nil), b...))
		f.nbytes += len(b)
	}
}

// NewUDP checks cfg and listens on its UDP address. idle 0 means
// DefaultUDPIdle.
func NewUDP(cfg Config, idle time.Duration, logf func(format string, args ...any)) (*UDPProxy, error) {
	if err := cfg.check(); err != nil {
		return nil, err
	}
	switch {
	case len(cfg.Routes) > 0:
		return nil, errors.New("UDP has no Host header to route on: drop the routes")
	case cfg.Proxy != NoProxyProtocol:
		return nil, errors.New("a PROXY protocol header is for TCP streams: use none with UDP")
	case cfg.Mode == Pipe:
		return nil, errors.New("splice(2) moves stream bytes: use kernel or copy mode with UDP")
	}
	if idle == 0 {
		idle = DefaultUDPIdle
	}
	if logf == nil {
		logf = func(string, ...any) {}
	}
	p := &UDPProxy{cfg: cfg, idle: idle, ups: &pool{ups: cfg.Upstreams}, log: logf, netns: -1, flows: map[netip.AddrPort]*udpFlow{}}
	var err error
	if p.netns, err = unix.Open("/proc/thread-self/ns/net", unix.O_RDONLY|unix.O_CLOEXEC, 0); err != nil {
		return nil, err
	}
	lc := net.ListenConfig{Control: func(_, _ string, c syscall.RawConn) error { return reuseAddr(c) }}
	l, err := lc.ListenPacket(context.Background(), "udp", cfg.Listen.String())
	if err != nil {
		unix.Close(p.netns)
		return nil, fmt.Errorf("listen on udp %s: %w", cfg.Listen, err)
	}
	p.ln = l.(*net.UDPConn)
	if cfg.Listen.Addr().IsUnspecified() {
		if err := askDestination(p.ln); err != nil {
			p.ln.Close()
			unix.Close(p.netns)
			return nil, fmt.Errorf("listen on udp %s: ask for each datagram's destination: %w", cfg.Listen, err)
		}
	}
	if cfg.Mode == Kernel {
		if p.splicer, err = splice.NewUDP(splice.UDPOptions{MaxQueue: cfg.MaxInflight, MaxPairs: cfg.MaxConns}); err != nil {
			p.ln.Close()
			unix.Close(p.netns)
			return nil, err
		}
	}
	return p, nil
}

// reuseAddr lets the flows' client sockets bind the listener's address.
// Not SO_REUSEPORT: it is not needed for that, and it would let any process
// of the same user bind the port too and take a share of new clients.
func reuseAddr(c syscall.RawConn) error {
	var serr error
	err := c.Control(func(fd uintptr) {
		serr = unix.SetsockoptInt(int(fd), unix.SOL_SOCKET, unix.SO_REUSEADDR, 1)
	})
	return errors.Join(err, serr)
}

// askDestination makes a wildcard listener report each datagram's
// destination address (IP_PKTINFO), so a flow can answer its client from the
// address the client sent to, whatever address routing would pick.
func askDestination(ln *net.UDPConn) error {
	raw, err := ln.SyscallConn()
	if err != nil {
		return err
	}
	var serr error
	err = raw.Control(func(fd uintptr) {
		if ln.LocalAddr().(*net.UDPAddr).IP.To4() != nil {
			serr = unix.SetsockoptInt(int(fd), unix.IPPROTO_IP, unix.IP_PKTINFO, 1)
			return
		}
		serr = unix.SetsockoptInt(int(fd), unix.IPPROTO_IPV6, unix.IPV6_RECVPKTINFO, 1)
		if serr == nil { // IPv4 clients of a dual-stack socket
			serr = unix.SetsockoptInt(int(fd), unix.IPPROTO_IP, unix.IP_PKTINFO, 1)
		}
	})
	return errors.Join(err, serr)
}

// destination reads the address a datagram was sent to from its control
// messages (invalid if there is none).
func destination(oob []byte) netip.Addr {
	msgs, err := unix.ParseSocketControlMessage(oob)
	if err != nil {
		return netip.Addr{}
	}
	for _, m := range msgs {
		switch {
		case m.Header.Level == unix.IPPROTO_IP && m.Header.Type == unix.IP_PKTINFO && len(m.Data) >= unix.SizeofInet4Pktinfo:
			var a [4]byte
			copy(a[:], m.Data[8:12]) // struct in_pktinfo: ifindex, spec_dst, addr
			return netip.AddrFrom4(a)
		case m.Header.Level == unix.IPPROTO_IPV6 && m.Header.Type == unix.IPV6_PKTINFO && len(m.Data) >= unix.SizeofInet6Pktinfo:
			var a [16]byte
			copy(a[:], m.Data[:16]) // struct in6_pktinfo: addr, ifindex
			return netip.AddrFrom16(a).Unmap()
		}
	}
	return netip.Addr{}
}

// Addr is the address the proxy listens on.
func (p *UDPProxy) Addr() netip.AddrPort { return p.ln.LocalAddr().(*net.UDPAddr).AddrPort() }

// Run relays until ctx is done, then closes every flow.
func (p *UDPProxy) Run(ctx context.Context) error {
	stop := context.AfterFunc(ctx, func() { p.ln.Close() })
	defer stop()
	p.wg.Add(1)
	go p.reapIdle(ctx)
	buf := make([]byte, 1<<16)
	oob := make([]byte, 128)
	listening := p.Addr().Addr()
	for {
		n, oobn, _, from, err := p.ln.ReadMsgUDPAddrPort(buf, oob)
		if err != nil {
			if ctx.Err() != nil || errors.Is(err, net.ErrClosed) {
				return nil
			}
			return err
		}
		local := listening
		if local.IsUnspecified() {
			if to := destination(oob[:oobn]); to.IsValid() && !to.IsMulticast() {
				local = to
			}
		}
		p.dispatch(from, local, buf[:n], 0)
	}
}

// dispatch sends a datagram that reached the listener (sent to local) on to
// its client's flow, opening the flow if it is the client's first. tried is
// how many upstreams refused this client just before (0 for a new client).
func (p *UDPProxy) dispatch(from netip.AddrPort, local netip.Addr, b []byte, tried int) {
	from = netip.AddrPortFrom(from.Addr().Unmap(), from.Port())
	p.mu.Lock()
	f := p.flows[from]
	full := len(p.flows) >= p.cfg.MaxConns
	p.mu.Unlock()
	if f != nil {
		if _, err := f.back.Write(b); err == nil {
			f.up.Add(1)
			f.remember(b)
		}
		return
	}
	if tried == 0 {
		p.seen.Add(1)
	}
	if full {
		p.refused.Add(1)
		p.log("proxy: udp %s: refused, %d flows open (the limit)", from, p.cfg.MaxConns)
		return
	}
	f, err := p.open(from, local, tried+1)
	if err != nil {
		p.refused.Add(1)
		p.log("proxy: udp %s: %v", from, err)
		return
	}
	if _, err := f.back.Write(b); err == nil {
		f.up.Add(1)
		f.remember(b)
	}
	p.wg.Add(1)
	go p.settle(f)
}

// settle hands a new flow's client socket its strays and starts the flow.
// Between bind and connect the socket matched any sender, so it may hold
// other clients' datagrams (TestUDPProxy saw a client answered for
// another), and a datagram looked up then may be queued on it even after
// connect returned. Every receive looks its socket up and queues the
// datagram within one RCU read-side section, so once a grace period has
// passed (membarrier waits for one) the strays are all queued: take them
// and send each on by its source. From then on the socket gets only its
// client's datagrams.
func (p *UDPProxy) settle(f *udpFlow) {
	defer p.wg.Done()
	defer close(f.settled)
	if _, _, errno := unix.Syscall(unix.SYS_MEMBARRIER, membarrierCmdGlobal, 0, 0); errno != 0 {
		p.log("proxy: udp %s: membarrier: %v (strays may follow)", f.client, errno)
	}
	for _, d := range drain(f.front) {
		if d.from == f.client {
			if _, err := f.back.Write(d.b); err == nil {
				f.up.Add(1)
				f.remember(d.b)
			}
			continue
		}
		p.dispatch(d.from, f.local, d.b, 0) // it reached the address f is bound to
	}
	if err := p.start(f); err != nil {
		p.log("proxy: udp %s: %v", f.client, err)
		f.closed.Do(func() { p.endFlow(f) }) // not closeFlow: it waits for us
	}
}

// MEMBARRIER_CMD_GLOBAL: returns after an RCU grace period (synchronize_rcu).
const membarrierCmdGlobal = 1

type datagram struct {
	from netip.AddrPort
	b    []byte
}

// drain takes what waits on c without blocking.
func drain(c *net.UDPConn) []datagram {
	var out []datagram
	_, _ = sockutil.DrainUDP(c, func(b []byte, from netip.AddrPort) {
		out = append(out, datagram{from, append([]byte(nil), b...)})
	})
	return out
}

// open makes a flow's two sockets: one bound to the address the client sent
// to (the listener's port) and connected to the client, one connected to the
// next upstream.
func (p *UDPProxy) open(client netip.AddrPort, local netip.Addr, tries int) (*udpFlow, error) {
	f := &udpFlow{client: client, local: local, tries: tries, lastMove: time.Now(),
		settled: make(chan struct{}), done: make(chan struct{})}
	err := host.InNetns(fmt.Sprintf("/proc/self/fd/%d", p.netns), func() (err error) {
		f.front, err = clientSocket(p.Addr(), local, client)
		return err
	})
	if err != nil {
		return nil, fmt.Errorf("client socket: %w", err)
	}
	up := p.ups.order()[0]
	c, err := p.dialUDP(up)
	if err != nil {
		f.front.Close()
		return nil, fmt.Errorf("upstream %s: %w", up, err)
	}
	f.back, f.upstream = c, up
	p.mu.Lock()
	p.flows[client] = f
	p.mu.Unlock()
	return f, nil
}

func (p *UDPProxy) dialUDP(up netip.AddrPort) (*net.UDPConn, error) {
	ctx, cancel := context.WithTimeout(context.Background(), 5*time.Second)
	defer cancel()
	var c net.Conn
	var err error
	if p.cfg.Dial != nil {
		c, err = p.cfg.Dial(ctx, "udp", up.String())
	} else {
		var d net.Dialer
		c, err = d.DialContext(ctx, "udp", up.String())
	}
	if err != nil {
		return nil, err
	}
	uc, ok := c.(*net.UDPConn)
	if !ok {
		c.Close()
		return nil, errors.New("the dialer did not return a UDP socket")
	}
	return uc, nil
}

// clientSocket binds to local and the listener's port (beside the
// listener: SO_REUSEADDR), in the listener's family, and connects to the
// client.
func clientSocket(listener netip.AddrPort, local netip.Addr, client netip.AddrPort) (*net.UDPConn, error) {
	fam := unix.AF_INET6
	if listener.Addr().Is4() {
		fam = unix.AF_INET
	}
	fd, err := unix.Socket(fam, unix.SOCK_DGRAM|unix.SOCK_CLOEXEC, 0)
	if err != nil {
		return nil, err
	}
	sockaddr := func(ap netip.AddrPort) unix.Sockaddr {
		if fam == unix.AF_INET {
			return &unix.SockaddrInet4{Port: int(ap.Port()), Addr: ap.Addr().Unmap().As4()}
		}
		return &unix.SockaddrInet6{Port: int(ap.Port()), Addr: ap.Addr().As16()}
	}
	_ = unix.SetsockoptInt(fd, unix.SOL_SOCKET, unix.SO_REUSEADDR, 1)
	if err := unix.Bind(fd, sockaddr(netip.AddrPortFrom(local, listener.Port()))); err != nil {
		unix.Close(fd)
		return nil, err
	}
	if err := unix.Connect(fd, sockaddr(client)); err != nil {
		unix.Close(fd)
		return nil, err
	}
	f := os.NewFile(uintptr(fd), "udp")
	defer f.Close()
	c, err := net.FileConn(f)
	if err != nil {
		return nil, err
	}
	return c.(*net.UDPConn), nil
}

// start moves the flow's datagrams from now on: joined in the kernel, or by
// two goroutines.
func (p *UDPProxy) start(f *udpFlow) error {
	if p.splicer != nil {
		// The splicer owns what it joins: give it its own descriptors.
		a, err := sockutil.DupUDP(f.front)
		if err != nil {
			return err
		}
		b, err := sockutil.DupUDP(f.back)
		if err != nil {
			a.Close()
			return err
		}
		pair, err := p.splicer.Join(a, b)
		if err != nil {
			a.Close()
			b.Close()
			return err
		}
		p.mu.Lock()
		f.pair = pair
		p.mu.Unlock()
		p.wg.Add(1)
		go func() {
			defer p.wg.Done()
			for {
				select {
				case i := <-pair.Refusals():
					if err := pair.Err(); err != nil {
						// Out of the kernel path for good: no datagram
						// moves; end the flow rather than leave it mute.
						p.log("proxy: udp %s: %v; flow closed", f.client, err)
						p.closeFlow(f)
						return
					}
					if i == 1 { // the upstream socket
						p.upstreamRefused(f)
						return
					}
				case <-f.done:
					return
				}
			}
		}()
		return nil
	}
	relay := func(from, to *net.UDPConn, n *atomic.Uint64, up bool) {
		defer p.wg.Done()
		buf := make([]byte, 1<<16)
		for {
			m, err := from.Read(buf)
			if errors.Is(err, net.ErrClosed) {
				return
			}
			if errors.Is(err, syscall.ECONNREFUSED) && from == f.back {
				p.upstreamRefused(f)
				return
			}
			if err != nil {
				continue // ECONNREFUSED from the client: UDP goes on
			}
			if _, err := to.Write(buf[:m]); err == nil {
				n.Add(1)
				if up {
					f.remember(buf[:m])
				}
			}
		}
	}
	p.wg.Add(2)
	go relay(f.front, f.back, &f.up, true)
	go relay(f.back, f.front, &f.down, false)
	return nil
}

// upstreamRefused ends a flow whose upstream refused a datagram (nobody
// listens there), puts that upstream last for new flows for a while, and,
// if it never answered, sends what the flow had sent to the next upstream,
// until each has been tried once.
func (p *UDPProxy) upstreamRefused(f *udpFlow) {
	f.refused.Do(func() {
		p.upRefused.Add(1)
		p.ups.markDown(f.upstream, udpRefusedCooldown)
		p.mu.Lock()
		_, down, _, _ := f.counts()
		p.mu.Unlock()
		f.mu.Lock()
		replay := f.sent
		f.mu.Unlock()
		p.closeFlow(f)
		if down > 0 || f.tries >= len(p.cfg.Upstreams) {
			p.log("proxy: udp %s: upstream %s refused (port unreachable); flow closed", f.client, f.upstream)
			return
		}
		p.log("proxy: udp %s: upstream %s refused (port unreachable); trying the next one", f.client, f.upstream)
		for _, b := range replay {
			p.dispatch(f.client, f.local, b, f.tries)
		}
	})
}

// counts is a flow's datagrams each way, and of them the kernel's, and
// what the kernel dropped. The caller holds p.mu (f.pair is set under it).
func (f *udpFlow) counts() (up, down, kernel, dropped uint64) {
	up, down = f.up.Load(), f.down.Load()
	if f.pair != nil {
		ab, ba := f.pair.Stats()
		up += ab.Datagrams + ab.Copied
		down += ba.Datagrams + ba.Copied
		kernel = ab.Datagrams + ba.Datagrams
		dropped = ab.Dropped + ba.Dropped
	}
	return
}

// closeFlow ends a flow and adds its counts to the totals, once. It waits
// until the flow has started: a pair joined after the count would be
// missed, and would outlive the flow.
func (p *UDPProxy) closeFlow(f *udpFlow) {
	<-f.settled
	f.closed.Do(func() { p.endFlow(f) })
}

func (p *UDPProxy) endFlow(f *udpFlow) {
	p.mu.Lock()
	if p.flows[f.client] == f {
		delete(p.flows, f.client)
	}
	up, down, kernel, dropped := f.counts()
	pair := f.pair
	p.mu.Unlock()
	p.up.Add(up)
	p.down.Add(down)
	p.kernel.Add(kernel)
	p.drops.Add(dropped)
	if pair != nil {
		pair.Close()
	}
	f.front.Close()
	f.back.Close()
	close(f.done)
}

// reapIdle closes flows that carried nothing for the idle time.
func (p *UDPProxy) reapIdle(ctx context.Context) {
	defer p.wg.Done()
	tick := time.NewTicker(max(p.idle/4, 10*time.Millisecond))
	defer tick.Stop()
	for {
		select {
		case <-ctx.Done():
			return
		case now := <-tick.C:
			var idle []*udpFlow
			p.mu.Lock()
			for _, f := range p.flows {
				up, down, _, _ := f.counts()
				if c := up + down; c != f.lastCount {
					f.lastCount, f.lastMove = c, now
				} else if now.Sub(f.lastMove) >= p.idle {
					idle = append(idle, f)
				}
			}
			p.mu.Unlock()
			for _, f := range idle {
				p.closeFlow(f)
			}
		}
	}
}

// Stats returns the counters now.
func (p *UDPProxy) Stats() UDPStats {
	st := UDPStats{Flows: p.seen.Load(), Refused: p.refused.Load(), Up: p.up.Load(), Down: p.down.Load(),
		Kernel: p.kernel.Load(), Dropped: p.drops.Load(), UpstreamRefused: p.upRefused.Load()}
	p.mu.Lock()
	defer p.mu.Unlock()
	st.Active = len(p.flows)
	for _, f := range p.flows {
		up, down, kernel, dropped := f.counts()
		st.Up, st.Down, st.Kernel, st.Dropped = st.Up+up, st.Down+down, st.Kernel+kernel, st.Dropped+dropped
	}
	return st
}

// MapEntries counts the kernel mode's map entries (what a leak would show).
func (p *UDPProxy) MapEntries() (socks, cookies int, err error) {
	if p.splicer == nil {
		return 0, 0, nil
	}
	return p.splicer.MapEntries()
}

// Close ends every flow and the listener. Call it after Run returned.
func (p *UDPProxy) Close() error {
	p.ln.Close()
	p.mu.Lock()
	flows := make([]*udpFlow, 0, len(p.flows))
	for _, f := range p.flows {
		flows = append(flows, f)
	}
	p.mu.Unlock()
	for _, f := range flows {
		p.closeFlow(f)
	}
	p.wg.Wait()
	var err error
	if p.splicer != nil {
		err = p.splicer.Close()
	}
	unix.Close(p.netns)
	return err
}
