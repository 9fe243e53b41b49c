package bypass

import (
	"errors"
	"sort"

	"github.com/shunt-project/shunt/host"
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

// CgroupTraffic lists the counts of every cgroup that still exists, by
// path, and deletes those of cgroups that are gone (a socket a gone cgroup
// left behind is no longer counted), so that the map (16,384 cgroups) holds
// live ones.
func (in *Install) CgroupTraffic() ([]CgroupTraffic, error) {
	m, ok := in.maps[cgroupSendsMap]
	if !ok {
		return nil, ErrNoCgroupTraffic
	}
	var (
		id     uint64
		perCPU []bypassCgroupTraffic
		out    []CgroupTraffic
		ids    []uint64
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
		ids = append(ids, id)
	}
	if err := it.Err(); err != nil {
		return nil, err
	}
	paths := host.CgroupPathsByID(ids)
	kept := out[:0]
	for _, t := range out {
		if t.Path = paths[t.ID]; t.Path != "" {
			kept = append(kept, t)
		} else {
			_ = m.Delete(t.ID)
		}
	}
	sort.Slice(kept, func(i, j int) bool { return kept[i].Path < kept[j].Path })
	return kept, nil
}
