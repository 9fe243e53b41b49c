package daemon

import (
	"encoding/json"
	"errors"
	"fmt"
	"net"
	"sync"
	"syscall"
	"time"

	"golang.org/x/sys/unix"
)

// Client talks to a running daemon. One request at a time; events (pairs
// this client joined that ended) arrive on Events.
type Client struct {
	c       *net.UnixConn
	timeout time.Duration // replyTimeout; shorter in tests
	mu      sync.Mutex
	replies chan []byte
	events  chan Event
	done    chan struct{}
	err     error
}

// Dial connects to the daemon's control socket.
func Dial(path string) (*Client, error) {
	c, err := net.DialUnix("unixpacket", nil, &net.UnixAddr{Name: path, Net: "unixpacket"})
	if err != nil {
		if errors.Is(err, unix.ENOENT) || errors.Is(err, unix.ECONNREFUSED) {
			return nil, fmt.Errorf("no daemon at %s (start one with 'shunt daemon')", path)
		}
		return nil, fmt.Errorf("connect to the daemon at %s: %w", path, err)
	}
	cl := &Client{c: c, timeout: replyTimeout, replies: make(chan []byte, 1), events: make(chan Event, 256), done: make(chan struct{})}
	go cl.readLoop()
	return cl, nil
}

func (cl *Client) readLoop() {
	defer close(cl.done)
	defer close(cl.events)
	buf := make([]byte, maxMessage)
	for {
		n, err := cl.c.Read(buf)
		if err != nil || n == 0 {
			cl.err = errors.New("the daemon closed the connection")
			return
		}
		b := append([]byte{}, buf[:n]...)
		if isEvent(b) {
			var e Event
			if json.Unmarshal(b, &e) == nil {
				cl.events <- e
			}
			continue
		}
		cl.replies <- b
	}
}

// Events delivers an "ended" event for each pair this client joined, when
// it ends. It is closed when the connection to the daemon ends.
func (cl *Client) Events() <-chan Event { return cl.events }

func (cl *Client) call(req Request, fds ...int) (Reply, error) {
	cl.mu.Lock()
	defer cl.mu.Unlock()
	b, _ := json.Marshal(req)
	var oob []byte
	if len(fds) > 0 {
		oob = unix.UnixRights(fds...)
	}
	if _, _, err := cl.c.WriteMsgUnix(b, oob, nil); err != nil {
		return Reply{}, fmt.Errorf("send to the daemon: %w", err)
	}
	select {
	case b := <-cl.replies:
		var r Reply
		if err := json.Unmarshal(b, &r); err != nil {
			return Reply{}, fmt.Errorf("daemon reply: %w", err)
		}
		if !r.OK {
			return r, errors.New(r.Error)
		}
		return r, nil
	case <-cl.done:
		return Reply{}, cl.err
	case <-time.After(cl.timeout):
		// A late reply would be taken for the next request's: this
		// connection is done.
		cl.c.Close()
		return Reply{}, fmt.Errorf("the daemon did not answer %q within %v; connection closed", req.Op, cl.timeout)
	}
}

// replyTimeout bounds the wait for a reply: longer than a hand-over may
// hold a client's requests (handoverWait).
const replyTimeout = 2 * handoverWait

// Join hands a and b to the daemon, which joins them in the kernel; it
// returns the pair's handle. The daemon holds its own descriptors: close a
// and b afterwards, and do not read or write them.
func (cl *Client) Join(a, b *net.TCPConn) (uint64, error) { return cl.joinConns(a, b) }

// JoinUDP hands two connected UDP sockets to the daemon, which joins them
// in the kernel (each datagram whole); as for Join, close a and b after.
// A UDP pair lasts until Abort or until the daemon stops.
func (cl *Client) JoinUDP(a, b *net.UDPConn) (uint64, error) { return cl.joinConns(a, b) }

func (cl *Client) joinConns(a, b syscall.Conn) (uint64, error) {
	fa, err := fdOf(a)
	if err != nil {
		return 0, err
	}
	fb, err := fdOf(b)
	if err != nil {
		return 0, err
	}
	return cl.JoinFDs(fa, fb)
}

// JoinFDs is Join for raw descriptors (two TCP or two UDP sockets).
func (cl *Client) JoinFDs(a, b int) (uint64, error) {
	r, err := cl.call(Request{Op: "join"}, a, b)
	return r.Handle, err
}

// Stats lists the pairs the daemon holds.
func (cl *Client) Stats() ([]PairInfo, error) {
	r, err := cl.call(Request{Op: "stats"})
	return r.Pairs, err
}

// Abort resets both connections of a TCP pair; a UDP pair is taken out of
// the kernel and its sockets closed.
func (cl *Client) Abort(handle uint64) error {
	_, err := cl.call(Request{Op: "close", Handle: handle})
	return err
}

// Close ends the connection; joined pairs keep going in the daemon.
func (cl *Client) Close() error {
	err := cl.c.Close()
	<-cl.done
	return err
}

// fdOf is the descriptor behind a connection (still owned by it).
func fdOf(c syscall.Conn) (int, error) {
	raw, err := c.SyscallConn()
	if err != nil {
		return -1, err
	}
	fd := -1
	if err := raw.Control(func(f uintptr) { fd = int(f) }); err != nil {
		return -1, err
	}
	return fd, nil
}
