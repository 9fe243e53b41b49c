// Package splice joins two connected TCP sockets inside the kernel: bytes
// arriving on one leave through the other with no process woken, while this
// package keeps what a proxy must keep (ordering, half-close, reset, and a
// bound on the memory a slow reader can pin). The programs and maps live as
// long as the Splicer; nothing is pinned.
package splice

import (
	"errors"
	"fmt"
	"maps"
	"slices"
	"sync"
	"time"
	"unsafe"

	"github.com/cilium/ebpf"
	"golang.org/x/sys/unix"

	"github.com/shunt-project/shunt/host"
	"github.com/shunt-project/shunt/internal/sockmap"
)

// DefaultMaxInflight caps the bytes one direction may hand to its outgoing
// socket that the far end has not acknowledged (the verdict also keeps it
// under half that socket's send buffer). Past it, the direction's bytes go
// through user space, whose reads pace the sender as TCP would.
const DefaultMaxInflight = 4 << 20

// DefaultMaxPairs is how many pairs one Splicer can hold at once.
const DefaultMaxPairs = 1 << 15

// maxPairsLimit bounds MaxPairs: each pair takes two slots of maps sized up
// front.
const maxPairsLimit = 1 << 20

// pairSlots resolves a MaxPairs option (0: DefaultMaxPairs) to the map
// slots its pairs take, two each.
func pairSlots(maxPairs int) (uint32, error) {
	if maxPairs == 0 {
		maxPairs = DefaultMaxPairs
	}
	if maxPairs < 1 || maxPairs > maxPairsLimit {
		return 0, fmt.Errorf("splice: max pairs %d out of range 1..%d", maxPairs, maxPairsLimit)
	}
	return uint32(2 * maxPairs), nil
}

// loadSized loads one splice object's spec with slots for maxPairs pairs in
// each of the named maps and cfg as its configuration; it returns the slots.
func loadSized[C any](load func() (*ebpf.CollectionSpec, error), maxPairs int, cfg C, names ...string) (*ebpf.CollectionSpec, uint32, error) {
	slots, err := pairSlots(maxPairs)
	if err != nil {
		return nil, 0, err
	}
	spec, err := load()
	if err != nil {
		return nil, 0, err
	}
	for _, name := range names {
		spec.Maps[name].MaxEntries = slots
	}
	if err := spec.Variables["cfg"].Set(cfg); err != nil {
		return nil, 0, fmt.Errorf("splice: configure BPF: %w", err)
	}
	return spec, slots, nil
}

// probeReads is the configuration's ProbeReads for mech: 1 where the kernel
// reads a socket only by probe.
func probeReads(mech host.Mechanisms) uint32 {
	if mech.KernelReadsByProbe() {
		return 1
	}
	return 0
}

// ErrFull means every pair slot is in use.
var ErrFull = errors.New("splice: too many joined pairs")

// Options shape a Splicer.
type Options struct {
	MaxInflight uint32 // 0: DefaultMaxInflight
	MaxPairs    int    // 0: DefaultMaxPairs
	// LostAfter bounds how long a direction that met EOF waits for bytes
	// the verdict passed to arrive before it resets both ends; 0:
	// DefaultLostAfter.
	LostAfter time.Duration
	// Mechanisms: the zero value uses the kernel's newest; tests set it
	// to run an older kernel's ways on this one.
	Mechanisms host.Mechanisms
}

// lostAfter is how long EOF waits for passed bytes.
func (s *Splicer) lostAfter() time.Duration {
	if s.lost > 0 {
		return s.lost
	}
	return DefaultLostAfter
}

// Splicer owns the verdict program and its maps, and the pairs joined by it.
type Splicer struct {
	objs        spliceObjects
	attach      *sockmap.Attachment
	mem         []byte       // dirs, shared with the verdict; nil once unmapped
	memMu       sync.RWMutex // Stats against unmap
	maxInflight uint32
	lost        time.Duration // Options.LostAfter; 0 in a Splicer received by hand-over

	mu       sync.Mutex
	free     []uint32 // pair indices
	released bool     // handed over: Close has nothing left to do
	pairs    map[uint32]*Pair
	closed   bool
}

