package bypass_test

import (
	"strings"
	"testing"

	"github.com/shunt-project/shunt/bypass"
	"github.com/shunt-project/shunt/host"
	"github.com/shunt-project/shunt/internal/testenv"
)

// TestSkMsgAttachedToTheMap: on kernels before 6.10 sk_msg attaches to the
// sockhash itself, not by link. Forced here on a kernel that has links: the
// install says so, connections are bypassed as with a link, and removal
// leaves the program attached nowhere (it goes with the map).
func TestSkMsgAttachedToTheMap(t *testing.T) {
	in, cg := mustInstallWith(t, bypass.Options{Mechanisms: host.Mechanisms{AttachOnMap: true}})
	if got := in.SkMsgAttach(); got != "map" {
		t.Fatalf("sk_msg attached by %q, want map", got)
	}
	st, err := in.Stats()
	if err != nil {
		t.Fatal(err)
	}
	var progID uint32
	for _, p := range st.Programs {
		if p.Name == "sk_msg" {
			progID = p.ID
			if len(p.Links) != 0 || !strings.Contains(p.Attached, "attached to the map") {
				t.Fatalf("sk_msg listed as %+v", p)
			}
		}
	}
	if progID == 0 {
		t.Fatalf("no sk_msg program in %+v", st.Programs)
	}

	side := testenv.Side{NS: testenv.MustNetNS(t), CG: cg}
	c, s := testenv.ConnPair(t, "tcp4", side, "127.0.0.1:0", side, "127.0.0.1:0")
	exchange(t, c, s, "w")
	exchange(t, s, c, "w")
	msg := strings.Repeat("through the map's program ", 100)
	for range 10 {
		exchange(t, c, s, msg)
	}
	f := flowOf(t, in, testenv.Cookie(t, c))
	if f == nil || f.Client == nil || f.Client.TxBytes != uint64(10*len(msg)) {
		t.Fatalf("flow %+v: want %d bytes redirected client -> server", f, 10*len(msg))
	}
	c.Close()
	s.Close()
	// The map goes once nothing holds it; the program with it.
	removeLeavesNoProgram(t, in, progID, "sk_msg")
}
