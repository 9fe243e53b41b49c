package bypass

import (
	"time"

	"github.com/cilium/ebpf"
	"golang.org/x/sys/unix"
)

// MapFill is how full one map is.
type MapFill struct {
	Name    string `json:"name"`
	Entries int    `json:"entries"`
	Max     uint32 `json:"max"` // 0: grows with the sockets that use it
}

// Counters are events counted by the BPF programs since install.
type Counters struct {
	Registered   uint64 `json:"handshakes_registered"`  // server-side handshakes seen
	Ambiguous    uint64 `json:"handshakes_ambiguous"`   // tuples seen from two namespaces at once: not bypassed
	RegistryFull uint64 `json:"handshakes_dropped"`     // registry full: not bypassed
	Paired       uint64 `json:"connections_paired"`     // connections bypassed
	Unpaired     uint64 `json:"connections_unpaired"`   // local peers that could not be paired
	InsertFailed uint64 `json:"insert_failed"`          // socket storage or sockhash insert failed
	FallenBack   uint64 `json:"directions_fallen_back"` // directions that left the redirect path
}

// Stats is the state of the install.
type Stats struct {
	Maps     []MapFill `json:"maps"`
	Counters Counters  `json:"counters"`
	Draining bool      `json:"draining"`
}

// Stats reads map fill and counters.
func (in *Install) Stats() (Stats, error) {
	in.SweepHandshakes()
	s := Stats{Draining: in.Draining()}
	for _, name := range []string{"sock_hash", "sock_states", "handshakes"} {
		m := in.maps[name]
		s.Maps = append(s.Maps, MapFill{Name: name, Entries: countKeys(m), Max: maxEntries(m)})
	}
	// Socket storage is keyed by socket fds; count it through the iterator.
	recs, err := in.records()
	if err != nil {
		return s, err
	}
	s.Maps[1].Entries = len(recs)
	var vals [cntMax][]uint64
	for i := range vals {
		if err := in.maps["counters"].Lookup(uint32(i), &vals[i]); err != nil {
			return s, err
		}
	}
	sum := func(i int) uint64 {
		var t uint64
		for _, v := range vals[i] {
			t += v
		}
		return t
	}
	s.Counters = Counters{
		Registered: sum(0), Ambiguous: sum(1), RegistryFull: sum(2), Paired: sum(3),
		Unpaired: sum(4), InsertFailed: sum(5), FallenBack: sum(6),
	}
	return s, nil
}

const cntMax = 7 // enum counter in bpf/include/shunt_keys.h

func maxEntries(m *ebpf.Map) uint32 {
	if m.Type() == ebpf.SkStorage {
		return 0
	}
	return m.MaxEntries()
}

// countKeys counts the entries of a map with ordinary keys.
func countKeys(m *ebpf.Map) int {
	n := 0
	var key []byte
	next := make([]byte, m.KeySize())
	for {
		if err := m.NextKey(key, &next); err != nil {
			return n
		}
		n++
		key = append(key[:0], next...)
	}
}

// SweepHandshakes deletes handshake registrations older than HandshakeTTL:
// handshakes that never completed (e.g. a client that went away after SYN).
func (in *Install) SweepHandshakes() int {
	var ts unix.Timespec
	if unix.ClockGettime(unix.CLOCK_MONOTONIC, &ts) != nil {
		return 0
	}
	now := uint64(ts.Nano())
	m := in.maps["handshakes"]
	var (
		key   bypassTuple
		val   bypassPending
		stale []bypassTuple
	)
	it := m.Iterate()
	for it.Next(&key, &val) {
		if now-val.CreatedNs > uint64(HandshakeTTL/time.Nanosecond) {
			stale = append(stale, key)
		}
	}
	for _, k := range stale {
		_ = m.Delete(k)
	}
	return len(stale)
}
