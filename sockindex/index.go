// Package sockindex keeps an index of the host's connected TCP and UDP
// sockets by backend (the address and port they are connected to), kept by
// BPF programs on a cgroup and pinned in bpffs. A lookup by backend visits
// only that backend's sockets, so it costs the same on a host with a hundred
// sockets and on one with a million.
package sockindex

import (
	"errors"
	"fmt"
	"net/netip"
	"os"
	"path/filepath"
	"time"

	"github.com/cilium/ebpf"
	"github.com/cilium/ebpf/link"

	"github.com/shunt-project/shunt/host"
	"github.com/shunt-project/shunt/internal/bpfiter"
	"github.com/shunt-project/shunt/internal/pin"
)

// DefaultPinDir is where the index lives in bpffs.
const DefaultPinDir = "/sys/fs/bpf/shunt-index"

// ErrNotEnabled means no index is pinned at the directory.
var ErrNotEnabled = errors.New("the socket index is not enabled (run: shunt index enable)")

const (
	mapsDir  = "maps"
	linksDir = "links"
	progsDir = "progs"
)

// The hooks that keep the index, each pinned as a cgroup link.
var hooks = []struct {
	name   string
	attach ebpf.AttachType
	prog   func(*indexPrograms) *ebpf.Program
}{
	{"sockops", ebpf.AttachCGroupSockOps, func(p *indexPrograms) *ebpf.Program { return p.ShuntIndexSockops }},
	{"connect4", ebpf.AttachCGroupInet4Connect, func(p *indexPrograms) *ebpf.Program { return p.ShuntIndexConnect4 }},
	{"connect6", ebpf.AttachCGroupInet6Connect, func(p *indexPrograms) *ebpf.Program { return p.ShuntIndexConnect6 }},
	{"egress", ebpf.AttachCGroupInetEgress, func(p *indexPrograms) *ebpf.Program { return p.ShuntIndexEgress }},
	{"release", ebpf.AttachCgroupInetSockRelease, func(p *indexPrograms) *ebpf.Program { return p.ShuntIndexRelease }},
}

// Index is an index pinned in bpffs.
type Index struct {
	dir  string
	maps indexMaps
	find *ebpf.Program // reads a backend's slots in one run
}

// Dir returns the pin directory.
func (ix *Index) Dir() string { return ix.dir }

// Create enables the index for the sockets of cgroup cg and its descendants
// (the cgroup v2 root: every socket of the host) and pins it at dir, or
// opens the index already there. Sockets connected before Create are added
// by a sweep of every network namespace; seeded reports how many.
func Create(dir string, cg host.Cgroup) (ix *Index, seeded int, err error) {
	if ix, err := Open(dir); err == nil {
		return ix, 0, nil
	} else if !errors.Is(err, ErrNotEnabled) {
		return nil, 0, err
	}
	err = pin.Install(dir, func(tmp string) error {
		seeded, err = build(tmp, cg)
		return err
	})
	if err != nil {
		return nil, 0, err
	}
	ix, err = Open(dir)
	if errors.Is(err, ErrNotEnabled) {
		return nil, 0, fmt.Errorf("%s exists and holds no socket index: remove it and enable again", dir)
	}
	return ix, seeded, err
}

func build(dir string, cg host.Cgroup) (int, error) {
	spec, err := loadIndex()
	if err != nil {
		return 0, fmt.Errorf("load BPF spec: %w", err)
	}
	if err := spec.Variables["icfg"].Set(indexIndexConfig{CgroupId: cg.ID, CgroupLevel: uint32(cg.Level())}); err != nil {
		return 0, fmt.Errorf("configure BPF: %w", err)
	}
	var objs indexObjects
	if err := spec.LoadAndAssign(&objs, nil); err != nil {
		return 0, host.Explain(fmt.Errorf("load BPF programs: %w", err), "the socket index", host.MinKernel)
	}
	defer objs.Close()

	for _, d := range []string{mapsDir, linksDir, progsDir} {
		if err := os.Mkdir(filepath.Join(dir, d), 0o700); err != nil {
			return 0, err
		}
	}
	for name, m := range pinnedMaps(&objs.indexMaps) {
		if err := (*m).Pin(filepath.Join(dir, mapsDir, name)); err != nil {
			return 0, fmt.Errorf("pin map %s: %w", name, err)
		}
	}
	if err := objs.ShuntIndexFind.Pin(filepath.Join(dir, progsDir, "find")); err != nil {
		return 0, fmt.Errorf("pin find program: %w", err)
	}
	for _, h := range hooks {
		l, err := link.AttachCgroup(link.CgroupOptions{Path: cg.Path, Attach: h.attach, Program: h.prog(&objs.indexPrograms)})
		if err != nil {
			return 0, fmt.Errorf("attach %s to %s: %w", h.name, cg.Path, err)
		}
		err = l.Pin(filepath.Join(dir, linksDir, h.name))
		l.Close()
		if err != nil {
			return 0, fmt.Errorf("pin %s link: %w", h.name, err)
		}
	}
	// The hooks are live: from here no new socket is missed, and the sweep
	// adds those that were there before.
	return seed(&objs.indexPrograms)
}

