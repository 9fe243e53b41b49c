// Package proxy is a TCP proxy that picks an upstream for each connection
// (round robin, or by the Host header of the first HTTP request), optionally
// announces the client with a PROXY protocol header, and then moves the
// connection's bytes in one of three ways: joined in the kernel (package
// splice), through a user-space buffer, or through splice(2) pipes.
package proxy

import (
	"context"
	"errors"
	"fmt"
	"io"
	"net"
	"net/netip"
	"sync"
	"sync/atomic"
	"time"

	"github.com/shunt-project/shunt/bypass"
	"github.com/shunt-project/shunt/splice"
)

// Stats are a proxy's counters.
type Stats struct {
	Accepted uint64 `json:"accepted"`
	Active   int64  `json:"active"`
	Refused  uint64 `json:"refused"`         // no upstream would take the connection
	Failed   uint64 `json:"failed"`          // ended by a reset or an error
	Up       uint64 `json:"bytes_up"`        // client to upstream, ended connections
	Down     uint64 `json:"bytes_down"`      // upstream to client, ended connections
	Kernel   uint64 `json:"bytes_kernel"`    // of those, moved by the kernel
	PassedBy uint64 `json:"bytes_passed_by"` // of those, sent straight between client and upstream (Config.Shortcuts)
	// Kernel mode with Shortcuts: connections whose legs bypass paired,
	// so that their peers could pass the join by.
	ShortcutConns uint64 `json:"connections_shortcut"`
	// Kernel mode: directions of open connections the kernel forwards
	// now, and times flow control gave a direction to user space (ended
	// connections).
	InKernel  int    `json:"directions_in_kernel"`
	Throttled uint64 `json:"throttled"`
}

// Proxy accepts connections and relays them.
type Proxy struct {
	cfg      Config
	ln       *net.TCPListener
	splicer  *splice.Splicer
	defaults *pool
	routes   map[string]*pool
	log      func(format string, args ...any)

	wg    sync.WaitGroup
	slots chan struct{}
	// life ends at Close: a dial in progress gives up.
	life    context.Context
	endLife context.CancelFunc

	mu        sync.Mutex
	closing   bool                      // Close began: a handler holds no new connection
	conns     map[*net.TCPConn]struct{} // what handlers hold (in Kernel mode until the join), for Close
	accepted  atomic.Uint64
	active    atomic.Int64
	refused   atomic.Uint64
	failed    atomic.Uint64
	up        atomic.Uint64
	down      atomic.Uint64
	kernel    atomic.Uint64
	throttle  atomic.Uint64
	passedBy  atomic.Uint64
	shortcuts atomic.Uint64
}

// New checks cfg, loads the kernel programs (Kernel mode) and listens.
// logf receives one line per event worth a log line (nil: none).
func New(cfg Config, logf func(format string, args ...any)) (*Proxy, error) {
	if err := cfg.check(); err != nil {
		return nil, err
	}
	if logf == nil {
		logf = func(string, ...any) {}
	}
	p := &Proxy{
		cfg:      cfg,
		defaults: &pool{ups: cfg.Upstreams},
		routes:   map[string]*pool{},
		log:      logf,
		slots:    make(chan struct{}, cfg.MaxConns),
		conns:    map[*net.TCPConn]struct{}{},
	}
	p.life, p.endLife = context.WithCancel(context.Background())
	for _, r := range cfg.Routes {
		p.routes[r.Host] = &pool{ups: r.Upstreams}
	}
	if cfg.Mode == Kernel {
		s, err := splice.New(splice.Options{MaxInflight: cfg.MaxInflight, MaxPairs: cfg.MaxConns})
		if err != nil {
			return nil, err
		}
		p.splicer = s
	}
	// Go listens with MPTCP by default; an MPTCP socket cannot join a
	// sockmap, so kernel mode takes plain TCP only.
	var lc net.ListenConfig
	lc.SetMultipathTCP(cfg.Mode != Kernel)
	l, err := lc.Listen(context.Background(), "tcp", cfg.Listen.String())
	if err != nil {
		if p.splicer != nil {
			p.splicer.Close()
		}
		p.endLife()
		return nil, fmt.Errorf("listen on %s: %w", cfg.Listen, err)
	}
	p.ln = l.(*net.TCPListener)
	return p, nil
}

