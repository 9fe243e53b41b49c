package sockindex

import (
	"errors"
	"fmt"
	"net/netip"
	"path/filepath"
	"time"

	"github.com/cilium/ebpf"
	"github.com/cilium/ebpf/link"
	"golang.org/x/sys/unix"

	"github.com/shunt-project/shunt/host"
)

// Lookup returns the sockets connected to one backend. It visits that
// backend's slots only, FIND_SLOTS of them per BPF_PROG_RUN.
func (ix *Index) Lookup(b Backend) ([]Socket, error) {
	var boot time.Time
	var out []Socket
	key := b.key()
	fc := newFindCtx(&key)
	for start := uint32(0); ; start += findSlots {
		fc.setStart(start)
		if _, err := ix.find.Run(&ebpf.RunOptions{Context: fc.buf, ContextOut: fc.buf}); err != nil {
			return nil, fmt.Errorf("look up backend: %w", err)
		}
		present := fc.present()
		for i := 0; present != 0 && i < int(findSlots); i++ {
			if present&(1<<i) == 0 {
				continue
			}
			if boot.IsZero() {
				boot = bootTime()
			}
			e := fc.entry(i)
			out = append(out, socketOf(&key, &e, boot))
		}
		if start+findSlots >= fc.high() {
			return out, nil
		}
	}
}

// Find returns the sockets connected to addr on port (any port if 0) for
// the given protocols. With a port it costs a lookup per protocol; without
// one it also walks the list of backends (not of sockets).
func (ix *Index) Find(addr netip.Addr, port uint16, protos ...Proto) ([]Socket, error) {
	var backends []Backend
	if port != 0 {
		for _, p := range protos {
			backends = append(backends, Backend{Addr: addr, Port: port, Proto: p})
		}
	} else {
		all, err := ix.Backends()
		if err != nil {
			return nil, err
		}
		for _, b := range all {
			if b.Addr == addr.Unmap() && b.Proto.In(protos) {
				backends = append(backends, b.Backend)
			}
		}
	}
	var out []Socket
	for _, b := range backends {
		s, err := ix.Lookup(b)
		if err != nil {
			return nil, err
		}
		out = append(out, s...)
	}
	return out, nil
}

// BackendStats is a backend with its number of live sockets.
type BackendStats struct {
	Backend
	Live  uint64
	Slots uint32 // the high-water mark a lookup visits
}

// Backends lists every backend the index has seen.
func (ix *Index) Backends() ([]BackendStats, error) {
	var out []BackendStats
	var k indexBackend
	var st indexBackendState
	it := ix.maps.Backends.Iterate()
	for it.Next(&k, &st) {
		out = append(out, BackendStats{Backend: backendOf(&k), Live: st.Live, Slots: st.High})
	}
	if err := it.Err(); err != nil {
		return nil, fmt.Errorf("list backends: %w", err)
	}
	return out, nil
}

// List returns every indexed socket (it walks the whole index).
func (ix *Index) List() ([]Socket, error) {
	boot := bootTime()
	var out []Socket
	var k indexSlotKey
	var e indexEntry
	it := ix.maps.SockIndex.Iterate()
	for it.Next(&k, &e) {
		out = append(out, socketOf(&k.Backend, &e, boot))
	}
	if err := it.Err(); err != nil {
		return nil, fmt.Errorf("list index: %w", err)
	}
	return out, nil
}

// NetnsOwner returns a process last seen connecting a socket in the network
// namespace with this cookie.
func (ix *Index) NetnsOwner(netnsCookie uint64) (int, bool) {
	var tgid uint32
	if err := ix.maps.NetnsOwners.Lookup(&netnsCookie, &tgid); err != nil {
		return 0, false
	}
	return int(tgid), true
}

