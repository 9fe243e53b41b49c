package daemon

import (
	"cmp"
	"context"
	"encoding/json"
	"errors"
	"fmt"
	"net"
	"os"
	"path/filepath"
	"slices"
	"sync"
	"sync/atomic"
	"time"

	"golang.org/x/sys/unix"

	"github.com/shunt-project/shunt/internal/runlock"
	"github.com/shunt-project/shunt/splice"
)

// Server accepts hand-overs on a unix socket and joins them.
type Server struct {
	ln   *net.UnixListener
	path string
	s    *splice.Splicer
	u    *splice.UDPSplicer
	log  func(format string, args ...any)

	mu         sync.Mutex
	next       uint64
	pairs      map[uint64]*entry
	closed     bool // Close began: a client accepted since is not served
	handedOver bool
	handed     int // pairs handed over
	joined     uint64
	ended      Totals // pairs that ended, for Totals
	conns      map[*conn]struct{}
	wg         sync.WaitGroup
}

type entry struct {
	index  uint32 // the pair's index in its Splicer
	info   PairInfo
	pair   *splice.Pair    // a TCP pair, or
	udp    *splice.UDPPair // a UDP pair
	owner  *conn           // nil once the client that joined it left
	closed atomic.Bool     // a client asked to close it
}

// Listen creates the control socket at path (its directory too), readable
// and writable by root only, and loads the splice program.
func Listen(path string, opts splice.Options, logf func(format string, args ...any)) (*Server, error) {
	if c, err := net.Dial("unixpacket", path); err == nil {
		c.Close()
		return nil, fmt.Errorf("another daemon is listening on %s (to replace it without dropping its pairs, use --take-over)", path)
	}
	s, err := splice.New(opts)
	if err != nil {
		return nil, err
	}
	u, err := splice.NewUDP(udpOptions(opts))
	if err != nil {
		s.Close()
		return nil, err
	}
	srv := newServer(path, s, u, logf)
	if err := srv.listen(); err != nil {
		s.Close()
		u.Close()
		return nil, err
	}
	return srv, nil
}

// udpOptions: the daemon's bound on bytes in flight bounds a UDP pair's
// queue too.
func udpOptions(opts splice.Options) splice.UDPOptions {
	return splice.UDPOptions{MaxQueue: opts.MaxInflight, MaxPairs: opts.MaxPairs}
}

func newServer(path string, s *splice.Splicer, u *splice.UDPSplicer, logf func(format string, args ...any)) *Server {
	if logf == nil {
		logf = func(string, ...any) {}
	}
	return &Server{path: path, s: s, u: u, log: logf, pairs: map[uint64]*entry{}, conns: map[*conn]struct{}{}}
}

// listen binds the control socket, replacing a stale file.
func (srv *Server) listen() error {
	err := runlock.InDir(filepath.Dir(srv.path), 0o755, func() error {
		os.Remove(srv.path) // left by a daemon that died, or one that handed over
		old := unix.Umask(0o177)
		defer unix.Umask(old)
		ln, err := net.ListenUnix("unixpacket", &net.UnixAddr{Name: srv.path, Net: "unixpacket"})
		srv.ln = ln
		return err
	})
	if err != nil {
		return fmt.Errorf("listen on %s: %w", srv.path, err)
	}
	return nil
}

// Serve answers clients until ctx is done.
func (srv *Server) Serve(ctx context.Context) error {
	stop := context.AfterFunc(ctx, func() { srv.ln.Close() })
	defer stop()
	for {
		c, err := srv.ln.AcceptUnix()
		if err != nil {
			if ctx.Err() != nil || errors.Is(err, net.ErrClosed) {
				return nil
			}
			return err
		}
		srv.serve(&conn{c: c, done: make(chan struct{})})
	}
}

// serve registers a client and answers it on a goroutine of its own.
func (srv *Server) serve(cc *conn) {
	cc.log = srv.log // clients taken over from another daemon come without
	srv.mu.Lock()
	if srv.closed {
		srv.mu.Unlock()
		cc.c.Close()
		return
	}
	srv.conns[cc] = struct{}{}
	srv.mu.Unlock()
	srv.wg.Add(1)
	go func() {
		defer srv.wg.Done()
		srv.serveConn(cc)
	}()
}