// Addr is the address the proxy listens on.
func (p *Proxy) Addr() netip.AddrPort { return p.ln.Addr().(*net.TCPAddr).AddrPort() }

// Stats returns the counters now.
func (p *Proxy) Stats() Stats {
	st := Stats{
		Accepted: p.accepted.Load(), Active: p.active.Load(), Refused: p.refused.Load(),
		Failed: p.failed.Load(), Up: p.up.Load(), Down: p.down.Load(), Kernel: p.kernel.Load(),
		PassedBy: p.passedBy.Load(), ShortcutConns: p.shortcuts.Load(),
		Throttled: p.throttle.Load(),
	}
	if p.splicer != nil {
		st.InKernel = p.splicer.DirectionsInKernel()
	}
	return st
}

// Run accepts connections until ctx is done or the listener fails. It then
// stops accepting; connections keep going until Close.
func (p *Proxy) Run(ctx context.Context) error {
	stop := context.AfterFunc(ctx, func() { p.ln.Close() })
	defer stop()
	for {
		c, err := p.ln.AcceptTCP()
		if err != nil {
			if ctx.Err() != nil {
				return nil
			}
			var ne net.Error
			if errors.As(err, &ne) && ne.Timeout() {
				continue
			}
			if errors.Is(err, net.ErrClosed) {
				return nil
			}
			// EMFILE and friends: wait a little rather than spin.
			p.log("proxy: accept: %v", err)
			time.Sleep(10 * time.Millisecond)
			continue
		}
		p.accepted.Add(1)
		select {
		case p.slots <- struct{}{}:
		default:
			p.log("proxy: %s: refused, %d connections open (the limit)", c.RemoteAddr(), p.cfg.MaxConns)
			p.refused.Add(1)
			c.Close()
			continue
		}
		p.active.Add(1)
		p.wg.Add(1)
		go func() {
			defer func() { <-p.slots; p.active.Add(-1); p.wg.Done() }()
			p.handle(c)
		}()
	}
}

// Close stops accepting, resets every open connection (also those whose
// handler still reads the request head or dials), unloads the kernel
// programs and returns once every handler has.
func (p *Proxy) Close() error {
	p.ln.Close()
	p.endLife()
	var err error
	if p.splicer != nil {
		err = p.splicer.Close()
	}
	p.mu.Lock()
	p.closing = true
	for c := range p.conns {
		_ = c.SetLinger(0)
		c.Close()
	}
	p.mu.Unlock()
	p.wg.Wait()
	return err
}

// handle serves one client connection to its end.
func (p *Proxy) handle(client *net.TCPConn) {
	if !p.hold(client) {
		abort(client)
		return
	}
	defer p.release(client)
	peer := client.RemoteAddr().(*net.TCPAddr).AddrPort()
	var head []byte
	ups := p.defaults
	if len(p.routes) > 0 {
		var err error
		head, err = readHead(client, p.cfg.HeadTimeout)
		if err != nil && len(head) == 0 {
			if !errors.Is(err, io.EOF) {
				p.log("proxy: %s: no request: %v", peer, err)
			}
			client.Close()
			return
		}
		if r, ok := p.routes[hostOf(head)]; ok {
			ups = r
		}
	}
	upstream, err := p.dial(ups)
	if err != nil {
		p.log("proxy: %s: %v", peer, err)
		p.refused.Add(1)
		abort(client)
		return
	}
	if !p.hold(upstream) {
		abort(client, upstream)
		return
	}
	defer p.release(upstream)
	first := head
	if p.cfg.Proxy != NoProxyProtocol {
		local := client.LocalAddr().(*net.TCPAddr).AddrPort()
		first = append(proxyHeader(p.cfg.Proxy, peer, local), head...)
	}
	if len(first) > 0 {
		if _, err := upstream.Write(first); err != nil {
			p.log("proxy: %s: write to upstream %s: %v", peer, upstream.RemoteAddr(), err)
			p.failed.Add(1)
			abort(client, upstream)
			return
		}
	}
	p.up.Add(uint64(len(head)))

	var r result
	if p.cfg.Mode == Kernel {
		r = p.joinInKernel(client, upstream, uint32(len(first)-len(head)))
	} else {
		r = relay(client, upstream, p.cfg.Mode == Pipe)
	}
	p.up.Add(r.up)
	p.down.Add(r.down)
	p.kernel.Add(r.kernel)
	p.passedBy.Add(r.passedBy)
	p.throttle.Add(r.throttled)
	if r.err != nil {
		p.failed.Add(1)
		p.log("proxy: %s: %v", peer, r.err)
	}
}

