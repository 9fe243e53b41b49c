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
	"time"

	"golang.org/x/sys/unix"

	"github.com/shunt-project/shunt/splice"
)

// Server accepts hand-overs on a unix socket and joins them.
type Server struct {
	ln   *net.UnixListener
	path string
	s    *splice.Splicer
	log  func(format string, args ...any)

	mu     sync.Mutex
	next   uint64
	pairs  map[uint64]*entry
	closed bool
	wg     sync.WaitGroup
}

type entry struct {
	info  PairInfo
	pair  *splice.Pair
	owner *conn // nil once the client that joined it left
}

// Listen creates the control socket at path (its directory too), readable
// and writable by root only, and loads the splice program.
func Listen(path string, opts splice.Options, logf func(format string, args ...any)) (*Server, error) {
	if logf == nil {
		logf = func(string, ...any) {}
	}
	if err := os.MkdirAll(filepath.Dir(path), 0o755); err != nil {
		return nil, fmt.Errorf("control socket directory: %w", err)
	}
	if c, err := net.Dial("unixpacket", path); err == nil {
		c.Close()
		return nil, fmt.Errorf("another daemon is listening on %s", path)
	}
	os.Remove(path) // left by a daemon that died
	old := unix.Umask(0o177)
	ln, err := net.ListenUnix("unixpacket", &net.UnixAddr{Name: path, Net: "unixpacket"})
	unix.Umask(old)
	if err != nil {
		return nil, fmt.Errorf("listen on %s: %w", path, err)
	}
	s, err := splice.New(opts)
	if err != nil {
		ln.Close()
		return nil, err
	}
	return &Server{ln: ln, path: path, s: s, log: logf, pairs: map[uint64]*entry{}}, nil
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
		srv.wg.Add(1)
		go func() {
			defer srv.wg.Done()
			srv.serveConn(&conn{c: c})
		}()
	}
}

// Close stops listening, resets every joined pair and removes the socket.
func (srv *Server) Close() error {
	srv.ln.Close()
	srv.mu.Lock()
	srv.closed = true
	srv.mu.Unlock()
	err := srv.s.Close()
	srv.wg.Wait()
	os.Remove(srv.path)
	return err
}

// conn is one client; writes are serialized (replies and events).
type conn struct {
	c  *net.UnixConn
	mu sync.Mutex
}

func (c *conn) send(v any) {
	b, _ := json.Marshal(v)
	c.mu.Lock()
	defer c.mu.Unlock()
	c.c.SetWriteDeadline(time.Now().Add(5 * time.Second))
	c.c.Write(b)
}

func (srv *Server) serveConn(c *conn) {
	defer func() {
		c.c.Close()
		srv.mu.Lock()
		for _, e := range srv.pairs {
			if e.owner == c {
				e.owner = nil
			}
		}
		srv.mu.Unlock()
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
	var cerr error
	raw.Control(func(fd uintptr) { cred, cerr = unix.GetsockoptUcred(int(fd), unix.SOL_SOCKET, unix.SO_PEERCRED) })
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
		e.pair.Abort()
		<-e.pair.Done()
		return Reply{OK: true}
	}
	return Reply{Error: fmt.Sprintf("unknown op %q: want join, stats or close", req.Op)}
}

func (srv *Server) join(c *conn, fdA, fdB int) (uint64, error) {
	a, err := splice.Conn(fdA)
	if err != nil {
		unix.Close(fdB)
		return 0, fmt.Errorf("first descriptor %w", err)
	}
	b, err := splice.Conn(fdB)
	if err != nil {
		a.Close()
		return 0, fmt.Errorf("second descriptor %w", err)
	}
	pair, err := srv.s.Join(a, b)
	if err != nil {
		a.Close()
		b.Close()
		return 0, err
	}
	srv.mu.Lock()
	srv.next++
	h := srv.next
	e := &entry{pair: pair, owner: c, info: PairInfo{
		Handle: h, Since: time.Now(), InKernel: pair.InKernel(),
		A: a.LocalAddr().String() + " -> " + a.RemoteAddr().String(),
		B: b.LocalAddr().String() + " -> " + b.RemoteAddr().String(),
	}}
	srv.pairs[h] = e
	srv.mu.Unlock()
	srv.wg.Add(1)
	go func() {
		defer srv.wg.Done()
		<-pair.Done()
		srv.mu.Lock()
		delete(srv.pairs, h)
		owner := e.owner
		srv.mu.Unlock()
		ev := Event{Event: "ended", PairInfo: e.current()}
		if err := pair.Err(); err != nil {
			ev.Error = err.Error()
		}
		if owner != nil {
			owner.send(ev)
		}
	}()
	return h, nil
}

func (e *entry) current() PairInfo {
	i := e.info
	ab, ba := e.pair.Stats()
	i.BytesAB, i.BytesBA, i.Kernel = ab.Bytes, ba.Bytes, ab.Kernel+ba.Kernel
	return i
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
