package splice

import (
	"errors"
	"fmt"
	"maps"
	"net"
	"slices"
	"unsafe"

	"github.com/cilium/ebpf"
	"golang.org/x/sys/unix"

	"github.com/shunt-project/shunt/internal/sockmap"
)

// Handing a Splicer over to another process, so that joined pairs keep
// flowing across a restart: the old process freezes every pair where it
// stands (goroutines stopped, sockets open and still in the map, so the
// kernel keeps forwarding), passes the BPF objects and sockets on, and the
// new process resumes the pairs with their byte counters. No socket ever
// leaves the map: that would drop the bytes queued on its psock.

// StateVersion names the layout of what a hand-over carries (the shared
// direction state and PairState); only equal versions can hand over.
func StateVersion() string {
	return fmt.Sprintf("splice-dir-%d-pair-1", unsafe.Sizeof(spliceSpliceDir{}))
}

// Objects are the descriptors of a Splicer's BPF objects, in this order:
// socks, dirs, slots, the verdict program, its attachment (the link, or
// socks again where the verdict is attached on the map).
type Objects [5]int

// DirState is what a direction's user-space half knows.
type DirState struct {
	UserRead  uint64 `json:"user_read"`
	UserWrote uint64 `json:"user_wrote"`
	DstOrigin uint64 `json:"dst_origin"`
	Pending   []byte `json:"-"`               // to write to dst before anything else (up to 256 KiB)
	Ended     bool   `json:"ended,omitempty"` // EOF already forwarded
}

// PairState is a frozen pair.
type PairState struct {
	Index    uint32       `json:"index"`
	UserOnly bool         `json:"user_only,omitempty"`
	AB       DirState     `json:"ab"`
	BA       DirState     `json:"ba"`
	A        *net.TCPConn `json:"-"`
	B        *net.TCPConn `json:"-"`
}

// Freeze stops every pair and returns their state and the object
// descriptors (owned by the Splicer: send them before Release). The
// Splicer takes no more joins.
func (s *Splicer) Freeze() (Objects, []PairState) {
	s.mu.Lock()
	s.closed = true
	pairs := slices.Collect(maps.Values(s.pairs))
	s.mu.Unlock()
	var out []PairState
	for _, p := range pairs {
		if !p.freeze() {
			continue
		}
		out = append(out, PairState{Index: p.index, UserOnly: p.userOnly, A: p.a, B: p.b, AB: p.ab.state(), BA: p.ba.state()})
	}
	return Objects{s.objs.Socks.FD(), s.objs.Dirs.FD(), s.objs.Slots.FD(), s.objs.SpliceVerdict.FD(), s.attach.FD()}, out
}

// Release lets go of a frozen Splicer's objects and sockets without
// touching the pairs (the new owner holds its own descriptors).
func (s *Splicer) Release() {
	s.mu.Lock()
	s.released = true
	s.mu.Unlock()
	s.unmap()
	_ = s.attach.Release() // the new owner holds it
	s.objs.Close()
	s.mu.Lock()
	for _, p := range s.pairs {
		p.a.Close()
		p.b.Close()
	}
	s.mu.Unlock()
}

// Thaw restarts a frozen Splicer's pairs where they stand, when the
// hand-over they were frozen for did not happen; the Splicer takes joins
// again. It returns the pairs restarted (their Stopped channels are new).
func (s *Splicer) Thaw() []*Pair {
	s.mu.Lock()
	s.closed = false
	var pairs []*Pair
	for _, p := range s.pairs {
		if p.frozen.Load() {
			pairs = append(pairs, p)
		}
	}
	s.mu.Unlock()
	for _, p := range pairs {
		p.frozen.Store(false)
		p.start()
	}
	return pairs
}

func (d *direction) state() DirState {
	return DirState{UserRead: d.userRead.Load(), UserWrote: d.userWrote.Load(), DstOrigin: d.dstOrigin, Pending: d.pending, Ended: d.ended}
}

