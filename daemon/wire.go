// Package daemon is the fd hand-over service behind `shunt daemon`: a
// process sends two connected TCP (or UDP) sockets over a unix socket (SCM_RIGHTS) and
// the daemon joins them in the kernel (package splice), answering with a
// handle and reporting when the pair ends. It also holds the client side.
//
// Wire format (docs/DAEMON.md): SOCK_SEQPACKET, one JSON object per message.
// Requests carry "op"; each gets exactly one reply, with "ok". Events carry
// "event" and arrive between replies, on the connection that joined the pair.
package daemon

import (
	"encoding/json"
	"time"
)

// DefaultSocket is where the daemon listens unless told otherwise.
const DefaultSocket = "/run/shunt/shunt.sock"

// maxMessage bounds one message either way.
const maxMessage = 64 << 10

// Request is what a client sends. Join carries two descriptors.
type Request struct {
	Op     string `json:"op"`               // "join", "stats" or "close"
	Handle uint64 `json:"handle,omitempty"` // close: which pair
	// handover: the taker's splice.StateVersion; a daemon whose state
	// differs refuses before it stops anything.
	Version string `json:"version,omitempty"`
}

// Reply answers one request.
type Reply struct {
	OK     bool       `json:"ok"`
	Error  string     `json:"error,omitempty"`
	Handle uint64     `json:"handle,omitempty"` // join
	Pairs  []PairInfo `json:"pairs,omitempty"`  // stats
	// handover: how many UDP pairs follow the TCP pairs, and how many
	// client connections follow those.
	UDPPairs int `json:"udp_pairs,omitempty"`
	Clients  int `json:"clients,omitempty"`
}

// PairInfo describes a joined pair.
type PairInfo struct {
	Handle   uint64    `json:"handle"`
	Proto    string    `json:"proto"` // "tcp" or "udp"
	A        string    `json:"a"`     // local -> remote address of the first socket
	B        string    `json:"b"`
	Since    time.Time `json:"since"`
	BytesAB  uint64    `json:"bytes_ab"` // arrived on a, sent out of b
	BytesBA  uint64    `json:"bytes_ba"`
	Kernel   uint64    `json:"bytes_kernel"` // of both, moved by the kernel
	InKernel bool      `json:"in_kernel"`    // false: copied in user space (a socket could not join)
	// UDP: datagrams sent on each way, and dropped at the bound.
	DatagramsAB uint64 `json:"datagrams_ab,omitempty"`
	DatagramsBA uint64 `json:"datagrams_ba,omitempty"`
	DroppedAB   uint64 `json:"dropped_ab,omitempty"`
	DroppedBA   uint64 `json:"dropped_ba,omitempty"`
}

// Event reports a pair that ended, to the connection that joined it.
type Event struct {
	Event string `json:"event"` // "ended"
	PairInfo
	Error string `json:"error,omitempty"` // why it ended early (reset, error); empty after FIN both ways
}

// isEvent says whether a message from the daemon is an event, not a reply.
func isEvent(b []byte) bool {
	var probe struct {
		Event string `json:"event"`
	}
	return json.Unmarshal(b, &probe) == nil && probe.Event != ""
}