// joinInKernel joins the two connections; added is what the proxy wrote to
// the upstream that the client did not send (a PROXY header).
func (p *Proxy) joinInKernel(client, upstream *net.TCPConn, added uint32) result {
	pair, err := p.splicer.Join(client, upstream)
	if err != nil {
		abort(client, upstream)
		return result{err: err}
	}
	sc := p.shortcut(client, upstream, added)
	// The splicer has them now: Close ends the pair by closing it.
	p.release(client)
	p.release(upstream)
	<-pair.Done()
	up, down := pair.Stats()
	r := result{up: up.Bytes, down: down.Bytes, kernel: up.Kernel + down.Kernel,
		throttled: uint64(up.ToUser) + uint64(down.ToUser), err: pair.Err()}
	if sc != nil {
		if err := sc.Close(); err != nil {
			p.log("proxy: %s: %v", client.RemoteAddr(), err)
		}
		ab, ba, _, _ := sc.Bytes() // Close said what it could not read
		r.up += ab
		r.down += ba
		r.kernel += ab + ba
		r.passedBy = ab + ba
	}
	return r
}

// shortcut lets the peers of a joined pair pass it by where bypass paired
// both legs; nil where it did not (or Shortcuts is off).
func (p *Proxy) shortcut(client, upstream *net.TCPConn, added uint32) *bypass.Shortcut {
	if p.cfg.Shortcuts == nil {
		return nil
	}
	sc, err := p.cfg.Shortcuts.NewShortcut(client, upstream, added)
	if err != nil {
		if !errors.Is(err, bypass.ErrNotHeld) && !errors.Is(err, net.ErrClosed) {
			p.log("proxy: %s: no shortcut: %v", client.RemoteAddr(), err)
		}
		return nil
	}
	p.shortcuts.Add(1)
	return sc
}

// hold registers a connection a handler works on, so Close can reset it;
// false once Close began (the handler then resets it itself).
func (p *Proxy) hold(c *net.TCPConn) bool {
	p.mu.Lock()
	defer p.mu.Unlock()
	if p.closing {
		return false
	}
	p.conns[c] = struct{}{}
	return true
}

func (p *Proxy) release(c *net.TCPConn) {
	p.mu.Lock()
	delete(p.conns, c)
	p.mu.Unlock()
}

// dial connects to the first upstream of ups (in round-robin order) that
// accepts.
func (p *Proxy) dial(ups *pool) (*net.TCPConn, error) {
	var errs []error
	for _, u := range ups.order() {
		ctx, cancel := context.WithTimeout(p.life, p.cfg.DialTimeout)
		c, err := p.cfg.Dial(ctx, "tcp", u.String())
		cancel()
		if err != nil {
			errs = append(errs, err)
			if p.life.Err() != nil {
				break // closing
			}
			continue
		}
		tc, ok := c.(*net.TCPConn)
		if !ok {
			// Config.Dial may return any net.Conn; the relay and the
			// kernel join need a TCP socket.
			c.Close()
			errs = append(errs, fmt.Errorf("%s: Config.Dial returned a %T, not a *net.TCPConn", u, c))
			continue
		}
		return tc, nil
	}
	return nil, fmt.Errorf("no upstream accepted the connection: %w", errors.Join(errs...))
}

// abort aborts the connections (RST, not FIN).
func abort(conns ...*net.TCPConn) {
	for _, c := range conns {
		_ = c.SetLinger(0)
		c.Close()
	}
}

// MapEntries counts the kernel map entries of Kernel mode (0 otherwise).
func (p *Proxy) MapEntries() (socks, cookies int, err error) {
	if p.splicer == nil {
		return 0, 0, nil
	}
	return p.splicer.MapEntries()
}
