package bypass

import (
	"fmt"
	"os"
	"strconv"
	"strings"
)

// RmemShare keeps a reader's unread redirected bytes under its netns's
// tcp_rmem[2] divided by this, so that a throttled stream's TCP segments
// still fit the buffer TCP grows to (redirect.h, peer_limit).
const RmemShare = 4

// BacklogBound is flow control's bound on a reader's unread redirected
// bytes, for a reader that did not set SO_RCVBUF (its buffer is the bound
// then): the install's MaxBacklog or a quarter of its netns's tcp_rmem[2],
// whichever is less.
func BacklogBound(maxBacklog uint32, tcpRmemMax uint64) uint64 {
	bound := uint64(maxBacklog)
	if share := tcpRmemMax / RmemShare; tcpRmemMax > 0 && share < bound {
		bound = share
	}
	return bound
}

// TCPRmemMax reads tcp_rmem[2] of the calling thread's network namespace:
// the most TCP grows a receive buffer to.
func TCPRmemMax() (uint64, error) {
	b, err := os.ReadFile("/proc/sys/net/ipv4/tcp_rmem")
	if err != nil {
		return 0, err
	}
	f := strings.Fields(string(b))
	if len(f) != 3 {
		return 0, fmt.Errorf("tcp_rmem: want three numbers, got %q", strings.TrimSpace(string(b)))
	}
	return strconv.ParseUint(f[2], 10, 64)
}
