package bypass

import (
	"fmt"
	"os"
	"strconv"
	"strings"
)

// WriterMargin: flow control's bound leaves room in the reader's tcp_rmem[2]
// for its writer's send buffer and 1/WriterMargin of it more, for the
// segments' overhead (redirect.h, peer_limit): redirected bytes count in the
// reader's receive memory, and a throttled writer's TCP segments that do not
// fit it are dropped.
const WriterMargin = 8

// BacklogBound is flow control's bound on a reader's unread redirected
// bytes, for a reader that did not set SO_RCVBUF (its buffer is the bound
// then): the install's MaxBacklog, or what the reader's tcp_rmem[2] leaves
// once its writer's send buffer (writerMost: its SO_SNDBUF, else its
// tcp_wmem[2]) and an eighth of that are in, whichever is less.
func BacklogBound(maxBacklog uint32, tcpRmemMax, writerMost uint64) uint64 {
	bound := uint64(maxBacklog)
	if tcpRmemMax == 0 {
		return bound
	}
	taken := writerMost + writerMost/WriterMargin
	room := uint64(0)
	if tcpRmemMax > taken {
		room = tcpRmemMax - taken
	}
	return min(bound, room)
}

// TCPBuffers is what TCP grows a network namespace's socket buffers to.
type TCPBuffers struct {
	RmemMax uint64 `json:"tcp_rmem_max"` // tcp_rmem[2]
	WmemMax uint64 `json:"tcp_wmem_max"` // tcp_wmem[2]
}

// ReadTCPBuffers reads tcp_rmem[2] and tcp_wmem[2] of the calling thread's
// network namespace.
func ReadTCPBuffers() (TCPBuffers, error) {
	r, err := sysctlMax("tcp_rmem")
	if err != nil {
		return TCPBuffers{}, err
	}
	w, err := sysctlMax("tcp_wmem")
	if err != nil {
		return TCPBuffers{}, err
	}
	return TCPBuffers{RmemMax: r, WmemMax: w}, nil
}

// Bound is BacklogBound for a reader and a writer in this namespace, neither
// of which set its buffer.
func (b TCPBuffers) Bound(maxBacklog uint32) uint64 {
	return BacklogBound(maxBacklog, b.RmemMax, b.WmemMax)
}

// sysctlMax reads the third of a net.ipv4 tcp_*mem triple.
func sysctlMax(name string) (uint64, error) {
	b, err := os.ReadFile("/proc/sys/net/ipv4/" + name)
	if err != nil {
		return 0, err
	}
	f := strings.Fields(string(b))
	if len(f) != 3 {
		return 0, fmt.Errorf("%s: want three numbers, got %q", name, strings.TrimSpace(string(b)))
	}
	return strconv.ParseUint(f[2], 10, 64)
}
