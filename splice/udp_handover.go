package splice

import (
	"errors"
	"fmt"
	"maps"
	"net"
	"slices"
	"time"
	"unsafe"

	"github.com/cilium/ebpf"
	"golang.org/x/sys/unix"
)

// UDPObjects are the descriptors of a UDPSplicer's BPF objects, in this
// order: udp_socks, udp_dirs, udp_slots, the verdict program, its attachment
// (as in Objects).
type UDPObjects [5]int

// UDPPairState is a frozen UDP pair. Its kernel counters stay in udp_dirs,
// which travels with the objects.
type UDPPairState struct {
	Index    uint32       `json:"index"`
	CopiedAB uint64       `json:"copied_ab,omitempty"`
	CopiedBA uint64       `json:"copied_ba,omitempty"`
	RefusedA uint64       `json:"refused_a,omitempty"`
	RefusedB uint64       `json:"refused_b,omitempty"`
	A        *net.UDPConn `json:"-"`
	B        *net.UDPConn `json:"-"`
}

// UDPStateVersion names the layout of what a UDP hand-over carries.
func UDPStateVersion() string {
	return fmt.Sprintf("splice-udp-dir-%d-pair-1", unsafe.Sizeof(spliceudpSpliceUdpDir{}))
}

// Freeze stops every pair's repair goroutines (the kernel keeps
// forwarding) and returns their state and the object descriptors (owned by
// the UDPSplicer: send them before Release). It takes no more joins.
func (s *UDPSplicer) Freeze() (UDPObjects, []UDPPairState) {
	s.mu.Lock()
	s.closed = true
	pairs := slices.Collect(maps.Values(s.pairs))
	s.mu.Unlock()
	var out []UDPPairState
	for _, p := range pairs {
		p.mu.Lock()
		p.closed = true // no repair from here on
		p.mu.Unlock()
		p.a.SetReadDeadline(time.Now())
		p.b.SetReadDeadline(time.Now())
		p.watchers.Wait()
		out = append(out, UDPPairState{Index: p.index, A: p.a, B: p.b,
			CopiedAB: p.copiedAB.Load(), CopiedBA: p.copiedBA.Load(), RefusedA: p.refused[0].Load(), RefusedB: p.refused[1].Load()})
	}
	return UDPObjects{s.objs.UdpSocks.FD(), s.objs.UdpDirs.FD(), s.objs.UdpSlots.FD(), s.objs.SpliceUdpVerdict.FD(), s.attach.FD()}, out
}

// Release lets go of a frozen UDPSplicer's objects and sockets without
// taking the pairs out of the maps (the new owner holds its own
// descriptors). Close does nothing after it.
func (s *UDPSplicer) Release() {
	s.mu.Lock()
	s.released = true
	pairs := s.pairs
	s.pairs = map[uint32]*UDPPair{}
	s.mu.Unlock()
	_ = s.attach.Release() // the new owner holds it
	s.objs.Close()
	for _, p := range pairs {
		p.a.Close()
		p.b.Close()
	}
}

// Thaw restarts a frozen UDPSplicer's repair goroutines when the hand-over
// did not happen; it takes joins again and returns the pairs.
func (s *UDPSplicer) Thaw() []*UDPPair {
	s.mu.Lock()
	s.closed = false
	pairs := slices.Collect(maps.Values(s.pairs))
	s.mu.Unlock()
	for _, p := range pairs {
		p.mu.Lock()
		p.closed = false
		p.mu.Unlock()
		p.a.SetReadDeadline(time.Time{})
		p.b.SetReadDeadline(time.Time{})
		p.start()
	}
	return pairs
}

// ResumeUDP takes over a frozen UDPSplicer's objects (descriptors received
// from its process; ResumeUDP owns them) and pairs, frozen until Thaw, as
// Resume does.
func ResumeUDP(objs UDPObjects, opts UDPOptions, states []UDPPairState) (*UDPSplicer, []*UDPPair, error) {
	if opts.MaxQueue == 0 {
		opts.MaxQueue = DefaultUDPMaxQueue
	}
	s := &UDPSplicer{maxQueue: opts.MaxQueue, pairs: map[uint32]*UDPPair{}, closed: true}
	var err error
	if s.attach, err = adopt(objs[:], []**ebpf.Map{&s.objs.UdpSocks, &s.objs.UdpDirs, &s.objs.UdpSlots}, &s.objs.SpliceUdpVerdict); err != nil {
		return nil, nil, err
	}
	slots := s.objs.UdpSocks.MaxEntries()
	if s.objs.UdpDirs.ValueSize() != uint32(unsafe.Sizeof(spliceudpSpliceUdpDir{})) {
		_ = s.attach.Release() // still the giver's, who may thaw
		s.objs.Close()
		return nil, nil, errors.New("splice: the UDP objects handed over are not this version's")
	}
	used := map[uint32]bool{}
	var pairs []*UDPPair
	for _, st := range states {
		p := newUDPPair(s, st.Index, st.A, st.B)
		p.closed = true // until Thaw
		for i, c := range []*net.UDPConn{st.A, st.B} {
			fd, ferr := socketFD(c)
			if ferr == nil {
				p.cookies[i], ferr = unix.GetsockoptUint64(fd, unix.SOL_SOCKET, unix.SO_COOKIE)
			}
			if ferr != nil {
				err = ferr
			}
		}
		if err != nil {
			st.A.Close()
			st.B.Close()
			err = nil
			continue
		}
		p.copiedAB.Store(st.CopiedAB)
		p.copiedBA.Store(st.CopiedBA)
		p.refused[0].Store(st.RefusedA)
		p.refused[1].Store(st.RefusedB)
		s.pairs[st.Index] = p
		used[st.Index] = true
		pairs = append(pairs, p)
	}
	s.free = freeIndices(int(slots/2), used)
	return s, pairs, nil
}