// Close stops listening, resets every joined pair and removes the socket.
// After a hand-over it only lets go: the pairs live on in the new daemon.
func (srv *Server) Close() error {
	srv.ln.Close()
	srv.mu.Lock()
	srv.closed = true
	handedOver := srv.handedOver
	for c := range srv.conns {
		c.c.Close() // ends serveConn
	}
	srv.mu.Unlock()
	err := errors.Join(srv.s.Close(), srv.u.Close()) // nothing to reset after a hand-over
	srv.wg.Wait()
	if !handedOver {
		os.Remove(srv.path)
	}
	return err
}

// HandedOver says whether Serve ended because another daemon took over,
// and how many pairs went to it.
func (srv *Server) HandedOver() (int, bool) {
	srv.mu.Lock()
	defer srv.mu.Unlock()
	return srv.handed, srv.handedOver
}

// conn is one client; writes are serialized (replies and events).
type conn struct {
	c    *net.UnixConn
	mu   sync.Mutex
	done chan struct{} // closed when serveConn returns
	// handed: the client goes to the daemon taking over; serveConn
	// stops reading and leaves the connection open (guarded by srv.mu).
	handed bool
	log    func(format string, args ...any)
}

// send writes a reply or an event; one that cannot be made or written (the
// client gone, or not reading for 5 s) is logged, and the client misses it.
func (c *conn) send(v any) {
	b, err := json.Marshal(v)
	if err != nil {
		c.log("daemon: encode a message for a client: %v", err)
		return
	}
	c.mu.Lock()
	defer c.mu.Unlock()
	c.c.SetWriteDeadline(time.Now().Add(5 * time.Second))
	if _, err := c.c.Write(b); err != nil && !errors.Is(err, net.ErrClosed) {
		c.log("daemon: write to a client: %v", err)
	}
}

func (srv *Server) serveConn(c *conn) {
	defer func() {
		srv.mu.Lock()
		delete(srv.conns, c)
		if !c.handed {
			c.c.Close()
			for _, e := range srv.pairs {
				if e.owner == c {
					e.owner = nil
				}
			}
		}
		srv.mu.Unlock()
		close(c.done)
	}()
	if err := rootPeer(c.c); err != nil {
		c.send(Reply{Error: err.Error()})
		return
	}
	buf := make([]byte, maxMessage)
	oob := make([]byte, unix.CmsgSpace(2*4))
	for {
		n, oobn, flags, _, err := c.c.ReadMsgUnix(buf, oob)
		if err != nil || n == 0 {
			return
		}
		fds, ferr := receivedFDs(oob[:oobn], flags)
		if req, ok := handoverRequest(buf[:n]); ok && len(fds) == 0 {
			if err := srv.handOver(c, req); err != nil {
				srv.log("daemon: hand-over failed: %v", err)
			}
			return // the taker's connection serves nothing else
		}
		c.send(srv.handle(c, buf[:n], fds, ferr))
	}
}

// rootPeer admits root only (the socket file is root's already).
func rootPeer(c *net.UnixConn) error {
	raw, err := c.SyscallConn()
	if err != nil {
		return err
	}
	var cred *unix.Ucred
	cerr := errors.New("connection closed")
	if err := raw.Control(func(fd uintptr) { cred, cerr = unix.GetsockoptUcred(int(fd), unix.SOL_SOCKET, unix.SO_PEERCRED) }); err != nil {
		return err // closed by Close meanwhile
	}
	if cerr != nil {
		return cerr
	}
	if cred.Uid != 0 {
		return fmt.Errorf("permission denied: uid %d is not root", cred.Uid)
	}
	return nil
}

// receivedFDs returns the descriptors that came with a message.
func receivedFDs(oob []byte, flags int) ([]int, error) {
	var fds []int
	msgs, err := unix.ParseSocketControlMessage(oob)
	if err != nil {
		return nil, err
	}
	for _, m := range msgs {
		got, err := unix.ParseUnixRights(&m)
		if err != nil {
			return fds, err
		}
		fds = append(fds, got...)
	}
	if flags&unix.MSG_CTRUNC != 0 {
		return fds, errors.New("more than two descriptors sent")
	}
	return fds, nil
}

