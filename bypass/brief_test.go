package bypass_test

import (
	"io"
	"net"
	"testing"
	"time"

	"github.com/shunt-project/shunt/bypass"
	"github.com/shunt-project/shunt/internal/testenv"
)

// A server port whose connections each carry one exchange leaves its next
// ones unpaired once BriefStreak of them closed in a row, all but one in
// BriefSample; a connection that sends past BriefSends (one of those paired
// to look) has the port's next connections paired again at once.
func TestBriefPortLeftUnpaired(t *testing.T) {
	for _, network := range []string{"tcp4", "tcp6"} {
		t.Run(network, func(t *testing.T) {
			in, cg := mustInstall(t)
			side := testenv.Side{NS: testenv.MustNetNS(t), CG: cg}
			addr := map[string]string{"tcp4": "127.0.0.1:0", "tcp6": "[::1]:0"}[network]
			ln := testenv.Listen(t, side, network, addr)
			counters := func() bypass.Counters {
				t.Helper()
				c, err := in.Counters()
				if err != nil {
					t.Fatal(err)
				}
				return c
			}
			// connectFrom makes one connection from local (nil: any) with
			// exchanges round trips and closes it, the client first, the
			// server once it read the end; it says whether the connection
			// was paired.
			var connectFrom func(local *net.TCPAddr, exchanges int) bool
			connect := func(exchanges int) bool { return connectFrom(nil, exchanges) }
			connectFrom = func(local *net.TCPAddr, exchanges int) bool {
				t.Helper()
				before := counters().Paired
				c := testenv.Dial(t, side, network, ln.Addr().String(), local)
				s := testenv.Accept(t, ln)
				for range exchanges {
					exchange(t, c, s, "request")
					exchange(t, s, c, "response")
				}
				c.Close()
				if _, err := io.ReadAll(s); err != nil {
					t.Fatal(err)
				}
				s.Close()
				return counters().Paired > before
			}

			for i := range bypass.BriefStreak {
				if !connect(1) {
					t.Fatalf("brief connection %d of the first %d not paired", i+1, bypass.BriefStreak)
				}
			}
			// The last close may come a moment after the next request.
			paired := 0
			for range bypass.BriefSample {
				if connect(1) {
					paired++
				}
			}
			if paired > 2 {
				t.Errorf("%d of %d brief connections after the streak were paired, want 1 (one in %d) or one more",
					paired, bypass.BriefSample, bypass.BriefSample)
			}
			if kept := counters().BriefPort; int(kept) < bypass.BriefSample-2 {
				t.Errorf("connections_brief_port %d, want at least %d", kept, bypass.BriefSample-2)
			}
			ports, err := in.BriefPorts()
			if err != nil {
				t.Fatal(err)
			}
			if len(ports) != 1 || int(ports[0].Port) != ln.Addr().(*net.TCPAddr).Port || !ports[0].Client.IsLoopback() {
				t.Fatalf("brief ports %+v, want the listener's, from the loopback address", ports)
			}
			// Learned for that client address only: another is paired.
			if network == "tcp4" && !connectFrom(&net.TCPAddr{IP: net.IPv4(127, 0, 0, 2)}, 1) {
				t.Error("a connection from 127.0.0.2 to a port learned brief from 127.0.0.1 was not paired")
			}

			// Forgotten after the TTL with no brief close: the next is
			// paired, and the streak starts again.
			if err := in.AgeBriefPorts(bypass.ReaderPortTTL + time.Second); err != nil {
				t.Fatal(err)
			}
			if !connect(1) {
				t.Fatalf("a brief connection %v after the port's last brief close was not paired", bypass.ReaderPortTTL+time.Second)
			}
			for range bypass.BriefStreak {
				connect(1)
			}
			// (The streak's last close may come a moment after the next
			// request: two tries.)
			kept := counters().BriefPort
			connect(1)
			connect(1)
			if counters().BriefPort == kept {
				t.Fatal("the port was not learned brief again")
			}

			// Longer connections: the first paired one (to look) ends the
			// streak, and the next is paired.
			looked := false
			for range bypass.BriefSample {
				if looked = connect(bypass.BriefSends + 2); looked {
					break
				}
			}
			if !looked {
				t.Fatalf("none of %d connections to a brief port was paired", bypass.BriefSample)
			}
			if !connect(bypass.BriefSends + 2) {
				t.Error("a connection after one that sent more than a brief one was not paired")
			}
			if ports, err := in.BriefPorts(); err != nil || len(ports) != 0 {
				t.Errorf("brief ports %+v (%v), want none", ports, err)
			}
		})
	}
}
