package bypass

import (
	"errors"
	"fmt"

	"github.com/cilium/ebpf"
	"golang.org/x/sys/unix"
)

// StallScanInterval is how often the guard runs the stall scan: a held
// socket whose reader reads nothing for this long with bytes queued that
// FIONREAD does not count goes back to TCP and is woken, so it is found
// within twice this. A pass visits every open file on the host: 6.6 ms
// with 16,000 (BenchmarkStallScan), 1.3% of one CPU at this interval.
const StallScanInterval = scanStallAfter

// StallScan finds readers that wait while bytes sit queued for them,
// whatever the kernel's FIONREAD says and whatever they wait for, and sends
// their connections back to TCP (the guard wakes them when they have left).
// It visits every open file on the host, as `shunt flows` does.
type StallScan struct {
	prog *ebpf.Program
	refs *ebpf.Map // peer_refs: empty when no socket is held
}

// OpenStallScan loads the scan against the install's maps. An install made
// by an older shunt has no room for the scan's state: ErrNoStallScan.
func (in *Install) OpenStallScan() (*StallScan, error) {
	var objs struct {
		Stalls *ebpf.Program `ebpf:"shunt_iter_stalls"`
	}
	if err := in.loadBound(&objs, nil); err != nil {
		if spec, serr := newSpec(); serr == nil && in.maps["peer_refs"].ValueSize() != spec.Maps["peer_refs"].ValueSize {
			return nil, ErrNoStallScan
		}
		return nil, fmt.Errorf("load the stall scan: %w", err)
	}
	return &StallScan{prog: objs.Stalls, refs: in.maps["peer_refs"]}, nil
}

// ErrNoStallScan: the install predates the stall scan.
var ErrNoStallScan = errors.New("this install was made by an older shunt and has no stall scan: run 'shunt bypass disable --all' and enable again to get it")

// Run scans once and returns how many sockets it sent back to TCP. With no
// socket held there is nothing to scan, and it returns at once.
func (s *StallScan) Run() (int, error) {
	key := make([]byte, s.refs.KeySize())
	if err := s.refs.NextKey(nil, &key); errors.Is(err, ebpf.ErrKeyNotExist) {
		return 0, nil
	}
	buf, err := runIter(s.prog)
	if err != nil {
		return 0, fmt.Errorf("stall scan: %w", err)
	}
	return len(decodeKeys(buf)), nil
}

// RunIn scans the open files of one process (pid) at once, and returns how
// many of its sockets it sent back to TCP: run when FIONREAD told a reader
// of that process too few bytes (ToldShort), whose socket the scan sends
// back whatever its reader did since, while those bytes are still hidden.
// A kernel that cannot filter its task iterators by process (before 6.1)
// gets a scan of every file.
func (s *StallScan) RunIn(pid int) (int, error) {
	buf, err := runIterIn(s.prog, pid)
	switch {
	case errors.Is(err, unix.ESRCH):
		return 0, nil // gone: nobody waits
	case errors.Is(err, unix.EINVAL):
		return s.Run()
	}
	if err != nil {
		return 0, fmt.Errorf("stall scan of pid %d: %w", pid, err)
	}
	return len(decodeKeys(buf)), nil
}

// WakeDelivered tells the stall watch that the guard has just woken the
// reader of the socket with this cookie: a reader it woke is given its time
// to answer from now, not from when it asked (the guard may have been
// behind). An install made before this has nowhere to tell it: nil.
func (in *Install) WakeDelivered(cookie uint64) error {
	m, ok := in.maps[wakesDeliveredMap]
	if !ok {
		return nil
	}
	if err := m.Put(cookie, uint64(monotonicNow())); err != nil {
		return fmt.Errorf("note the wake-up: %w", err)
	}
	return nil
}

// Close releases the scan's program.
func (s *StallScan) Close() error { return s.prog.Close() }