func (srv *Server) handle(c *conn, b []byte, fds []int, ferr error) Reply {
	closeAll := func() {
		for _, fd := range fds {
			unix.Close(fd)
		}
	}
	var req Request
	if err := json.Unmarshal(b, &req); err != nil {
		closeAll()
		return Reply{Error: "request is not JSON: " + err.Error()}
	}
	if req.Op != "join" && len(fds) > 0 {
		closeAll()
		return Reply{Error: fmt.Sprintf("op %q takes no descriptors", req.Op)}
	}
	switch req.Op {
	case "join":
		if ferr != nil || len(fds) != 2 {
			closeAll()
			return Reply{Error: fmt.Sprintf("join needs exactly two descriptors, got %d", len(fds))}
		}
		h, err := srv.join(c, fds[0], fds[1])
		if err != nil {
			return Reply{Error: err.Error()}
		}
		return Reply{OK: true, Handle: h}
	case "stats":
		return Reply{OK: true, Pairs: srv.Stats()}
	case "close":
		srv.mu.Lock()
		e := srv.pairs[req.Handle]
		srv.mu.Unlock()
		if e == nil {
			return Reply{Error: fmt.Sprintf("no pair with handle %d", req.Handle)}
		}
		if e.udp != nil {
			srv.closeUDP(req.Handle, e)
			return Reply{OK: true}
		}
		e.closed.Store(true)
		e.pair.Abort()
		<-e.pair.Done()
		return Reply{OK: true}
	}
	return Reply{Error: fmt.Sprintf("unknown op %q: want join, stats, close or handover", req.Op)}
}

func (srv *Server) join(c *conn, fdA, fdB int) (uint64, error) {
	udpA, udpB := isUDP(fdA), isUDP(fdB)
	if udpA != udpB {
		unix.Close(fdA)
		unix.Close(fdB)
		return 0, errors.New("one UDP socket and one that is not: a pair must be two of a kind")
	}
	if udpA {
		a, b, pair, err := joinFDs(fdA, fdB, splice.UDPConn, srv.u.Join)
		if err != nil {
			return 0, err
		}
		return srv.trackUDP(c, pair, newPairInfo("udp", a, b, true)), nil
	}
	a, b, pair, err := joinFDs(fdA, fdB, splice.Conn, srv.s.Join)
	if err != nil {
		return 0, err
	}
	return srv.track(c, pair, newPairInfo("tcp", a, b, pair.InKernel())), nil
}

// joinFDs wraps two received descriptors as connections and joins them;
// on error it closes whatever it holds.
func joinFDs[C net.Conn, P any](fdA, fdB int, wrap func(int) (C, error), join func(a, b C) (P, error)) (a, b C, pair P, err error) {
	if a, err = wrap(fdA); err != nil {
		unix.Close(fdB)
		return a, b, pair, fmt.Errorf("first descriptor %w", err)
	}
	if b, err = wrap(fdB); err != nil {
		a.Close()
		return a, b, pair, fmt.Errorf("second descriptor %w", err)
	}
	if pair, err = join(a, b); err != nil {
		a.Close()
		b.Close()
	}
	return a, b, pair, err
}

func newPairInfo(proto string, a, b net.Conn, inKernel bool) PairInfo {
	return PairInfo{
		Proto: proto, Since: time.Now(), InKernel: inKernel,
		A: a.LocalAddr().String() + " -> " + a.RemoteAddr().String(),
		B: b.LocalAddr().String() + " -> " + b.RemoteAddr().String(),
	}
}

// track registers a TCP pair (info.Handle 0: a new handle) and reports its
// end to owner.
func (srv *Server) track(owner *conn, pair *splice.Pair, info PairInfo) uint64 {
	e := &entry{pair: pair, owner: owner, info: info, index: pair.Index()}
	h := srv.register(e)
	srv.watch(h, e)
	return h
}

// register gives e its handle (its own if it has one) and lists it.
func (srv *Server) register(e *entry) uint64 {
	srv.mu.Lock()
	defer srv.mu.Unlock()
	if e.info.Handle == 0 {
		srv.next++
		e.info.Handle = srv.next
		srv.joined++
	}
	srv.next = max(srv.next, e.info.Handle)
	srv.pairs[e.info.Handle] = e
	return e.info.Handle
}

