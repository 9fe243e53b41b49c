package daemon

import (
	"encoding/json"
	"errors"
	"fmt"
	"net"
	"os"
	"time"

	"golang.org/x/sys/unix"

	"github.com/shunt-project/shunt/splice"
)

// Restarting without dropping pairs: a new daemon (TakeOver) asks the
// running one for a hand-over. The old daemon stops listening, freezes its
// pairs (the kernel keeps forwarding), and sends
//
//	{"ok":true,"handle":N,"udp_pairs":U,"clients":M} with the BPF objects'
//	descriptors (splice.Objects, then splice.UDPObjects), then N messages
//	{"info":...} each with a TCP pair's two sockets, U messages
//	{"info":...,"udp":...} each with a UDP pair's two sockets, then M
//	messages {"client":i} each with a client connection,
//
// and exits without resetting anything. The new daemon resumes the pairs,
// keeps their handles, serves the clients on the connections they already
// have (a request they sent meanwhile waits in the socket for it), sends
// them the "ended" events of the pairs they joined, and listens on the
// socket.

type handoverPair struct {
	Info  PairInfo         `json:"info"`
	State splice.PairState `json:"state"`
	// Bytes a direction had read but not yet written follow in raw
	// messages of at most chunk bytes: a->b's, then b->a's.
	PendingAB int `json:"pending_ab,omitempty"`
	PendingBA int `json:"pending_ba,omitempty"`
	// Owner is 1 + the index of the client connection that joined the
	// pair, 0 if it left.
	Owner int `json:"owner,omitempty"`
}

type handoverClient struct {
	Client int `json:"client"`
}

type handoverUDPPair struct {
	Info  PairInfo            `json:"info"`
	State splice.UDPPairState `json:"udp"`
	Owner int                 `json:"owner,omitempty"`
}

// handoverVersion names what a hand-over carries: the splice state (TCP and
// UDP) and this package's protocol (3: UDP pairs, then client connections,
// follow the TCP pairs).
func handoverVersion() string {
	return splice.StateVersion() + "+" + splice.UDPStateVersion() + "/daemon-3"
}

const chunk = 32 << 10

func handoverRequest(b []byte) (Request, bool) {
	var r Request
	return r, json.Unmarshal(b, &r) == nil && r.Op == "handover"
}

