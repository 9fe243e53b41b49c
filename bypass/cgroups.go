package bypass

import (
	"errors"
	"fmt"
	"os"
	"path/filepath"
	"sort"
	"strconv"

	"github.com/cilium/ebpf"
	"github.com/cilium/ebpf/link"

	"github.com/shunt-project/shunt/host"
	"github.com/shunt-project/shunt/internal/pin"
)

// CgroupTraffic is what the sockets shunt holds in one cgroup have sent
// since bypass was enabled: by redirect, and by TCP (sends a held socket
// made while its direction was on TCP: flow control, a reader that needs
// TCP, draining). Sockets shunt does not hold are not counted.
type CgroupTraffic struct {
	ID              uint64 `json:"id"`
	Path            string `json:"path"`
	RedirectedBytes uint64 `json:"redirected_bytes"`
	RedirectedSends uint64 `json:"redirected_sends"`
	TCPBytes        uint64 `json:"tcp_bytes"`
	TCPSends        uint64 `json:"tcp_sends"`
}

// ErrNoCgroupTraffic: the install predates per-cgroup counts (enable it
// again with this version to get them).
var ErrNoCgroupTraffic = errors.New("this install keeps no per-cgroup counts: it was enabled by an older shunt")

// retiredID is the cgroup_sends entry that keeps the counts of cgroups that
// are gone (no cgroup has id 0), so totals outlive them.
const retiredID = 0

// Traffic is what every socket shunt held sent since bypass was enabled.
type Traffic struct {
	RedirectedBytes uint64 `json:"redirected_bytes"`
	RedirectedSends uint64 `json:"redirected_sends"`
	TCPBytes        uint64 `json:"tcp_bytes"` // sends of held sockets that took TCP
	TCPSends        uint64 `json:"tcp_sends"`
}

func (t *Traffic) add(o Traffic) {
	t.RedirectedBytes += o.RedirectedBytes
	t.RedirectedSends += o.RedirectedSends
	t.TCPBytes += o.TCPBytes
	t.TCPSends += o.TCPSends
}

// Totals sums the counts of every cgroup, those gone included.
func (in *Install) Totals() (Traffic, error) {
	var t Traffic
	all, err := in.cgroupCounts()
	if err != nil {
		return t, err
	}
	for _, c := range all {
		t.add(c.Traffic())
	}
	return t, nil
}

// Traffic is the cgroup's counts without its name.
func (c CgroupTraffic) Traffic() Traffic {
	return Traffic{RedirectedBytes: c.RedirectedBytes, RedirectedSends: c.RedirectedSends, TCPBytes: c.TCPBytes, TCPSends: c.TCPSends}
}

// cgroupCounts reads every entry of cgroup_sends, summed over CPUs.
func (in *Install) cgroupCounts() ([]CgroupTraffic, error) {
	m, ok := in.maps[cgroupSendsMap]
	if !ok {
		return nil, ErrNoCgroupTraffic
	}
	var (
		id     uint64
		perCPU []bypassCgroupTraffic
		out    []CgroupTraffic
	)
	it := m.Iterate()
	for it.Next(&id, &perCPU) {
		t := CgroupTraffic{ID: id}
		for _, c := range perCPU {
			t.RedirectedBytes += c.RedirectedBytes
			t.RedirectedSends += c.RedirectedSends
			t.TCPBytes += c.TcpBytes
			t.TCPSends += c.TcpSends
		}
		out = append(out, t)
	}
	return out, it.Err()
}

// CgroupTraffic lists the counts of every cgroup that still exists, by
// path, and moves those of cgroups that are gone (a socket a gone cgroup
// left behind is no longer counted) into the retired entry, so that the map
// (16,384 cgroups) holds live ones and Totals keeps every byte.
func (in *Install) CgroupTraffic() ([]CgroupTraffic, error) {
	all, err := in.cgroupCounts()
	if err != nil {
		return nil, err
	}
	var ids []uint64
	for _, t := range all {
		ids = append(ids, t.ID)
	}
	paths := host.CgroupPathsByID(ids)
	var kept []CgroupTraffic
	var retired Traffic
	for _, t := range all {
		switch {
		case t.ID == retiredID:
		case paths[t.ID] != "":
			t.Path = paths[t.ID]
			kept = append(kept, t)
		case in.maps[cgroupSendsMap].Delete(t.ID) == nil:
			// Only the process whose delete succeeded retires them.
			retired.add(t.Traffic())
		}
	}
	if retired != (Traffic{}) {
		if err := in.retire(retired); err != nil {
			return nil, err
		}
	}
	sort.Slice(kept, func(i, j int) bool { return kept[i].Path < kept[j].Path })
	return kept, nil
}