// New loads the splice program. It needs CAP_BPF and CAP_NET_ADMIN.
func New(opts Options) (*Splicer, error) {
	if opts.MaxInflight == 0 {
		opts.MaxInflight = DefaultMaxInflight
	}
	cfg := spliceSpliceConfig{ProbeReads: probeReads(opts.Mechanisms)}
	spec, slots, err := loadSized(loadSplice, opts.MaxPairs, cfg, "socks", "dirs", "slots")
	if err != nil {
		return nil, err
	}
	s := &Splicer{maxInflight: opts.MaxInflight, lost: opts.LostAfter, pairs: map[uint32]*Pair{}}
	if err := spec.LoadAndAssign(&s.objs, nil); err != nil {
		return nil, host.Explain(fmt.Errorf("load splice program: %w", err), "joining sockets in the kernel", host.MinKernel)
	}
	s.attach, err = sockmap.Attach(s.objs.Socks, s.objs.SpliceVerdict, ebpf.AttachSkSKBVerdict, opts.Mechanisms.AttachOnMap)
	if err != nil {
		s.objs.Close()
		return nil, host.Explain(fmt.Errorf("attach splice verdict: %w", err), "joining sockets in the kernel", host.MinKernel)
	}
	size := int(slots) * int(unsafe.Sizeof(spliceSpliceDir{}))
	s.mem, err = unix.Mmap(s.objs.Dirs.FD(), 0, size, unix.PROT_READ|unix.PROT_WRITE, unix.MAP_SHARED)
	if err != nil {
		s.attach.Close()
		s.objs.Close()
		return nil, fmt.Errorf("map splice state: %w", err)
	}
	s.free = freeIndices(int(slots/2), nil)
	return s, nil
}

// dir returns the shared state of the direction whose bytes arrive on slot.
func (s *Splicer) dir(slot uint32) *spliceSpliceDir {
	off := uintptr(slot) * unsafe.Sizeof(spliceSpliceDir{})
	return (*spliceSpliceDir)(unsafe.Pointer(&s.mem[off]))
}

// Close aborts every pair still joined (both sockets are reset) and unloads
// the program; after a Freeze whose hand-over failed, too.
func (s *Splicer) Close() error {
	s.mu.Lock()
	if s.released {
		s.mu.Unlock()
		return nil
	}
	s.closed = true
	pairs := slices.Collect(maps.Values(s.pairs))
	s.mu.Unlock()
	for _, p := range pairs {
		p.Abort()
		if !p.frozen.Load() { // a frozen pair's goroutines are gone already
			<-p.Done()
		}
	}
	err := s.attach.Close()
	s.unmap()
	return errors.Join(err, s.objs.Close())
}

// unmap lets go of the shared direction state; every pair's counts are
// sealed first, for Stats.
func (s *Splicer) unmap() {
	s.mu.Lock()
	pairs := slices.Collect(maps.Values(s.pairs))
	s.mu.Unlock()
	s.memMu.Lock()
	defer s.memMu.Unlock()
	for _, p := range pairs {
		if p.ab != nil && p.ba != nil && p.final.Load() == nil {
			p.seal()
		}
	}
	unix.Munmap(s.mem)
	s.mem = nil
}

// Active is the number of pairs joined now.
func (s *Splicer) Active() int {
	s.mu.Lock()
	defer s.mu.Unlock()
	return len(s.pairs)
}

// DirectionsInKernel counts the directions, over every pair joined now, that
// the kernel forwards at the moment (not those flow control has in user
// space).
func (s *Splicer) DirectionsInKernel() int {
	s.mu.Lock()
	pairs := slices.Collect(maps.Values(s.pairs))
	s.mu.Unlock()
	n := 0
	for _, p := range pairs {
		if !p.joined.Load() {
			continue
		}
		ab, ba := p.Stats()
		for _, st := range []Stats{ab, ba} {
			if st.KernelNow {
				n++
			}
		}
	}
	return n
}

// MapEntries counts the socket and cookie entries in the kernel maps (what a
// leak would show).
func (s *Splicer) MapEntries() (socks, cookies int, err error) {
	return countEntries(s.objs.Socks, s.objs.Slots)
}

// countEntries counts the sockets in a sockmap and the cookies in its
// cookie -> slot hash.
func countEntries(sockmap, slots *ebpf.Map) (socks, cookies int, err error) {
	var cookie uint64
	for slot := uint32(0); slot < sockmap.MaxEntries(); slot++ {
		switch err := sockmap.Lookup(slot, &cookie); {
		case err == nil:
			socks++
		case !errors.Is(err, ebpf.ErrKeyNotExist):
			return 0, 0, err
		}
	}
	var slot uint32
	it := slots.Iterate()
	for it.Next(&cookie, &slot) {
		cookies++
	}
	return socks, cookies, it.Err()
}

// freeIndices lists the pair indices below pairs that used does not hold,
// highest first (the free list is taken from its end).
func freeIndices(pairs int, used map[uint32]bool) []uint32 {
	var free []uint32
	for i := pairs - 1; i >= 0; i-- {
		if !used[uint32(i)] {
			free = append(free, uint32(i))
		}
	}
	return free
}
