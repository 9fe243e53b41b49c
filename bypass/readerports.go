package bypass

import (
	"cmp"
	"errors"
	"fmt"
	"slices"
	"time"

	"github.com/cilium/ebpf"
)

// ReaderPort is a server port whose reader needed TCP lately (it blocked in
// recv, asked for MSG_WAITALL or spliced): its new connections are not
// paired until ReaderPortTTL after that, since each would be taken out again
// at its first read.
type ReaderPort struct {
	Netns   uint64    `json:"netns_cookie"` // the server's network namespace (SO_NETNS_COOKIE)
	Port    uint16    `json:"port"`
	PID     int       `json:"pid"`     // the process whose read needed TCP last
	Command string    `json:"command"` // its command name
	Seen    time.Time `json:"last_seen"`
	Expires time.Time `json:"expires"` // after this, the next connection is paired again
	Kept    uint64    `json:"kept"`    // connections left unpaired since the port was first seen
}

// ReaderPorts lists the server ports whose new connections stay unpaired
// now, soonest to expire first. Expired entries are left out (the kernel
// forgets them as it needs room). An install from before them has none.
func (in *Install) ReaderPorts() ([]ReaderPort, error) {
	out := []ReaderPort{}
	m, ok := in.maps[readerPortsMap]
	if !ok {
		return out, nil
	}
	wall := bootOffset()
	now := time.Now()
	var k bypassReaderPort
	var v bypassReaderPortSeen
	it := m.Iterate()
	for it.Next(&k, &v) {
		seen := wall(v.SeenNs)
		p := ReaderPort{Netns: k.Netns, Port: k.Port, PID: int(v.Pid), Command: commString(v.Comm),
			Seen: seen, Expires: seen.Add(ReaderPortTTL), Kept: v.Kept}
		if p.Expires.After(now) {
			out = append(out, p)
		}
	}
	if err := it.Err(); err != nil && !errors.Is(err, ebpf.ErrIterationAborted) {
		return nil, fmt.Errorf("read %s: %w", readerPortsMap, err)
	}
	slices.SortFunc(out, func(a, b ReaderPort) int {
		return cmp.Or(a.Expires.Compare(b.Expires), cmp.Compare(a.Port, b.Port))
	})
	return out, nil
}
