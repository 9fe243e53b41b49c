package daemon

import (
	"encoding/json"
	"fmt"
	"net"
	"os"
	"time"

	"github.com/shunt-project/shunt/splice"
)

// Restarting without dropping pairs: a new daemon (TakeOver) asks the
// running one for a hand-over ({"op":"handover","version":...}). The old
// daemon stops serving its clients, freezes its pairs (the kernel keeps
// forwarding) and sends its state (handoverConn.sendState: the objects, the
// pairs with their pending bytes, the clients' connections). The new one
// takes it, readies everything without running any of it, listens on a
// socket of its own next to the old one and says "ready"; the old one
// answers "commit", lets go without resetting anything and ends; the new one
// moves its socket over the old one's path, runs the pairs, serves the
// clients on the connections they already have (what they sent meanwhile
// waits in the socket) and sends them the "ended" events of the pairs they
// joined.
//
// Until the commit the old daemon owns everything: if the new one fails or
// dies on the way (or takes longer than handoverWait), it thaws its pairs
// where they stand and serves on; the new one lets go of its copies without
// touching a pair.

// handoverVersion names what a hand-over carries: the splice state (TCP and
// UDP) and this package's protocol (4: typed messages, ready and commit).
func handoverVersion() string {
	return splice.StateVersion() + "+" + splice.UDPStateVersion() + "/daemon-4"
}

// handoverWait bounds how long the old daemon waits for the new one to be
// ready before it takes its pairs back.
const handoverWait = 30 * time.Second

func handoverRequest(b []byte) (Request, bool) {
	var r Request
	return r, json.Unmarshal(b, &r) == nil && r.Op == "handover"
}

// handOver runs in the old daemon, on the taker's connection c.
func (srv *Server) handOver(c *conn, req Request) error {
	if req.Version != handoverVersion() {
		// Nothing stopped yet: this daemon keeps its pairs.
		c.send(handoverMsg{Error: fmt.Sprintf("this daemon keeps its state as %q, the new one as %q: they cannot hand over; stop this one (its pairs are reset) and start the new one", handoverVersion(), req.Version)})
		return nil
	}
	clients := srv.pauseClients(c)
	st, entries := srv.freeze(clients)
	pairs := len(st.tcp) + len(st.udp)
	if err := srv.transfer(c, st, pairs); err != nil {
		srv.thaw(entries, clients)
		return fmt.Errorf("%w; kept %d pairs and %d clients", err, pairs, len(clients))
	}
	srv.s.Release()
	srv.u.Release()
	for _, cc := range clients {
		cc.c.Close() // the new daemon has its own copy
	}
	srv.ln.SetUnlinkOnClose(false) // the path is the new daemon's socket now
	srv.ln.Close()                 // ends Serve
	return nil
}

// pauseClients stops serving every client but the taker, first, so that
// no join is half done when the pairs freeze; what they send from now on
// waits in their sockets. Returns them in the order the state lists them.
func (srv *Server) pauseClients(taker *conn) []*conn {
	srv.mu.Lock()
	var clients []*conn
	for cc := range srv.conns {
		if cc != taker {
			cc.handed = true
			clients = append(clients, cc)
		}
	}
	srv.mu.Unlock()
	for _, cc := range clients {
		_ = cc.c.SetReadDeadline(time.Now())
	}
	for _, cc := range clients {
		<-cc.done
	}
	return clients
}

// freeze stops the splicers (joins fail from here on: "splicer is closed")
// and makes the state the taker gets: each pair with its handle, and the
// client it belongs to (1 + its index in clients; 0: none). Returns the
// entries taken out of the server too, for thaw.
func (srv *Server) freeze(clients []*conn) (*handoverState, map[uint64]*entry) {
	index := map[*conn]int{}
	for i, cc := range clients {
		index[cc] = i
	}
	objs, states := srv.s.Freeze()
	uobjs, ustates := srv.u.Freeze()
	st := &handoverState{objs: objs, uobjs: uobjs}
	srv.mu.Lock()
	entries := srv.pairs
	srv.pairs = map[uint64]*entry{}
	srv.mu.Unlock()
	byIndex := map[uint32]*entry{}
	byUDPIndex := map[uint32]*entry{}
	for _, e := range entries {
		if e.udp != nil {
			byUDPIndex[e.index] = e
		} else {
			byIndex[e.index] = e
		}
	}
	owner := func(e *entry) int {
		if i, ok := index[e.owner]; ok && e.owner != nil {
			return i + 1
		}
		return 0
	}
	for _, ps := range states {
		e := byIndex[ps.Index]
		st.tcp = append(st.tcp, handoverPair{Info: e.current(), State: ps, Owner: owner(e)})
	}
	for _, ps := range ustates {
		e := byUDPIndex[ps.Index]
		st.udp = append(st.udp, handoverUDPPair{Info: e.current(), State: ps, Owner: owner(e)})
	}
	for _, cc := range clients {
		st.clients = append(st.clients, cc.c)
	}
	return st, entries
}

// transfer sends st to the taker, waits for it to be ready and commits:
// from a nil return the pairs are the new daemon's.
func (srv *Server) transfer(c *conn, st *handoverState, pairs int) error {
	h := newHandoverConn(c.c)
	if err := h.sendState(st); err != nil {
		return err
	}
	_ = c.c.SetReadDeadline(time.Now().Add(handoverWait))
	_, _, err := h.recv("ready")
	_ = c.c.SetReadDeadline(time.Time{})
	if err != nil {
		return err
	}
	srv.mu.Lock()
	srv.handedOver = true
	srv.handed = pairs
	srv.mu.Unlock()
	if err := h.send(handoverMsg{Commit: true}); err != nil {
		srv.mu.Lock()
		srv.handedOver, srv.handed = false, 0
		srv.mu.Unlock()
		return err
	}
	return nil
}

