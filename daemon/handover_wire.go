package daemon

import (
	"encoding/json"
	"errors"
	"fmt"
	"net"
	"os"
	"syscall"

	"golang.org/x/sys/unix"

	"github.com/shunt-project/shunt/splice"
)

// The hand-over's messages. Each is one SOCK_SEQPACKET message holding a
// handoverMsg with exactly one field set; the field fixes how many
// descriptors come with it (see kind), so a reader never counts on the
// order of fields it was not told about.

// handoverMsg is one message of a hand-over.
type handoverMsg struct {
	Head   *handoverHead    `json:"head,omitempty"`   // + the objects' descriptors
	TCP    *handoverPair    `json:"tcp,omitempty"`    // + the pair's two sockets
	UDP    *handoverUDPPair `json:"udp,omitempty"`    // + the pair's two sockets
	Client *handoverClient  `json:"client,omitempty"` // + the client's connection
	Data   []byte           `json:"data,omitempty"`   // pending bytes of the TCP pair before
	Ready  bool             `json:"ready,omitempty"`  // taker: holds everything, listening
	Commit bool             `json:"commit,omitempty"` // giver: it let go; the taker runs the pairs
	// Error: the giver refuses before it stops anything (a daemon of
	// an older protocol refuses with a Reply, which reads the same).
	Error string `json:"error,omitempty"`
}

// handoverHead says what follows.
type handoverHead struct {
	TCPPairs int `json:"tcp_pairs"`
	UDPPairs int `json:"udp_pairs"`
	Clients  int `json:"clients"`
}

type handoverPair struct {
	Info  PairInfo         `json:"info"`
	State splice.PairState `json:"state"`
	// Bytes a direction had read but not yet written follow in Data
	// messages of at most dataChunk bytes: a->b's, then b->a's.
	PendingAB int `json:"pending_ab,omitempty"`
	PendingBA int `json:"pending_ba,omitempty"`
	// Owner is 1 + the index of the client connection that joined the
	// pair, 0 if it left.
	Owner int `json:"owner,omitempty"`
}

type handoverUDPPair struct {
	Info  PairInfo            `json:"info"`
	State splice.UDPPairState `json:"udp"`
	Owner int                 `json:"owner,omitempty"`
}

type handoverClient struct {
	Client int `json:"client"`
}

// objectFDs is how many descriptors come with the head.
const objectFDs = len(splice.Objects{}) + len(splice.UDPObjects{})

// dataChunk bounds a Data message (base64 in JSON: 4/3 of it, under
// maxMessage).
const dataChunk = 32 << 10

// kind names a message and says how many descriptors it carries; "" for
// one with no field set.
func (m *handoverMsg) kind() (string, int) {
	switch {
	case m.Head != nil:
		return "head", objectFDs
	case m.TCP != nil:
		return "TCP pair", 2
	case m.UDP != nil:
		return "UDP pair", 2
	case m.Client != nil:
		return "client", 1
	case m.Data != nil:
		return "data", 0
	case m.Ready:
		return "ready", 0
	case m.Commit:
		return "commit", 0
	case m.Error != "":
		return "refusal", 0
	}
	return "", 0
}

// handoverConn reads and writes hand-over messages on one connection.
type handoverConn struct {
	c   *net.UnixConn
	buf []byte
	oob []byte
}

func newHandoverConn(c *net.UnixConn) *handoverConn {
	return &handoverConn{c: c, buf: make([]byte, maxMessage), oob: make([]byte, unix.CmsgSpace(objectFDs*4))}
}

// send writes one message with its descriptors (which stay the caller's).
func (h *handoverConn) send(m handoverMsg, fds ...int) error {
	name, want := m.kind()
	if len(fds) != want {
		return fmt.Errorf("hand-over: a %s message takes %d descriptors, not %d", name, want, len(fds))
	}
	b, err := json.Marshal(m)
	if err != nil {
		return err
	}
	var oob []byte
	if len(fds) > 0 {
		oob = unix.UnixRights(fds...)
	}
	if _, _, err := h.c.WriteMsgUnix(b, oob, nil); err != nil {
		return fmt.Errorf("hand-over: send %s: %w", name, err)
	}
	return nil
}

