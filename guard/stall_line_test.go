package guard

import (
	"net/netip"
	"strings"
	"testing"

	"golang.org/x/sys/unix"

	"github.com/shunt-project/shunt/bypass"
)

// The guard's line for a stall says how it was found: by the watch (and
// the wait the reader slept in), by the scan, or not at all (an older
// install's event).
func TestStallLineSaysHowItWasFound(t *testing.T) {
	base := bypass.Event{Kind: bypass.StallRescued, PID: 7, Command: "nginx", Unread: 4096,
		Local: netip.MustParseAddrPort("127.0.0.1:80"), Remote: netip.MustParseAddrPort("127.0.0.1:5000")}
	for _, tc := range []struct {
		found    bypass.StallFound
		asleepIn int
		unread   uint64
		want     string
	}{
		{bypass.FoundByWatch, unix.SYS_EPOLL_WAIT, 4096, "pid 7 (nginx) waited on 127.0.0.1:80 (peer 127.0.0.1:5000) with 4096 bytes queued that FIONREAD or a short read did not show, asleep in epoll_wait since its last read"},
		{bypass.FoundByWatch, 4242, 4096, "asleep in system call 4242 since its last read"},
		{bypass.FoundByScan, 0, 0, "with the peer's end (FIN) unread, nothing read for the stall scan's 0.5 s"},
		{bypass.FoundUnknown, 0, 4096, "FIONREAD or a short read did not show"},
	} {
		ev := base
		ev.Found, ev.AsleepIn, ev.Unread = tc.found, tc.asleepIn, tc.unread
		got := stallLine(ev)
		if !strings.HasSuffix(got, tc.want) {
			t.Errorf("found %d, asleep in %d: %q; want it to end in %q", tc.found, tc.asleepIn, got, tc.want)
		}
	}
}
