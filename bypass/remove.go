package bypass

import (
	"bytes"
	"context"
	"encoding/binary"
	"errors"
	"fmt"
	"net/netip"
	"os"
	"sort"
	"strconv"
	"time"

	"github.com/cilium/ebpf"

	"github.com/shunt-project/shunt/reap"
)

// ErrBusy means some bypassed sockets could not leave the sockhash yet:
// Unread of them hold bytes their readers have not read (removing them now
// would drop those bytes), and Unheld are open in no process shunt can see
// (a server socket its listener has not accepted yet), so shunt cannot look.
type ErrBusy struct{ Unread, Unheld int }

func (e ErrBusy) Error() string {
	var what string
	switch {
	case e.Unheld == 0:
		what = fmt.Sprintf("%d bypassed socket(s) still hold unread data", e.Unread)
	case e.Unread == 0:
		what = fmt.Sprintf("%d bypassed socket(s) are not accepted by their server yet", e.Unheld)
	default:
		what = fmt.Sprintf("%d bypassed socket(s) still hold unread data and %d are not accepted by their server yet", e.Unread, e.Unheld)
	}
	return what + "; nothing was lost: new sends already take the TCP path, run 'shunt bypass disable --all' again once their readers have caught up, or add --force to reset those connections and remove shunt now"
}

// Sockets is how many sockets kept the install in place.
func (e ErrBusy) Sockets() int { return e.Unread + e.Unheld }

// Remove takes bypass off the host without losing a byte: it detaches every
// cgroup, switches all sends to the TCP path, waits until no socket holds
// redirected bytes that its reader has not consumed, removes the sockets from
// the sockhash and only then unpins everything.
//
// If readers do not catch up before ctx ends, it returns ErrBusy and leaves
// the install in place (draining, no cgroup attached).
func (in *Install) Remove(ctx context.Context) error {
	_, err := in.remove(ctx, false)
	return err
}

// Stuck is a socket a forced removal found still in the sockhash when it
// stopped waiting, and what resetting its connection gave.
type Stuck struct {
	Netns  uint64
	Local  netip.AddrPort
	Remote netip.AddrPort
	Cookie uint64
	// Unread: it held redirected bytes its reader had not read. Otherwise
	// shunt could not look (a socket its server has not accepted, or a
	// kernel that refused the drain's iterator).
	Unread bool
	// Err is what the reset said: nil (reset), an error wrapping
	// os.ErrNotExist (the socket had closed by then: its peer's reset came
	// first) or a failure, in which case its reader was not told that the
	// bytes redirected to it and not read went with the install.
	Err error

	key bypassSockKey
}

// ForceRemove is Remove for an install that cannot wait: when readers have
// not caught up by the time ctx ends, or the kernel refuses the drain's
// iterator, it resets the connection of each socket still in the sockhash
// and removes the install all the same. Taking the socket out of the
// sockhash drops what was redirected to it; reset, its reader and its peer
// see the connection fail instead of a stream with bytes missing. It
// returns the sockets it reset.
func (in *Install) ForceRemove(ctx context.Context) ([]Stuck, error) {
	return in.remove(ctx, true)
}

func (in *Install) remove(ctx context.Context, force bool) ([]Stuck, error) {
	cgs, err := in.Cgroups()
	if err != nil {
		return nil, err
	}
	for _, cg := range cgs {
		if _, err := in.Detach(cg.ID); err != nil {
			return nil, err
		}
	}
	if err := in.setDraining(true); err != nil {
		return nil, err
	}
	// A send that read the control word just before it flipped finishes its
	// redirect within its own syscall; give those a moment to land.
	time.Sleep(redirectSettle)

	var stuck []Stuck
	if unread, err := in.drain(ctx); err != nil {
		if !force {
			if !errors.As(err, new(ErrBusy)) {
				err = fmt.Errorf("%w; nothing was dropped: new sends take the TCP path, and --force resets the connections still bypassed and removes shunt", err)
			}
			return nil, err
		}
		if stuck, err = in.resetHeld(unread); err != nil {
			return stuck, err
		}
	}

	// Rename first so a concurrent reader never sees half an install.
	gone := in.dir + "-old-" + strconv.Itoa(os.Getpid())
	if err := os.Rename(in.dir, gone); err != nil {
		return stuck, fmt.Errorf("remove %s: %w", in.dir, err)
	}
	in.Close()
	if err := os.RemoveAll(gone); err != nil {
		return stuck, fmt.Errorf("unpin %s: %w", gone, err)
	}
	return stuck, nil
}