// handOver runs in the old daemon.
func (srv *Server) handOver(c *conn, req Request) error {
	if req.Version != handoverVersion() {
		// Nothing stopped yet: this daemon keeps its pairs.
		c.send(Reply{Error: fmt.Sprintf("this daemon keeps its state as %q, the new one as %q: they cannot hand over; stop this one (its pairs are reset) and start the new one", handoverVersion(), req.Version)})
		return nil
	}
	// Stop serving the clients first, so that no join is half done when
	// the pairs freeze; what they send from now on waits in their sockets
	// for the new daemon.
	srv.mu.Lock()
	srv.handedOver = true
	var clients []*conn
	index := map[*conn]int{}
	for cc := range srv.conns {
		if cc != c {
			cc.handed = true
			index[cc] = len(clients)
			clients = append(clients, cc)
		}
	}
	srv.mu.Unlock()
	for _, cc := range clients {
		cc.c.SetReadDeadline(time.Now())
	}
	for _, cc := range clients {
		<-cc.done
	}
	defer func() {
		for _, cc := range clients {
			cc.c.Close() // the new daemon has its own copy
		}
	}()
	srv.ln.SetUnlinkOnClose(false) // the new daemon binds the same path
	// Joins fail from here on ("splicer is closed"); the listener closes
	// last, which ends Serve only once the new daemon holds everything.
	defer srv.ln.Close()
	objs, states := srv.s.Freeze()
	uobjs, ustates := srv.u.Freeze()
	info, uinfo := map[uint32]PairInfo{}, map[uint32]PairInfo{}
	owner, uowner := map[uint32]int{}, map[uint32]int{}
	srv.mu.Lock()
	for _, e := range srv.pairs {
		in, ow := info, owner
		if e.udp != nil {
			in, ow = uinfo, uowner
		}
		in[e.index] = e.current()
		if i, ok := index[e.owner]; ok && e.owner != nil {
			ow[e.index] = i + 1
		}
	}
	// They are the new daemon's now (and their state is unmapped below).
	srv.pairs = map[uint64]*entry{}
	srv.handed = len(states) + len(ustates)
	srv.mu.Unlock()
	head, _ := json.Marshal(Reply{OK: true, Handle: uint64(len(states)), UDPPairs: len(ustates), Clients: len(clients)})
	if _, _, err := c.c.WriteMsgUnix(head, unix.UnixRights(append(objs[:], uobjs[:]...)...), nil); err != nil {
		return err
	}
	for _, st := range states {
		fa, _ := fdOf(st.A)
		fb, _ := fdOf(st.B)
		b, _ := json.Marshal(handoverPair{Info: info[st.Index], State: st, PendingAB: len(st.AB.Pending), PendingBA: len(st.BA.Pending), Owner: owner[st.Index]})
		if _, _, err := c.c.WriteMsgUnix(b, unix.UnixRights(fa, fb), nil); err != nil {
			return err
		}
		for _, p := range [][]byte{st.AB.Pending, st.BA.Pending} {
			for len(p) > 0 {
				n := min(len(p), chunk)
				if _, err := c.c.Write(p[:n]); err != nil {
					return err
				}
				p = p[n:]
			}
		}
	}
	for _, st := range ustates {
		fa, _ := fdOf(st.A)
		fb, _ := fdOf(st.B)
		b, _ := json.Marshal(handoverUDPPair{Info: uinfo[st.Index], State: st, Owner: uowner[st.Index]})
		if _, _, err := c.c.WriteMsgUnix(b, unix.UnixRights(fa, fb), nil); err != nil {
			return err
		}
	}
	for i, cc := range clients {
		fd, err := fdOf(cc.c)
		if err != nil {
			return err
		}
		b, _ := json.Marshal(handoverClient{Client: i})
		if _, _, err := c.c.WriteMsgUnix(b, unix.UnixRights(fd), nil); err != nil {
			return err
		}
	}
	// Wait for the new daemon to hang up: it holds everything then.
	c.c.SetReadDeadline(time.Now().Add(30 * time.Second))
	c.c.Read(make([]byte, 1))
	srv.s.Release()
	srv.u.Release()
	return nil
}

