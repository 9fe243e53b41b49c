package bypass

import (
	"errors"
	"fmt"
	"net"

	"github.com/cilium/ebpf"
	"golang.org/x/sys/unix"
)

// ErrNotHeld means a socket given to NewShortcut is not one bypass paired
// (its peer is outside the enabled cgroups or on another host, or its
// connection was left on TCP).
var ErrNotHeld = errors.New("bypass: the socket's connection is not paired")

// ErrNoShortcuts means the install predates shortcuts (remove and enable
// again to get them).
var ErrNoShortcuts = errors.New("bypass: this install has no shortcuts map (made by an older shunt)")

// Shortcut lets the peers of a kernel join's two sockets reach each other
// directly: where bypass paired both of the join's connections (a proxy
// between a client and an upstream, all in enabled cgroups), a peer's send
// goes straight into the far peer's socket whenever nothing it sent by TCP
// is still on its way through the join (bpf/bypass/redirect.h, through_join). The
// join keeps forwarding what takes TCP, and the connection's end and reset.
type Shortcut struct {
	m                *ebpf.Map
	aCookie, bCookie uint64
	aFinal, bFinal   bypassShortcut // the counts as Close found them
	closed           bool
}

// HasShortcuts says whether the install can take shortcuts (one made by an
// older shunt cannot: ErrNoShortcuts).
func (in *Install) HasShortcuts() bool { return in.maps[shortcutsMap] != nil }

// NewShortcut registers a and b, two sockets a kernel join holds (package
// splice), so that a's peer's sends may go straight to b's peer and back.
// added is what the caller wrote to b before the join less what it read from
// a (a proxy that read a request head to route and wrote it on after a PROXY
// header: the header's length); it writes nothing of its own later. It must
// be exact: the shortcut compares byte counts, and an offset that is off by
// k would let a send pass k bytes still in the join.
func (in *Install) NewShortcut(a, b *net.TCPConn, added uint32) (*Shortcut, error) {
	m := in.maps[shortcutsMap]
	if m == nil {
		return nil, ErrNoShortcuts
	}
	aState, aCookie, err := in.heldState(a)
	if err != nil {
		return nil, err
	}
	bState, bCookie, err := in.heldState(b)
	if err != nil {
		return nil, err
	}
	// What the join's sockets sent by redirect before they were joined
	// (none after: bypass leaves a joined socket's sends on TCP) is not in
	// their sequence numbers, which through_join compares: take it out.
	s := &Shortcut{m: m, aCookie: aCookie, bCookie: bCookie}
	ab := bypassShortcut{Partner: bState.Self, PartnerCookie: bCookie, Added: added - uint32(bState.TxBytes)}
	ba := bypassShortcut{Partner: aState.Self, PartnerCookie: aCookie, Added: -uint32(aState.TxBytes)}
	if err := m.Put(aCookie, ab); err != nil {
		return nil, fmt.Errorf("bypass: add a shortcut: %w", err)
	}
	if err := m.Put(bCookie, ba); err != nil {
		return nil, errors.Join(fmt.Errorf("bypass: add a shortcut: %w", err), deleteIfPresent(m, aCookie))
	}
	return s, nil
}

// heldState is the state bypass keeps for c's socket since it paired it,
// and c's cookie.
func (in *Install) heldState(c *net.TCPConn) (bypassSockState, uint64, error) {
	raw, err := c.SyscallConn()
	if err != nil {
		return bypassSockState{}, 0, err
	}
	var st bypassSockState
	var cookie uint64
	var lookupErr error
	if err := raw.Control(func(fd uintptr) {
		if cookie, lookupErr = unix.GetsockoptUint64(int(fd), unix.SOL_SOCKET, unix.SO_COOKIE); lookupErr != nil {
			return
		}
		lookupErr = in.maps["sock_states"].Lookup(int32(fd), &st)
	}); err != nil {
		return bypassSockState{}, 0, err
	}
	if errors.Is(lookupErr, ebpf.ErrKeyNotExist) {
		return bypassSockState{}, 0, ErrNotHeld
	}
	if lookupErr != nil {
		return bypassSockState{}, 0, fmt.Errorf("bypass: look up a socket: %w", lookupErr)
	}
	return st, cookie, nil
}

// Bytes says how many bytes went straight from a's peer to b's peer (ab)
// and back (ba), in how many sends. Before Close it reads the kernel's counts
// as they are; after, what Close found. An error names a count that could
// not be read (it counts 0).
func (s *Shortcut) Bytes() (ab, ba, sends uint64, err error) {
	a, b := s.aFinal, s.bFinal
	if !s.closed {
		a, b, err = s.counts()
	}
	return a.Bytes, b.Bytes, a.Sends + b.Sends, err
}

// counts reads both entries; one that could not be read counts 0. One gone
// means the map's LRU evicted it (more shortcuts at once than the map
// holds): its bytes cannot be told.
func (s *Shortcut) counts() (a, b bypassShortcut, err error) {
	var errs []error
	for _, e := range []struct {
		cookie uint64
		to     *bypassShortcut
	}{{s.aCookie, &a}, {s.bCookie, &b}} {
		if err := s.m.Lookup(e.cookie, e.to); err != nil {
			*e.to = bypassShortcut{}
			errs = append(errs, fmt.Errorf("bypass: read a shortcut's counts: %w", err))
		}
	}
	return a, b, errors.Join(errs...)
}

// Close removes the shortcut, keeping its counts for Bytes. At any time: the
// peers' later sends take the join again, behind what passed it by (a
// reader takes redirected bytes before TCP's). An error says the counts
// could not be read or an entry not removed; the shortcut is gone either way
// (an entry left behind matches no later socket: cookies are not reused).
func (s *Shortcut) Close() error {
	if s.closed {
		return nil
	}
	a, b, countErr := s.counts()
	s.aFinal, s.bFinal, s.closed = a, b, true
	return errors.Join(countErr, deleteIfPresent(s.m, s.aCookie), deleteIfPresent(s.m, s.bCookie))
}

func deleteIfPresent(m *ebpf.Map, key uint64) error {
	if err := m.Delete(key); err != nil && !errors.Is(err, ebpf.ErrKeyNotExist) {
		return fmt.Errorf("bypass: remove a shortcut: %w", err)
	}
	return nil
}