// resetHeld resets the connection of every socket left in the sockhash
// (unread: those the drain saw holding unread bytes; nil if it could not
// look), then takes it out of the sockhash. In that order its reader never
// sees the stream go on with bytes missing: what it reads after the reset is
// the reset's error. Those with unread bytes go first; their peers, reset
// by them, have closed by their turn.
func (in *Install) resetHeld(unread map[bypassSockKey]bool) ([]Stuck, error) {
	var stuck []Stuck
	var key bypassSockKey
	var cookie uint64
	hash := in.maps["sock_hash"]
	it := hash.Iterate()
	for it.Next(&key, &cookie) {
		local, remote := key.addrs()
		stuck = append(stuck, Stuck{Netns: key.Netns, Local: local, Remote: remote, Cookie: cookie, Unread: unread[key], key: key})
	}
	if err := it.Err(); err != nil {
		return nil, fmt.Errorf("read sockhash: %w", err)
	}
	sort.SliceStable(stuck, func(a, b int) bool { return stuck[a].Unread && !stuck[b].Unread })
	for i := range stuck {
		s := &stuck[i]
		s.Err = reap.DestroyTCP(reap.TCPSocket{Netns: s.Netns, Local: s.Local, Remote: s.Remote, Cookie: s.Cookie})
		if err := hash.Delete(s.key); err != nil && !errors.Is(err, ebpf.ErrKeyNotExist) {
			return stuck, fmt.Errorf("take %s out of the sockhash: %w", s.Local, err)
		}
	}
	return stuck, nil
}

// drain removes sockets with empty redirect queues from the sockhash until
// none is left, or returns ErrBusy when ctx ends first, with the sockets
// its last pass saw holding unread bytes.
func (in *Install) drain(ctx context.Context) (map[bypassSockKey]bool, error) {
	if in.refuseIterators {
		return nil, errors.New("load BPF iterators: refused (test)")
	}
	iter, err := in.loadIterators()
	if err != nil {
		return nil, err
	}
	defer iter.Close()
	for {
		buf, err := runIter(iter.Drain)
		if err != nil {
			return nil, fmt.Errorf("drain: %w", err)
		}
		unread := map[bypassSockKey]bool{}
		for _, k := range decodeKeys(buf) {
			unread[k] = true
		}
		// What the iterator did not see is open in no process: it may
		// hold redirected bytes all the same, so it is not deleted.
		var busy ErrBusy
		var key bypassSockKey
		var cookie uint64
		it := in.maps["sock_hash"].Iterate()
		for it.Next(&key, &cookie) {
			if unread[key] {
				busy.Unread++
			} else {
				busy.Unheld++
			}
		}
		if err := it.Err(); err != nil {
			return nil, fmt.Errorf("drain: read sockhash: %w", err)
		}
		if busy.Sockets() == 0 {
			return nil, nil
		}
		select {
		case <-ctx.Done():
			return unread, busy
		case <-time.After(20 * time.Millisecond):
		}
	}
}

func decodeKeys(buf []byte) []bypassSockKey {
	keys := make([]bypassSockKey, len(buf)/binary.Size(bypassSockKey{}))
	_ = binary.Read(bytes.NewReader(buf), binary.NativeEndian, keys)
	return keys
}

type iterators struct {
	Drain *ebpf.Program `ebpf:"shunt_iter_drain"`
	Flows *ebpf.Program `ebpf:"shunt_iter_flows"`
}

func (it *iterators) Close() {
	it.Drain.Close()
	it.Flows.Close()
}

// loadIterators loads the iterator programs bound to the pinned maps.
func (in *Install) loadIterators() (*iterators, error) {
	var it iterators
	if err := in.loadBound(&it, nil); err != nil {
		return nil, fmt.Errorf("load BPF iterators: %w", err)
	}
	return &it, nil
}

// loadBound loads the programs objs names against the install's pinned
// maps, configured as the install's own programs are. An install made by
// an older shunt keeps the shapes its maps were made with: the spec takes
// them, so programs that do not use a map whose shape changed still load
// (a program that reads past an older value is refused by the verifier).
// vars sets constants of the program's own (as the listener watch).
func (in *Install) loadBound(objs any, vars map[string]any) error {
	spec, err := newSpec()
	if err != nil {
		return err
	}
	if cfg, err := in.config(); err == nil {
		if err := spec.Variables["cfg"].Set(cfg); err != nil {
			return err
		}
	}
	for name, v := range vars {
		if err := spec.Variables[name].Set(v); err != nil {
			return fmt.Errorf("configure %s: %w", name, err)
		}
	}
	if err := setStatesMapID(spec, in.maps[bypassMapSockStates]); err != nil {
		return err
	}
	for name, m := range in.maps {
		ms, ok := spec.Maps[name]
		if !ok || ms.Compatible(m) == nil {
			continue
		}
		ms.ValueSize, ms.MaxEntries = m.ValueSize(), m.MaxEntries()
		ms.Value = nil
	}
	return spec.LoadAndAssign(objs, &ebpf.CollectionOptions{MapReplacements: in.maps})
}

// setStatesMapID tells the programs that reach sockets through their files
// (the iterators, the splice refusal) the id of the install's sock_states
// map: they find shunt's storage of a socket by it (sockopt.h, held_state).
func setStatesMapID(spec *ebpf.CollectionSpec, states *ebpf.Map) error {
	info, err := states.Info()
	if err != nil {
		return fmt.Errorf("read the socket storage map's id: %w", err)
	}
	id, _ := info.ID()
	if err := spec.Variables["states_map_id"].Set(uint32(id)); err != nil {
		return fmt.Errorf("configure states_map_id: %w", err)
	}
	return nil
}