// watch waits for a TCP pair to end and reports it to its owner; it stops
// when the pair is frozen for a hand-over.
func (srv *Server) watch(h uint64, e *entry) {
	pair := e.pair
	stopped := pair.Stopped()
	srv.wg.Add(1)
	go func() {
		defer srv.wg.Done()
		select {
		case <-pair.Done():
		case <-stopped:
			return // frozen: handed over, or watched again after a thaw
		}
		ev := Event{Event: "ended", PairInfo: e.current()}
		err := pair.Err()
		if err != nil {
			ev.Error = err.Error()
		}
		srv.mu.Lock()
		delete(srv.pairs, h)
		srv.ended.add(ev.PairInfo, err != nil, e.closed.Load())
		owner := e.owner
		srv.mu.Unlock()
		if owner != nil {
			owner.send(ev)
		}
	}()
}

func (e *entry) current() PairInfo {
	i := e.info
	if e.udp != nil {
		ab, ba := e.udp.Stats()
		i.BytesAB, i.BytesBA, i.Kernel = ab.Bytes, ba.Bytes, ab.Bytes+ba.Bytes
		i.DatagramsAB, i.DatagramsBA = ab.Datagrams+ab.Copied, ba.Datagrams+ba.Copied
		i.DroppedAB, i.DroppedBA = ab.Dropped, ba.Dropped
		return i
	}
	ab, ba := e.pair.Stats()
	i.BytesAB, i.BytesBA, i.Kernel = ab.Bytes, ba.Bytes, ab.Kernel+ba.Kernel
	return i
}

func isUDP(fd int) bool {
	typ, err := unix.GetsockoptInt(fd, unix.SOL_SOCKET, unix.SO_TYPE)
	return err == nil && typ == unix.SOCK_DGRAM
}

// trackUDP registers a UDP pair (info.Handle 0: a new handle). A UDP pair
// has no end of its own: it ends by the close op or with the daemon.
func (srv *Server) trackUDP(owner *conn, pair *splice.UDPPair, info PairInfo) uint64 {
	return srv.register(&entry{udp: pair, owner: owner, info: info, index: pair.Index()})
}

// closeUDP ends a UDP pair and reports it to its owner, as a TCP pair's end
// is reported.
func (srv *Server) closeUDP(h uint64, e *entry) {
	srv.mu.Lock()
	if srv.pairs[h] != e {
		srv.mu.Unlock()
		return // closed meanwhile by another request
	}
	ev := Event{Event: "ended", PairInfo: e.current(), Error: "closed"}
	delete(srv.pairs, h)
	srv.ended.add(ev.PairInfo, false, true)
	owner := e.owner
	srv.mu.Unlock()
	e.udp.Close()
	if owner != nil {
		owner.send(ev)
	}
}

// Totals counts what a daemon has joined since it started, for metrics. A
// daemon that took pairs over counts their bytes from their start, but not
// them as joined.
type Totals struct {
	Joined  uint64 // pairs joined by this daemon, TCP and UDP
	Open    int    // pairs held now
	Ended   uint64 // TCP pairs that ended, UDP pairs closed
	Failed  uint64 // of those, ended by a reset or an error
	Closed  uint64 // of those, closed by a client's request (reset, for TCP)
	Bytes   uint64 // both ways, of ended and open pairs
	Kernel  uint64 // of those, moved by the kernel
	Dropped uint64 // UDP datagrams dropped at the bound
}

func (t *Totals) add(i PairInfo, failed, closed bool) {
	t.Ended++
	if failed {
		t.Failed++
	}
	if closed {
		t.Closed++
	}
	t.Bytes += i.BytesAB + i.BytesBA
	t.Kernel += i.Kernel
	t.Dropped += i.DroppedAB + i.DroppedBA
}

// Totals returns the daemon's counts now.
func (srv *Server) Totals() Totals {
	srv.mu.Lock()
	t := srv.ended
	t.Joined = srv.joined
	open := make([]*entry, 0, len(srv.pairs))
	for _, e := range srv.pairs {
		open = append(open, e)
	}
	srv.mu.Unlock()
	t.Open = len(open)
	for _, e := range open {
		i := e.current()
		t.Bytes += i.BytesAB + i.BytesBA
		t.Kernel += i.Kernel
		t.Dropped += i.DroppedAB + i.DroppedBA
	}
	return t
}

// Stats lists the pairs joined now.
func (srv *Server) Stats() []PairInfo {
	srv.mu.Lock()
	defer srv.mu.Unlock()
	out := make([]PairInfo, 0, len(srv.pairs))
	for _, e := range srv.pairs {
		out = append(out, e.current())
	}
	slices.SortFunc(out, func(a, b PairInfo) int { return cmp.Compare(a.Handle, b.Handle) })
	return out
}
