package bypass_test

import (
	"net"
	"testing"
	"time"

	"github.com/shunt-project/shunt/bypass"
	"github.com/shunt-project/shunt/internal/testenv"
)

// A program new to the install takes redirected bytes on one connection per
// role, its probe, while the probe shows whether the program splices after
// recv (guard's TestConcurrentSplicerIsCaughtOnce: one connection caught
// where each was). Its other readers read by TCP until the probe has read
// ProbationReads times, or hands the role on as it closes, or
// ProbationTime passed; then each is admitted at its next read. Every
// connection here is this test's process: one program.
func TestProbationAdmitsOneConnectionUntilItsProbeRead(t *testing.T) {
	cases := []struct {
		name string
		// end ends the probation of the program whose probes are a's ends.
		end func(t *testing.T, a1, a2 net.Conn)
	}{
		{"probe-read", func(t *testing.T, a1, a2 net.Conn) {
			for range bypass.ProbationReads {
				exchange(t, a1, a2, "x")
				exchange(t, a2, a1, "y")
			}
		}},
		{"probe-closed", func(t *testing.T, a1, a2 net.Conn) {
			a1.Close()
			a2.Close()
		}},
		{"time", func(*testing.T, net.Conn, net.Conn) {
			time.Sleep(bypass.ProbationTime + 100*time.Millisecond)
		}},
	}
	for _, tc := range cases {
		t.Run(tc.name, func(t *testing.T) {
			in, cg := mustInstall(t)
			a1, a2 := connPair(t, cg)
			b1, b2 := connPair(t, cg)
			start := time.Now()
			exchange(t, a1, a2, "w") // a's readers: the probes
			exchange(t, a2, a1, "w")
			exchange(t, b1, b2, "w") // b's: held
			exchange(t, b2, b1, "w")
			exchange(t, b1, b2, "held")
			exchange(t, b2, b1, "held")
			fb := flowOf(t, in, testenv.Cookie(t, b1))
			if fb == nil || fb.Client == nil || fb.Server == nil {
				t.Fatalf("b is not a bypassed flow: %+v", fb)
			}
			if fb.Client.TxMsgs+fb.Server.TxMsgs != 0 || fb.Client.Reader != bypass.ReaderUnseen || fb.Server.Reader != bypass.ReaderUnseen {
				t.Fatalf("b while a's readers are the probes: %d and %d sends redirected, readers %q and %q; want 0, unseen",
					fb.Client.TxMsgs, fb.Server.TxMsgs, fb.Client.Reader, fb.Server.Reader)
			}
			st, err := in.Stats()
			if err != nil {
				t.Fatal(err)
			}
			if st.Counters.ReaderHeld != 2 {
				t.Fatalf("readers held %d, want b's 2", st.Counters.ReaderHeld)
			}

			tc.end(t, a1, a2)
			exchange(t, b1, b2, "again") // each reader admitted at this read
			exchange(t, b2, b1, "again")
			exchange(t, b1, b2, "now")
			exchange(t, b2, b1, "now")
			elapsed := time.Since(start)
			fb = flowOf(t, in, testenv.Cookie(t, b1))
			if fb == nil || fb.Client == nil || fb.Server == nil {
				t.Fatalf("b is not a bypassed flow: %+v", fb)
			}
			if fb.Client.TxMsgs != 1 || fb.Server.TxMsgs != 1 {
				t.Fatalf("b after the probation ended (%v): %d and %d sends redirected, want 1 each", elapsed, fb.Client.TxMsgs, fb.Server.TxMsgs)
			}
		})
	}
}