// Resume takes over a frozen Splicer's objects (descriptors received from
// its process; Resume owns them) and pairs. The pairs stay frozen, and the
// Splicer takes no joins, until Thaw: until then Release gives all of it
// up without touching a pair.
func Resume(objs Objects, opts Options, states []PairState) (*Splicer, []*Pair, error) {
	if opts.MaxInflight == 0 {
		opts.MaxInflight = DefaultMaxInflight
	}
	s := &Splicer{maxInflight: opts.MaxInflight, pairs: map[uint32]*Pair{}, closed: true}
	var err error
	if s.attach, err = adopt(objs[:], []**ebpf.Map{&s.objs.Socks, &s.objs.Dirs, &s.objs.Slots}, &s.objs.SpliceVerdict); err != nil {
		return nil, nil, err
	}
	slots := s.objs.Socks.MaxEntries()
	if s.objs.Dirs.MaxEntries() != slots || s.objs.Dirs.ValueSize() != uint32(unsafe.Sizeof(spliceSpliceDir{})) {
		s.Release()
		return nil, nil, errors.New("splice: the objects handed over are not this version's")
	}
	size := int(slots) * int(unsafe.Sizeof(spliceSpliceDir{}))
	if s.mem, err = unix.Mmap(s.objs.Dirs.FD(), 0, size, unix.PROT_READ|unix.PROT_WRITE, unix.MAP_SHARED); err != nil {
		_ = s.attach.Release() // still the giver's, who may thaw
		s.objs.Close()
		return nil, nil, fmt.Errorf("splice: map state: %w", err)
	}
	used := map[uint32]bool{}
	var pairs []*Pair
	for _, st := range states {
		p := &Pair{s: s, index: st.Index, a: st.A, b: st.B, userOnly: st.UserOnly, done: make(chan struct{})}
		p.frozen.Store(true)
		if p.ab, err = resumeDirection(p, "a->b", st.A, st.B, 2*st.Index, st.AB); err == nil {
			p.ba, err = resumeDirection(p, "b->a", st.B, st.A, 2*st.Index+1, st.BA)
		}
		if err != nil {
			st.A.Close()
			st.B.Close()
			continue
		}
		p.joined.Store(true)
		s.pairs[st.Index] = p
		used[st.Index] = true
		pairs = append(pairs, p)
	}
	s.free = freeIndices(int(slots/2), used)
	return s, pairs, nil
}

func resumeDirection(p *Pair, name string, src, dst *net.TCPConn, slot uint32, st DirState) (*direction, error) {
	d := &direction{p: p, name: name, src: src, dst: dst, slot: slot, dstOrigin: st.DstOrigin, pending: st.Pending, ended: st.Ended}
	var err error
	if d.srcFD, err = socketFD(src); err != nil {
		return nil, err
	}
	if d.dstFD, err = socketFD(dst); err != nil {
		return nil, err
	}
	if d.srcRaw, err = src.SyscallConn(); err != nil {
		return nil, err
	}
	if d.cookie, err = unix.GetsockoptUint64(d.srcFD, unix.SOL_SOCKET, unix.SO_COOKIE); err != nil {
		return nil, err
	}
	d.shared = p.s.dir(slot)
	d.userRead.Store(st.UserRead)
	d.userWrote.Store(st.UserWrote)
	return d, nil
}

// adopt wraps object descriptors received from another process: the maps,
// then the program, then its attachment on the first map. It owns fds: on
// error none is left open.
func adopt(fds []int, maps []**ebpf.Map, prog **ebpf.Program) (*sockmap.Attachment, error) {
	taken := 0 // fds[:taken] belong to the objects made so far
	fail := func(what string, err error) (*sockmap.Attachment, error) {
		for _, m := range maps[:min(taken, len(maps))] {
			(*m).Close()
		}
		if taken > len(maps) {
			(*prog).Close()
		}
		for _, fd := range fds[taken:] {
			if fd >= 0 {
				unix.Close(fd)
			}
		}
		return nil, fmt.Errorf("splice: take over %s: %w", what, err)
	}
	// Each constructor closes its descriptor when it fails.
	var err error
	for _, m := range maps {
		if *m, err = ebpf.NewMapFromFD(fds[taken]); err != nil {
			fds[taken] = -1
			return fail("map", err)
		}
		taken++
	}
	if *prog, err = ebpf.NewProgramFromFD(fds[taken]); err != nil {
		fds[taken] = -1
		return fail("program", err)
	}
	taken++
	a, err := sockmap.Adopt(fds[taken], *maps[0], *prog, ebpf.AttachSkSKBVerdict)
	if err != nil {
		fds[taken] = -1
		return fail("attachment", err)
	}
	return a, nil
}