// pinnedMaps names the maps that are pinned; build pins them, Open fills
// them in from the pins.
func pinnedMaps(m *indexMaps) map[string]**ebpf.Map {
	return map[string]**ebpf.Map{
		"sock_index":     &m.SockIndex,
		"backends":       &m.Backends,
		"sock_slots":     &m.SockSlots,
		"netns_owners":   &m.NetnsOwners,
		"index_counters": &m.IndexCounters,
	}
}

// seed runs the TCP and UDP sweeps in every namespace shunt can reach and
// returns how many sockets they added.
func seed(p *indexPrograms) (int, error) {
	added := 0
	for _, prog := range []*ebpf.Program{p.ShuntIndexSeedTcp, p.ShuntIndexSeedUdp} {
		it, err := link.AttachIter(link.IterOptions{Program: prog})
		if err != nil {
			return 0, fmt.Errorf("attach sweep iterator: %w", err)
		}
		for _, ns := range host.AllNetns() {
			// A namespace that went away meanwhile has no sockets to add.
			_ = host.InNetns(ns.Path, func() error {
				out, err := bpfiter.Read(it)
				added += len(out)
				return err
			})
		}
		it.Close()
	}
	return added, nil
}

// Open opens the index pinned at dir.
func Open(dir string) (*Index, error) {
	if _, err := os.Stat(filepath.Join(dir, linksDir, "release")); err != nil {
		if errors.Is(err, os.ErrNotExist) {
			return nil, ErrNotEnabled
		}
		return nil, fmt.Errorf("open %s: %w", dir, err)
	}
	ix := &Index{dir: dir}
	for name, dst := range pinnedMaps(&ix.maps) {
		m, err := ebpf.LoadPinnedMap(filepath.Join(dir, mapsDir, name), nil)
		if err != nil {
			ix.Close()
			return nil, fmt.Errorf("open pinned map %s: %w", name, err)
		}
		*dst = m
	}
	p, err := ebpf.LoadPinnedProgram(filepath.Join(dir, progsDir, "find"), nil)
	if err != nil {
		ix.Close()
		return nil, fmt.Errorf("open pinned find program: %w", err)
	}
	ix.find = p
	return ix, nil
}

// Close releases this process's handles; the pinned index stays.
func (ix *Index) Close() error {
	if ix.find != nil {
		ix.find.Close()
	}
	return ix.maps.Close()
}

// Remove disables the index: its hooks detach and its maps go.
func (ix *Index) Remove() error {
	ix.Close()
	if err := os.RemoveAll(ix.dir); err != nil {
		return fmt.Errorf("remove %s: %w", ix.dir, err)
	}
	return nil
}

// Proto is a transport protocol number.
type Proto uint8

const (
	TCP Proto = 6
	UDP Proto = 17
)

func (p Proto) String() string {
	switch p {
	case TCP:
		return "tcp"
	case UDP:
		return "udp"
	}
	return fmt.Sprintf("proto-%d", uint8(p))
}

// In reports whether p is one of ps.
func (p Proto) In(ps []Proto) bool {
	for _, q := range ps {
		if q == p {
			return true
		}
	}
	return false
}

// Backend is what sockets are connected to.
type Backend struct {
	Addr  netip.Addr
	Port  uint16
	Proto Proto
}

func (b Backend) key() indexBackend {
	return indexBackend{Addr: b.Addr.As16(), Port: b.Port, Proto: uint8(b.Proto)}
}

// Socket is one indexed socket.
type Socket struct {
	Proto       Proto
	Family      int            // AF_INET or AF_INET6, the socket's own
	Local       netip.AddrPort // invalid if LocalKnown is false
	Remote      netip.AddrPort // the backend
	Cookie      uint64
	NetnsCookie uint64
	Owner       int       // process that connected it, 0 if unknown
	Since       time.Time // when it was indexed
	LocalKnown  bool      // false for a connected UDP socket that never sent
	Seeded      bool      // found by the start-up sweep
	// KeepsPort: a UDP socket that would keep its local port if it
	// disconnected, so a SOCK_DESTROY by its old tuple could still find it.
	KeepsPort bool
}