// errHungUp: the other daemon closed the connection.
var errHungUp = errors.New("the other daemon hung up")

// recv reads one message of the kind want names, and the descriptors that
// came with it, which are the caller's; on error none are left open.
func (h *handoverConn) recv(want string) (handoverMsg, []int, error) {
	var m handoverMsg
	n, oobn, flags, _, err := h.c.ReadMsgUnix(h.buf, h.oob)
	if err != nil {
		return m, nil, fmt.Errorf("hand-over: waiting for %s: %w", want, err)
	}
	fds, err := receivedFDs(h.oob[:oobn], flags)
	if err == nil && n == 0 {
		err = fmt.Errorf("hand-over: waiting for %s: %w", want, errHungUp)
	}
	if err == nil {
		err = json.Unmarshal(h.buf[:n], &m)
	}
	got, nfds := m.kind()
	switch {
	case err != nil:
	case m.Error != "":
		err = fmt.Errorf("the running daemon refused the hand-over: %s", m.Error)
	case got != want:
		err = fmt.Errorf("hand-over: got a %q message, want %s", got, want)
	case len(fds) != nfds:
		err = fmt.Errorf("hand-over: a %s message came with %d descriptors, want %d", got, len(fds), nfds)
	}
	if err != nil {
		closeFDs(fds)
		return handoverMsg{}, nil, err
	}
	return m, fds, nil
}

// sendData writes b in Data messages.
func (h *handoverConn) sendData(b []byte) error {
	for len(b) > 0 {
		n := min(len(b), dataChunk)
		if err := h.send(handoverMsg{Data: b[:n]}); err != nil {
			return err
		}
		b = b[n:]
	}
	return nil
}

// recvData reads n bytes of Data messages.
func (h *handoverConn) recvData(n int) ([]byte, error) {
	var out []byte
	for len(out) < n {
		m, _, err := h.recv("data")
		if err != nil {
			return nil, err
		}
		out = append(out, m.Data...)
	}
	if len(out) != n {
		return nil, fmt.Errorf("hand-over: %d pending bytes announced, %d sent", n, len(out))
	}
	return out, nil
}

// handoverState is what one daemon gives the next: the frozen splicers'
// objects and pairs, with the daemon's own bookkeeping, and the clients.
type handoverState struct {
	objs    splice.Objects
	uobjs   splice.UDPObjects
	tcp     []handoverPair // State.A and State.B set
	udp     []handoverUDPPair
	clients []*net.UnixConn
}

// sendState writes st: head, TCP pairs (each followed by its pending
// bytes), UDP pairs, clients. Everything in st stays the caller's.
func (h *handoverConn) sendState(st *handoverState) error {
	head := handoverMsg{Head: &handoverHead{TCPPairs: len(st.tcp), UDPPairs: len(st.udp), Clients: len(st.clients)}}
	if err := h.send(head, append(st.objs[:], st.uobjs[:]...)...); err != nil {
		return err
	}
	for _, p := range st.tcp {
		fds, err := connFDs(p.State.A, p.State.B)
		if err != nil {
			return err
		}
		p.PendingAB, p.PendingBA = len(p.State.AB.Pending), len(p.State.BA.Pending)
		if err := h.send(handoverMsg{TCP: &p}, fds...); err != nil {
			return err
		}
		for _, b := range [][]byte{p.State.AB.Pending, p.State.BA.Pending} {
			if err := h.sendData(b); err != nil {
				return err
			}
		}
	}
	for _, p := range st.udp {
		fds, err := connFDs(p.State.A, p.State.B)
		if err != nil {
			return err
		}
		if err := h.send(handoverMsg{UDP: &p}, fds...); err != nil {
			return err
		}
	}
	for i, c := range st.clients {
		fds, err := connFDs(c)
		if err != nil {
			return err
		}
		if err := h.send(handoverMsg{Client: &handoverClient{Client: i}}, fds...); err != nil {
			return err
		}
	}
	return nil
}

