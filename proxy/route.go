package proxy

import (
	"bytes"
	"net"
	"net/netip"
	"strings"
	"sync"
	"sync/atomic"
	"time"
)

// pool is a round-robin list of upstreams.
type pool struct {
	ups  []netip.AddrPort
	next atomic.Uint64

	mu   sync.Mutex
	down map[netip.AddrPort]time.Time // refused lately: tried last until then
}

// order returns every upstream, starting at the next in turn, so a caller
// can fall through to the others when one refuses. Upstreams marked down
// come last.
func (p *pool) order() []netip.AddrPort {
	start := int(p.next.Add(1)-1) % len(p.ups)
	out := make([]netip.AddrPort, 0, len(p.ups))
	var down []netip.AddrPort
	now := time.Now()
	p.mu.Lock()
	for i := range p.ups {
		u := p.ups[(start+i)%len(p.ups)]
		if until, ok := p.down[u]; ok && now.Before(until) {
			down = append(down, u)
			continue
		}
		out = append(out, u)
	}
	p.mu.Unlock()
	return append(out, down...)
}

// markDown puts u last in the order for d.
func (p *pool) markDown(u netip.AddrPort, d time.Duration) {
	p.mu.Lock()
	defer p.mu.Unlock()
	if p.down == nil {
		p.down = map[netip.AddrPort]time.Time{}
	}
	p.down[u] = time.Now().Add(d)
}

// readHead reads what the client sends first, up to the end of an HTTP
// request head, maxHead bytes, or the timeout. What it returns is forwarded
// to the upstream before anything else.
func readHead(c *net.TCPConn, timeout time.Duration) ([]byte, error) {
	buf := make([]byte, 0, 1024)
	c.SetReadDeadline(time.Now().Add(timeout))
	defer c.SetReadDeadline(time.Time{})
	for len(buf) < maxHead {
		if len(buf) == cap(buf) {
			buf = append(buf, 0)[:len(buf)]
		}
		n, err := c.Read(buf[len(buf):min(cap(buf), maxHead)])
		buf = buf[:len(buf)+n]
		if bytes.Contains(buf, []byte("\r\n\r\n")) || !looksLikeHTTP(buf) {
			return buf, nil
		}
		if err != nil {
			return buf, err
		}
	}
	return buf, nil
}

// looksLikeHTTP says whether b may still be the start of an HTTP/1 request.
func looksLikeHTTP(b []byte) bool {
	for i, ch := range b {
		if ch == ' ' {
			return i > 0
		}
		if ch < 'A' || ch > 'Z' {
			return false
		}
	}
	return true
}

// hostOf returns the lower-case Host header of an HTTP/1 request head, port
// removed, or "".
func hostOf(head []byte) string {
	end := bytes.Index(head, []byte("\r\n\r\n"))
	if end < 0 || !looksLikeHTTP(head) {
		return ""
	}
	lines := strings.Split(string(head[:end]), "\r\n")
	for _, l := range lines[1:] {
		name, value, ok := strings.Cut(l, ":")
		if !ok || !strings.EqualFold(strings.TrimSpace(name), "host") {
			continue
		}
		h := strings.ToLower(strings.TrimSpace(value))
		if host, _, err := net.SplitHostPort(h); err == nil {
			return strings.Trim(host, "[]")
		}
		return strings.Trim(h, "[]")
	}
	return ""
}
