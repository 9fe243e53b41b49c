// Package fanout relays every datagram that arrives on a UDP socket to every
// connected TCP subscriber, in order, with a bounded queue per subscriber so
// that a slow one never holds up the others.
package fanout

import (
	"fmt"
	"io"
	"net/netip"
	"strings"

	"github.com/shunt-project/shunt/host"
)

// Framing says how messages are delimited on a subscriber's stream.
type Framing int

const (
	FramingNone Framing = iota // bytes as they came, no boundaries
	FramingU16                 // 2-byte big-endian length before each message
	FramingU32                 // 4-byte big-endian length before each message
)

func (f Framing) String() string { return [...]string{"none", "u16", "u32"}[f] }

// ParseFraming reads none, u16 or u32.
func ParseFraming(s string) (Framing, error) {
	for f := FramingNone; f <= FramingU32; f++ {
		if s == f.String() {
			return f, nil
		}
	}
	return 0, fmt.Errorf("framing %q: want none, u16 or u32", s)
}

// SlowPolicy says what happens to a subscriber whose queue is full.
type SlowPolicy int

const (
	SlowDrop       SlowPolicy = iota // it loses messages (counted; a gap marker when framed)
	SlowDisconnect                   // it is disconnected
)

func (p SlowPolicy) String() string { return [...]string{"drop", "disconnect"}[p] }

// ParseSlowPolicy reads drop or disconnect.
func ParseSlowPolicy(s string) (SlowPolicy, error) {
	switch s {
	case "drop":
		return SlowDrop, nil
	case "disconnect":
		return SlowDisconnect, nil
	}
	return 0, fmt.Errorf("slow policy %q: want drop or disconnect", s)
}

// Path is how messages reach the subscribers' sockets.
type Path int

const (
	// PathBatch writes each subscriber everything a wake-up brought (up to
	// 64 datagrams) in one send: one syscall per subscriber per batch.
	PathBatch Path = iota
	// PathPerMessage writes each message to each subscriber with its own
	// send, as a plain relay loop does: the baseline.
	PathPerMessage
	// PathURing queues one send per subscriber per batch, like PathBatch,
	// and submits them all with one io_uring_enter.
	PathURing
	// PathKernel sends each datagram once to a multicast group on loopback;
	// the kernel copies it to one UDP socket per subscriber, and a BPF
	// verdict sends each copy on to the subscriber's TCP socket. User space
	// does no work per subscriber per message. Needs root.
	PathKernel
	// PathZeroCopy frames each batch once and sends that one buffer to
	// every subscriber that has caught up with MSG_ZEROCOPY; the others
	// take the batch path.
	PathZeroCopy
)

var pathNames = [...]string{"batch", "per-message", "uring", "kernel", "zerocopy"}

func (p Path) String() string { return pathNames[p] }

// ParsePath reads batch, per-message, uring, kernel or zerocopy.
func ParsePath(s string) (Path, error) {
	for i, n := range pathNames {
		if s == n {
			return Path(i), nil
		}
	}
	return 0, fmt.Errorf("path %q: want batch, per-message, uring, kernel or zerocopy", s)
}

// DefaultQueue is how many bytes may wait for one subscriber.
const DefaultQueue = 1 << 20

// Config shapes a forwarder.
type Config struct {
	Source  netip.AddrPort // UDP address to receive the feed on
	Listen  netip.AddrPort // TCP address subscribers connect to
	Framing Framing
	Slow    SlowPolicy
	Queue   int       // bytes waiting per subscriber before Slow applies; 0: DefaultQueue
	Control string    // unix socket for stats; "" for none
	Log     io.Writer // one line per event; nil: discard
	Path    Path
	// CPU pins the relay loop's thread to one CPU (benchmarks). With
	// PinCPU false the scheduler places it, except on the kernel path,
	// whose loop stays on the CPU it starts on (the order of messages
	// depends on it: see Run).
	CPU    int
	PinCPU bool
	// Mechanisms: the zero value uses the kernel's newest; tests set it
	// to run an older kernel's ways on the kernel path on this one.
	Mechanisms host.Mechanisms
}

// ParseEndpoint reads scheme://ADDR:PORT, e.g. udp://0.0.0.0:5000 or
// tcp://[::1]:6000.
func ParseEndpoint(scheme, s string) (netip.AddrPort, error) {
	rest, ok := strings.CutPrefix(s, scheme+"://")
	if !ok {
		return netip.AddrPort{}, fmt.Errorf("%q: want %s://ADDR:PORT", s, scheme)
	}
	ap, err := netip.ParseAddrPort(rest)
	if err != nil {
		return netip.AddrPort{}, fmt.Errorf("%q: want %s://ADDR:PORT, like %s://127.0.0.1:5000 or %s://[::1]:5000", s, scheme, scheme, scheme)
	}
	return ap, nil
}

// maxMessage is the largest message a framing can carry; a gap marker uses
// the value above it.
func (f Framing) maxMessage() int {
	switch f {
	case FramingU16:
		return 0xfffe
	case FramingU32:
		return 1 << 20 // far above any UDP datagram
	}
	return 1 << 20
}