// TakeOver starts a daemon at path by taking the pairs of the daemon
// listening there; it returns how many pairs it took.
func TakeOver(path string, opts splice.Options, logf func(format string, args ...any)) (*Server, int, error) {
	c, err := net.DialUnix("unixpacket", nil, &net.UnixAddr{Name: path, Net: "unixpacket"})
	if err != nil {
		return nil, 0, fmt.Errorf("no daemon to take over at %s: %w", path, err)
	}
	defer c.Close()
	req, _ := json.Marshal(Request{Op: "handover", Version: handoverVersion()})
	if _, err := c.Write(req); err != nil {
		return nil, 0, err
	}
	buf := make([]byte, maxMessage)
	oob := make([]byte, unix.CmsgSpace(10*4))
	read := func(want int) ([]byte, []int, error) {
		n, oobn, flags, _, err := c.ReadMsgUnix(buf, oob)
		if err != nil {
			return nil, nil, fmt.Errorf("hand-over: %w", err)
		}
		fds, err := receivedFDs(oob[:oobn], flags)
		if err == nil && len(fds) != want {
			err = fmt.Errorf("hand-over: got %d descriptors, want %d", len(fds), want)
		}
		if err != nil {
			for _, fd := range fds {
				unix.Close(fd)
			}
			return buf[:n], nil, err
		}
		return buf[:n], fds, nil
	}
	b, fds, err := read(10)
	if err != nil {
		var refusal Reply
		if json.Unmarshal(b, &refusal) == nil && refusal.Error != "" {
			return nil, 0, fmt.Errorf("the running daemon refused the hand-over: %s", refusal.Error)
		}
		return nil, 0, err
	}
	var head Reply
	if err := json.Unmarshal(b, &head); err != nil || !head.OK {
		for _, fd := range fds {
			unix.Close(fd)
		}
		return nil, 0, fmt.Errorf("the running daemon refused the hand-over: %s", head.Error)
	}
	var objs splice.Objects
	var uobjs splice.UDPObjects
	copy(objs[:], fds[:5])
	copy(uobjs[:], fds[5:])
	var states []splice.PairState
	var infos []PairInfo
	var owners []int
	for range head.Handle {
		b, fds, err := read(2)
		if err != nil {
			return nil, 0, err
		}
		var hp handoverPair
		if err := json.Unmarshal(b, &hp); err != nil {
			return nil, 0, err
		}
		if hp.State.A, err = received[*net.TCPConn](fds[0], "TCP socket"); err == nil {
			hp.State.B, err = received[*net.TCPConn](fds[1], "TCP socket")
		}
		if err != nil {
			return nil, 0, err
		}
		for _, d := range []struct {
			n   int
			dst *[]byte
		}{{hp.PendingAB, &hp.State.AB.Pending}, {hp.PendingBA, &hp.State.BA.Pending}} {
			for len(*d.dst) < d.n {
				b, _, err := read(0)
				if err != nil {
					return nil, 0, err
				}
				*d.dst = append(*d.dst, b...)
			}
		}
		states = append(states, hp.State)
		infos = append(infos, hp.Info)
		owners = append(owners, hp.Owner)
	}
	var ustates []splice.UDPPairState
	var uinfos []PairInfo
	var uowners []int
	for range head.UDPPairs {
		b, fds, err := read(2)
		if err != nil {
			return nil, 0, err
		}
		var hp handoverUDPPair
		if err := json.Unmarshal(b, &hp); err != nil {
			return nil, 0, err
		}
		if hp.State.A, err = received[*net.UDPConn](fds[0], "UDP socket"); err == nil {
			hp.State.B, err = received[*net.UDPConn](fds[1], "UDP socket")
		}
		if err != nil {
			return nil, 0, err
		}
		ustates = append(ustates, hp.State)
		uinfos = append(uinfos, hp.Info)
		uowners = append(uowners, hp.Owner)
	}
	var clients []*conn
	for range head.Clients {
		_, fds, err := read(1)
		if err == nil {
			var uc *net.UnixConn
			if uc, err = received[*net.UnixConn](fds[0], "unix socket"); err == nil {
				clients = append(clients, &conn{c: uc, done: make(chan struct{})})
			}
		}
		if err != nil {
			for _, cc := range clients {
				cc.c.Close()
			}
			return nil, 0, err
		}
	}
	s, pairs, err := splice.Resume(objs, opts, states)
	if err != nil {
		return nil, 0, err
	}
	u, upairs, err := splice.ResumeUDP(uobjs, udpOptions(opts), ustates)
	if err != nil {
		return nil, 0, errors.Join(err, s.Close())
	}
	srv := newServer(path, s, u, logf)
	client := func(o int) *conn {
		if o > 0 && o <= len(clients) {
			return clients[o-1]
		}
		return nil
	}
	for i, p := range pairs {
		srv.track(client(owners[i]), p, infos[i])
	}
	for i, p := range upairs {
		srv.trackUDP(client(uowners[i]), p, uinfos[i])
	}
	if err := srv.listen(); err != nil {
		return nil, 0, errors.Join(err, s.Close(), u.Close())
	}
	for _, cc := range clients {
		srv.serve(cc)
	}
	return srv, len(pairs) + len(upairs), nil
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