// retire adds t to the retired entry (its first CPU's slot).
func (in *Install) retire(t Traffic) error {
	m := in.maps[cgroupSendsMap]
	perCPU := make([]bypassCgroupTraffic, ebpf.MustPossibleCPU())
	_ = m.Lookup(uint64(retiredID), &perCPU)
	perCPU[0].RedirectedBytes += t.RedirectedBytes
	perCPU[0].RedirectedSends += t.RedirectedSends
	perCPU[0].TcpBytes += t.TCPBytes
	perCPU[0].TcpSends += t.TCPSends
	return m.Update(uint64(retiredID), perCPU, ebpf.UpdateAny)
}

// Attach enables bypass for sockets of a cgroup and its descendants. It
// returns false if the cgroup was enabled already. Listeners in it older
// than the attach pair their new connections too (each connection request
// registers, whatever its listener's age).
func (in *Install) Attach(cg host.Cgroup) (bool, error) {
	in.sweep()
	if err := in.setDraining(false); err != nil {
		return false, err
	}
	where := in.cgroupPin(cg.ID)
	if _, err := os.Stat(where); err == nil {
		return false, nil
	}
	// The sockopt hooks go first: a cgroup must never have sockops
	// (sockets in the sockhash) without them.
	if err := in.attachSockopts(cg); err != nil {
		return false, err
	}
	l, err := link.AttachCgroup(link.CgroupOptions{Path: cg.Path, Attach: ebpf.AttachCGroupSockOps, Program: in.sockops})
	if err != nil {
		err = fmt.Errorf("attach sockops to %s: %w", cg.Path, err)
		return false, errors.Join(err, in.detachSockopts(cg.ID))
	}
	defer l.Close()
	// Pin under a temporary name, then rename: a racing enable of the same
	// cgroup loses the rename and its link detaches when closed.
	tmp := where + "-new-" + strconv.Itoa(os.Getpid())
	if err := l.Pin(tmp); err != nil {
		return false, errors.Join(fmt.Errorf("pin cgroup link: %w", err), in.detachSockopts(cg.ID))
	}
	if err := pin.RenameNoReplace(tmp, where); err != nil {
		os.Remove(tmp)
		if errors.Is(err, os.ErrExist) {
			return false, nil // the racing enable pinned both
		}
		return false, errors.Join(fmt.Errorf("pin cgroup link: %w", err), in.detachSockopts(cg.ID))
	}
	return true, nil
}

// Detach disables bypass for new connections of a cgroup. Connections
// already bypassed keep working. It returns false if the cgroup was not
// enabled.
func (in *Install) Detach(cgroupID uint64) (bool, error) {
	in.sweep()
	pin := in.cgroupPin(cgroupID)
	l, err := link.LoadPinnedLink(pin, nil)
	if errors.Is(err, os.ErrNotExist) {
		return false, nil
	}
	if err != nil {
		return false, fmt.Errorf("open cgroup link: %w", err)
	}
	defer l.Close()
	if err := l.Unpin(); err != nil {
		return false, fmt.Errorf("unpin cgroup link: %w", err)
	}
	// After sockops: no new socket of the cgroup joins the sockhash now.
	if err := in.detachSockopts(cgroupID); err != nil {
		return true, err
	}
	return true, nil
}

func (in *Install) cgroupPin(id uint64) string {
	return filepath.Join(in.dir, cgroupsDir, strconv.FormatUint(id, 10))
}

// IsEnabled says whether bypass is enabled for the cgroup with this id.
func (in *Install) IsEnabled(cgroupID uint64) bool {
	_, err := os.Stat(in.cgroupPin(cgroupID))
	return err == nil
}

// EnabledCgroup is a cgroup whose new connections are bypassed.
type EnabledCgroup struct {
	ID   uint64 `json:"id"`
	Path string `json:"path"` // "" if the cgroup was removed
}

// Cgroups lists the enabled cgroups.
func (in *Install) Cgroups() ([]EnabledCgroup, error) {
	ids, err := in.CgroupIDs()
	if err != nil {
		return nil, err
	}
	var out []EnabledCgroup
	for _, id := range ids {
		out = append(out, EnabledCgroup{ID: id, Path: host.CgroupPathByID(id)})
	}
	return out, nil
}

// CgroupIDs lists the ids of the enabled cgroups (without the walk of the
// hierarchy that finds their paths).
func (in *Install) CgroupIDs() ([]uint64, error) {
	ents, err := os.ReadDir(filepath.Join(in.dir, cgroupsDir))
	if err != nil {
		return nil, err
	}
	var out []uint64
	for _, e := range ents {
		id, err := strconv.ParseUint(e.Name(), 10, 64)
		if err != nil {
			continue // a pin still being renamed into place
		}
		out = append(out, id)
	}
	return out, nil
}