// thaw takes back what a failed hand-over froze: the pairs run on where they
// stand, under their handles, and the clients are served again.
func (srv *Server) thaw(entries map[uint64]*entry, clients []*conn) {
	running := map[*splice.Pair]bool{}
	for _, p := range srv.s.Thaw() {
		running[p] = true
	}
	srv.u.Thaw()
	for h, e := range entries {
		if e.udp == nil && !running[e.pair] {
			continue // ended while frozen
		}
		srv.mu.Lock()
		srv.pairs[h] = e
		srv.mu.Unlock()
		if e.pair != nil {
			srv.watch(h, e)
		}
	}
	for _, cc := range clients {
		srv.mu.Lock()
		cc.handed = false
		cc.done = make(chan struct{})
		srv.mu.Unlock()
		cc.c.SetReadDeadline(time.Time{})
		srv.serve(cc)
	}
}

// TakeOver starts a daemon at path by taking the pairs of the daemon
// listening there; it returns how many pairs it took. If it fails, the
// running daemon keeps every pair.
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
	h := newHandoverConn(c)
	st, err := h.recvState()
	if err != nil {
		return nil, 0, err
	}
	srv, pairs, err := ready(path, opts, st, logf)
	if err != nil {
		return nil, 0, err
	}
	err = h.send(handoverMsg{Ready: true})
	if err == nil {
		_, _, err = h.recv("commit")
	}
	if err == nil {
		err = os.Rename(srv.ln.Addr().String(), path)
		if err != nil {
			// Too late to give the pairs back: run them, unreachable
			// by new clients, rather than drop them.
			logf("daemon: took over, but cannot move the control socket to %s: %v", path, err)
			err = nil
		} else {
			srv.path = path
			srv.ln.SetUnlinkOnClose(false) // Close removes srv.path
		}
	}
	if err != nil {
		srv.ln.Close()
		srv.s.Release()
		srv.u.Release()
		for _, cc := range pairs.clients {
			cc.c.Close()
		}
		return nil, 0, fmt.Errorf("%w; the running daemon keeps its pairs", err)
	}
	pairs.run(srv)
	return srv, len(pairs.tcp) + len(pairs.udp), nil
}

// taken is what a taker readied and runs on commit.
type taken struct {
	tcp     []*splice.Pair
	tcpInfo []handoverPair
	udp     []*splice.UDPPair
	udpInfo []handoverUDPPair
	clients []*conn
}

// ready builds a Server from a received state without running anything:
// the splicers hold the pairs frozen and the listener is on a path of its
// own (path.new), so that a failure before the commit leaves the running
// daemon as it was. It owns st.
func ready(path string, opts splice.Options, st *handoverState, logf func(format string, args ...any)) (*Server, *taken, error) {
	var states []splice.PairState
	for _, p := range st.tcp {
		states = append(states, p.State)
	}
	var ustates []splice.UDPPairState
	for _, p := range st.udp {
		ustates = append(ustates, p.State)
	}
	s, pairs, err := splice.Resume(st.objs, opts, states)
	if err != nil {
		closeFDs(st.uobjs[:])
		st.closeConns()
		return nil, nil, err
	}
	u, upairs, err := splice.ResumeUDP(st.uobjs, udpOptions(opts), ustates)
	if err != nil {
		s.Release()
		st.closeConns() // what Release closed already closes twice, harmlessly
		return nil, nil, err
	}
	t := &taken{tcp: pairs, udp: upairs}
	for _, c := range st.clients {
		t.clients = append(t.clients, &conn{c: c, done: make(chan struct{})})
	}
	// Resume leaves out a pair it could not take (and closes its copy);
	// match the rest by index.
	info := map[uint32]handoverPair{}
	for _, p := range st.tcp {
		info[p.State.Index] = p
	}
	for _, p := range pairs {
		t.tcpInfo = append(t.tcpInfo, info[p.Index()])
	}
	uinfo := map[uint32]handoverUDPPair{}
	for _, p := range st.udp {
		uinfo[p.State.Index] = p
	}
	for _, p := range upairs {
		t.udpInfo = append(t.udpInfo, uinfo[p.Index()])
	}
	srv := newServer(path+".new", s, u, logf)
	if err := srv.listen(); err != nil {
		s.Release()
		u.Release()
		for _, cc := range t.clients {
			cc.c.Close()
		}
		return nil, nil, err
	}
	return srv, t, nil
}

// run starts what was readied: the pairs, under their old handles and
// owners, and the clients.
func (t *taken) run(srv *Server) {
	client := func(o int) *conn {
		if o > 0 && o <= len(t.clients) {
			return t.clients[o-1]
		}
		return nil
	}
	srv.s.Thaw()
	srv.u.Thaw()
	for i, p := range t.tcp {
		srv.track(client(t.tcpInfo[i].Owner), p, t.tcpInfo[i].Info)
	}
	for i, p := range t.udp {
		srv.trackUDP(client(t.udpInfo[i].Owner), p, t.udpInfo[i].Info)
	}
	for _, cc := range t.clients {
		srv.serve(cc)
	}
}
