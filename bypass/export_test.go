package bypass

import (
	"encoding/binary"
	"time"

	"github.com/cilium/ebpf"
	"golang.org/x/sys/unix"
)

// RedirectSettle is how long a leave or a removal waits for redirects in flight.
const RedirectSettle = redirectSettle

// WithSettle is o with the programs' settle (how long a leave waits for
// redirects in flight) set to d.
func WithSettle(o Options, d time.Duration) Options {
	o.settle = d
	return o
}

// WithSmallWriteWindow is o with the window in which 64 small sends make a
// stream (smallWriteWindow) set to d.
func WithSmallWriteWindow(o Options, d time.Duration) Options {
	o.smallWindow = d
	return o
}

// WithBehindReader is o with the TCP bytes in a row behind a reader that
// send its connection back to TCP (BehindBytes) set to bytes, judged once a
// socket made sends (BehindSends; 0 keeps it); bytes ^0: never.
func WithBehindReader(o Options, bytes, sends uint32) Options {
	o.behindBytes, o.behindSends = bytes, sends
	return o
}

// CgroupCounted says whether cgroup_sends holds an entry for the cgroup id.
func (in *Install) CgroupCounted(id uint64) bool {
	var v []bypassCgroupTraffic
	return in.maps[cgroupSendsMap].Lookup(id, &v) == nil
}

// FreshenReaderPorts makes every learned reader port seen now, so a test
// on a slow machine (a kernel under qemu) does not see it expire midway.
func (in *Install) FreshenReaderPorts() error {
	var ts unix.Timespec
	if err := unix.ClockGettime(unix.CLOCK_MONOTONIC, &ts); err != nil {
		return err
	}
	return in.setReaderPortsSeen(func(uint64) uint64 { return uint64(ts.Nano()) })
}

// AgeReaderPorts moves every learned reader port's last sighting back by d,
// as if d had passed.
func (in *Install) AgeReaderPorts(d time.Duration) error {
	return in.setReaderPortsSeen(func(seen uint64) uint64 { return seen - uint64(d) })
}

func (in *Install) setReaderPortsSeen(seen func(uint64) uint64) error {
	return rewrite[bypassReaderPort](in.maps[readerPortsMap], func(v *bypassReaderPortSeen) { v.SeenNs = seen(v.SeenNs) })
}

// AgeBriefPorts moves every brief port's last brief close back by d, as if
// d had passed.
func (in *Install) AgeBriefPorts(d time.Duration) error {
	return rewrite[bypassBriefKey](in.maps[briefPortsMap], func(v *bypassBriefPort) { v.SeenNs -= uint64(d) })
}

// rewrite changes every entry of m with change; K is m's key type.
func rewrite[K, V any](m *ebpf.Map, change func(*V)) error {
	var k K
	var v V
	var keys []K
	var vals []V
	it := m.Iterate()
	for it.Next(&k, &v) {
		change(&v)
		keys = append(keys, k)
		vals = append(vals, v)
	}
	if err := it.Err(); err != nil {
		return err
	}
	for i := range keys {
		if err := m.Put(keys[i], vals[i]); err != nil {
			return err
		}
	}
	return nil
}

// ForgeISNClaims marks every registration by sequence numbers still
// unclaimed as claimed by a client that is not there (netns 0xdead), with
// its nonce bound, as a forger that held a handshake's numbers and claimed
// first leaves it. Returns how many it marked.
func (in *Install) ForgeISNClaims() (int, error) {
	m := in.maps[isnHandshakesMap]
	k, v := make([]byte, m.KeySize()), make([]byte, m.ValueSize())
	var keys [][]byte
	it := m.Iterate()
	for it.Next(&k, &v) {
		keys = append(keys, append([]byte(nil), k...))
	}
	if err := it.Err(); err != nil {
		return 0, err
	}
	n := 0
	for _, key := range keys {
		if err := m.Lookup(key, &v); err != nil {
			continue
		}
		// struct pending: server_netns, client_netns, state, nonce.
		if binary.NativeEndian.Uint32(v[16:]) != 0 {
			continue
		}
		binary.NativeEndian.PutUint64(v[8:], 0xdead)
		binary.NativeEndian.PutUint32(v[16:], 1)      // PENDING_CLAIMED
		binary.NativeEndian.PutUint32(v[20:], 0x5eed) // the forger's nonce
		if err := m.Update(key, v, 0); err != nil {
			return n, err
		}
		n++
	}
	return n, nil
}

// EvictBack removes the shortcut's entry for its b socket, as the map's LRU
// does when more shortcuts are open than it holds.
func (s *Shortcut) EvictBack() error { return s.m.Delete(s.bCookie) }

// TimerSlots says how many timer slots the install ever handed out and how
// many are back in the pool. It pops the pool and pushes it back: call it
// while no connection opens or closes.
func (in *Install) TimerSlots() (taken, free int, err error) {
	var ever uint32 // struct timer_pool: taken
	if err := in.maps[timerPoolMap].Lookup(uint32(0), &ever); err != nil {
		return 0, 0, err
	}
	var slots []uint32
	var slot uint32
	for in.maps[freeTimersMap].LookupAndDelete(nil, &slot) == nil {
		slots = append(slots, slot)
	}
	for i := len(slots) - 1; i >= 0; i-- {
		if err := in.maps[freeTimersMap].Update(nil, slots[i], ebpf.UpdateAny); err != nil {
			return 0, 0, err
		}
	}
	return int(ever), len(slots), nil
}

// RefuseIterators makes the install's drain fail as on a kernel that
// refuses its iterator.
func (in *Install) RefuseIterators() { in.refuseIterators = true }