// recvState reads what sendState wrote. The state is the caller's to
// close; on error nothing received is left open.
func (h *handoverConn) recvState() (_ *handoverState, err error) {
	st := &handoverState{}
	m, fds, err := h.recv("head")
	if err != nil {
		return nil, err
	}
	copy(st.objs[:], fds[:len(st.objs)])
	copy(st.uobjs[:], fds[len(st.objs):])
	defer func() {
		if err != nil {
			st.close()
		}
	}()
	head := m.Head
	for i := range head.TCPPairs {
		m, fds, err := h.recv("TCP pair")
		if err != nil {
			return nil, err
		}
		p := *m.TCP
		if p.State.A, p.State.B, err = receivedPair[*net.TCPConn](fds, "TCP socket"); err != nil {
			return nil, err
		}
		st.tcp = append(st.tcp, p)
		for _, d := range []struct {
			n   int
			dst *[]byte
		}{{p.PendingAB, &st.tcp[i].State.AB.Pending}, {p.PendingBA, &st.tcp[i].State.BA.Pending}} {
			if *d.dst, err = h.recvData(d.n); err != nil {
				return nil, err
			}
		}
	}
	for range head.UDPPairs {
		m, fds, err := h.recv("UDP pair")
		if err != nil {
			return nil, err
		}
		p := *m.UDP
		if p.State.A, p.State.B, err = receivedPair[*net.UDPConn](fds, "UDP socket"); err != nil {
			return nil, err
		}
		st.udp = append(st.udp, p)
	}
	for range head.Clients {
		_, fds, err := h.recv("client")
		if err != nil {
			return nil, err
		}
		c, err := received[*net.UnixConn](fds[0], "unix socket")
		if err != nil {
			return nil, err
		}
		st.clients = append(st.clients, c)
	}
	return st, nil
}

// close lets go of every descriptor a received state holds, touching no
// pair: the giver still has its own.
func (st *handoverState) close() {
	closeFDs(st.objs[:])
	closeFDs(st.uobjs[:])
	st.objs, st.uobjs = splice.Objects{}, splice.UDPObjects{}
	st.closeConns()
}

// closeConns closes the pairs' sockets and the clients' connections.
func (st *handoverState) closeConns() {
	for _, p := range st.tcp {
		p.State.A.Close()
		p.State.B.Close()
	}
	for _, p := range st.udp {
		p.State.A.Close()
		p.State.B.Close()
	}
	for _, c := range st.clients {
		c.Close()
	}
	st.tcp, st.udp, st.clients = nil, nil, nil
}

func closeFDs(fds []int) {
	for _, fd := range fds {
		if fd > 0 {
			unix.Close(fd)
		}
	}
}

// connFDs returns the descriptors under conns (still the conns').
func connFDs(conns ...syscall.Conn) ([]int, error) {
	fds := make([]int, len(conns))
	for i, c := range conns {
		fd, err := fdOf(c)
		if err != nil {
			return nil, fmt.Errorf("hand-over: %w", err)
		}
		fds[i] = fd
	}
	return fds, nil
}

// receivedPair wraps a pair's two received descriptors; it owns both.
func receivedPair[T net.Conn](fds []int, what string) (a, b T, err error) {
	if a, err = received[T](fds[0], what); err != nil {
		unix.Close(fds[1])
		return a, b, err
	}
	if b, err = received[T](fds[1], what); err != nil {
		a.Close()
	}
	return a, b, err
}

// received wraps a descriptor that came by SCM_RIGHTS as a T (a TCP, UDP or
// unix connection) whatever its state (a pair may be half closed); it takes
// ownership of fd.
func received[T net.Conn](fd int, what string) (T, error) {
	var zero T
	f := os.NewFile(uintptr(fd), what)
	defer f.Close()
	c, err := net.FileConn(f)
	if err != nil {
		return zero, err
	}
	t, ok := c.(T)
	if !ok {
		c.Close()
		return zero, fmt.Errorf("hand-over: a descriptor is not a %s", what)
	}
	return t, nil
}