// Counters are the index programs' event counts since enable.
type Counters struct {
	Added   uint64 `json:"added" help:"Sockets added to the index."`
	Removed uint64 `json:"removed" help:"Sockets removed from the index (closed, or reconnected elsewhere)."`
	Full    uint64 `json:"not_indexed_map_full" help:"Sockets the index could not take: a map was full (a reap by index may miss them)."`
	Filled  uint64 `json:"udp_local_learnt" help:"Connected UDP sockets whose local address was learnt at their first send."`
	// NotRemoved entries stay in the index after their socket closed; a
	// reap by index finds them and destroys nothing.
	NotRemoved uint64 `json:"not_removed_lock_failed" help:"Closed sockets whose entry stayed in the index: the map's lock refused its removal four times."`
}

// Counters sums the per-CPU counters.
func (ix *Index) Counters() (Counters, error) {
	var c Counters
	for i, dst := range []*uint64{&c.Added, &c.Removed, &c.Full, &c.Filled, &c.NotRemoved} {
		var per []uint64
		err := ix.maps.IndexCounters.Lookup(uint32(i), &per)
		if errors.Is(err, ebpf.ErrKeyNotExist) {
			// An index enabled by an older shunt counts less.
			continue
		}
		if err != nil {
			return c, fmt.Errorf("read counters: %w", err)
		}
		for _, v := range per {
			*dst += v
		}
	}
	return c, nil
}

func backendOf(k *indexBackend) Backend {
	return Backend{Addr: netip.AddrFrom16(k.Addr).Unmap(), Port: k.Port, Proto: Proto(k.Proto)}
}

func socketOf(k *indexBackend, e *indexEntry, boot time.Time) Socket {
	b := backendOf(k)
	flags := indexEntryFlags(e.Flags)
	s := Socket{
		Proto:       b.Proto,
		Family:      int(e.Family),
		Remote:      netip.AddrPortFrom(b.Addr, b.Port),
		Cookie:      e.Cookie,
		NetnsCookie: e.NetnsCookie,
		Owner:       int(e.OwnerTgid),
		Since:       boot.Add(time.Duration(e.SinceNs)),
		LocalKnown:  flags&indexEntryFlagsENTRY_LOCAL_UNKNOWN == 0,
		Seeded:      flags&indexEntryFlagsENTRY_SEEDED != 0,
		KeepsPort:   flags&indexEntryFlagsENTRY_BOUND != 0,
	}
	if s.LocalKnown {
		s.Local = netip.AddrPortFrom(netip.AddrFrom16(e.Local).Unmap(), e.LocalPort)
	}
	return s
}

// bootTime is when CLOCK_BOOTTIME was zero, in wall-clock time.
func bootTime() time.Time {
	var ts unix.Timespec
	_ = unix.ClockGettime(unix.CLOCK_BOOTTIME, &ts)
	return time.Now().Add(-time.Duration(ts.Nano()))
}

// Status is what `shunt status` shows of the index.
type Status struct {
	Dir      string   `json:"dir"`
	CgroupID uint64   `json:"cgroup_id"` // the cgroup whose sockets are indexed
	Cgroup   string   `json:"cgroup"`    // its path, "" if it was removed
	Sockets  uint64   `json:"sockets"`   // indexed now
	Backends int      `json:"backends"`  // backends seen since enable
	Counters Counters `json:"counters"`
}

// Status reports the index's cgroup, size and counters.
func (ix *Index) Status() (Status, error) {
	st := Status{Dir: ix.dir}
	var err error
	if st.Counters, err = ix.Counters(); err != nil {
		return st, err
	}
	st.Sockets = st.Counters.Added - st.Counters.Removed
	bs, err := ix.Backends()
	if err != nil {
		return st, err
	}
	st.Backends = len(bs)
	l, err := link.LoadPinnedLink(filepath.Join(ix.dir, linksDir, "release"), nil)
	if err != nil {
		return st, fmt.Errorf("open index link: %w", err)
	}
	defer l.Close()
	info, err := l.Info()
	if err != nil {
		return st, fmt.Errorf("read index link: %w", err)
	}
	if cg := info.Cgroup(); cg != nil {
		st.CgroupID = cg.CgroupId
		st.Cgroup = host.CgroupPathByID(cg.CgroupId)
	}
	return st, nil
}
