package bypass

import (
	"cmp"
	"errors"
	"fmt"
	"net/netip"
	"slices"
	"time"

	"github.com/cilium/ebpf"
)

// ReaderPort is a server port whose reader needed TCP lately (it blocked in
// recv, asked for MSG_WAITALL or spliced): its new connections are not
// paired until ReaderPortTTL after that, since each would be taken out again
// at its first read. With Client set, it is one client process whose reads
// of its last ReaderClientStreak connections to the port needed TCP (a
// proxy that reads its upstreams with blocking calls): only the connections
// that process makes to the port stay unpaired.
type ReaderPort struct {
	Netns   uint64    `json:"netns_cookie"` // the server's network namespace (SO_NETNS_COOKIE), the client's with Client
	Port    uint16    `json:"port"`
	Client  bool      `json:"client"`  // the entry is PID's connections to Port, not Port's accepted ones
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
	wall := bootOffset()
	now := time.Now()
	err := eachEntry(in, readerPortsMap, func(k *bypassReaderPort, v *bypassReaderPortSeen) {
		seen := wall(v.SeenNs)
		p := ReaderPort{Netns: k.Netns, Port: k.Port, Client: k.Pid != 0, PID: int(v.Pid), Command: commString(v.Comm),
			Seen: seen, Expires: seen.Add(ReaderPortTTL), Kept: v.Kept}
		// A client process keeps nothing unpaired before its streak.
		if p.Expires.After(now) && (!p.Client || v.Streak >= ReaderClientStreak) {
			out = append(out, p)
		}
	})
	if err != nil {
		return nil, err
	}
	slices.SortFunc(out, func(a, b ReaderPort) int {
		return cmp.Or(a.Expires.Compare(b.Expires), cmp.Compare(a.Port, b.Port), cmp.Compare(a.PID, b.PID))
	})
	return out, nil
}

// BriefPort is a server port whose last BriefStreak bypassed connections in
// a row from one client address closed brief (at most BriefSends sends from
// each end): a pairing
// costs such a connection more than its redirected sends win back, so its
// new connections are left unpaired, all but one in BriefSample, which is
// paired to see whether they still are. A send past BriefSends on any
// connection to the port ends it; so does ReaderPortTTL with no brief close.
type BriefPort struct {
	Netns   uint64     `json:"netns_cookie"` // the server's network namespace (SO_NETNS_COOKIE)
	Port    uint16     `json:"port"`
	Client  netip.Addr `json:"client"`    // the clients' address, as the server sees it
	Seen    time.Time  `json:"last_seen"` // when a brief connection to it last closed
	Expires time.Time  `json:"expires"`
	Kept    uint64     `json:"kept"` // connections left unpaired since its streak began
}

// BriefPorts lists the server ports (by client address) whose new
// connections are left unpaired now, soonest to expire first. An install from before them has none.
func (in *Install) BriefPorts() ([]BriefPort, error) {
	out := []BriefPort{}
	wall := bootOffset()
	now := time.Now()
	err := eachEntry(in, briefPortsMap, func(k *bypassBriefKey, v *bypassBriefPort) {
		seen := wall(v.SeenNs)
		p := BriefPort{Netns: k.Netns, Port: k.Port, Client: netip.AddrFrom16(k.ClientIp).Unmap(),
			Seen: seen, Expires: seen.Add(ReaderPortTTL), Kept: v.Kept}
		if v.Streak >= BriefStreak && p.Expires.After(now) {
			out = append(out, p)
		}
	})
	if err != nil {
		return nil, err
	}
	slices.SortFunc(out, func(a, b BriefPort) int {
		return cmp.Or(a.Expires.Compare(b.Expires), cmp.Compare(a.Port, b.Port), a.Client.Compare(b.Client))
	})
	return out, nil
}

// eachEntry calls fn with every entry of the install's map name. A map the
// install lacks (made by an older shunt) has none.
func eachEntry[K, V any](in *Install, name string, fn func(*K, *V)) error {
	m, ok := in.maps[name]
	if !ok {
		return nil
	}
	var k K
	var v V
	it := m.Iterate()
	for it.Next(&k, &v) {
		fn(&k, &v)
	}
	// Entries deleted meanwhile can end a walk early: what was read stands.
	if err := it.Err(); err != nil && !errors.Is(err, ebpf.ErrIterationAborted) {
		return fmt.Errorf("read %s: %w", name, err)
	}
	return nil
}
