package bypass_test

import (
	"net"
	"os"
	"strings"
	"testing"
	"time"

	"github.com/shunt-project/shunt/bypass"
	"github.com/shunt-project/shunt/host"
	"github.com/shunt-project/shunt/internal/testenv"
)

// A program new to the install reads by TCP on all its connections of a
// role while the first of them, its probe, shows whether the program
// splices after recv (guard's TestConcurrentSplicerIsNeverCaught); then
// each reader is admitted at its next read. The probation ends at the
// probe's ProbationReads-th read, or after ProbationTime; a probe that
// closes before hands the count on to the next reader that reads. Every connection here is this test's
// process: one program.
func TestProbationKeepsANewProgramOnTCPUntilItsProbeRead(t *testing.T) {
	reads := func(t *testing.T, c1, c2 net.Conn) {
		for range bypass.ProbationReads {
			exchange(t, c1, c2, "x")
			exchange(t, c2, c1, "y")
		}
	}
	// A limit far past the round trips below, even under qemu, where a
	// few of them took over a second; the time case gets a short one.
	const long, short = 30 * time.Second, 300 * time.Millisecond
	cases := []struct {
		name  string
		limit time.Duration
		// end ends the probation of the program whose probes are a's
		// ends; b's readers are held.
		end func(t *testing.T, a1, a2, b1, b2 net.Conn)
	}{
		{"probe-read", long, func(t *testing.T, a1, a2, _, _ net.Conn) { reads(t, a1, a2) }},
		{"probe-closed", long, func(t *testing.T, a1, a2, b1, b2 net.Conn) {
			a1.Close() // b's readers are the probes from their next read
			a2.Close()
			reads(t, b1, b2)
		}},
		{"time", short, func(*testing.T, net.Conn, net.Conn, net.Conn, net.Conn) {
			time.Sleep(short + 100*time.Millisecond)
		}},
	}
	for _, tc := range cases {
		t.Run(tc.name, func(t *testing.T) {
			in, cg := mustInstallNew(t, bypass.Options{ProbationLimit: tc.limit})
			a1, a2 := connPair(t, cg)
			b1, b2 := connPair(t, cg)
			start := time.Now()
			exchange(t, a1, a2, "w") // a's readers: the probes
			exchange(t, a2, a1, "w")
			exchange(t, b1, b2, "w")
			exchange(t, b2, b1, "w")
			for _, p := range [][2]net.Conn{{a1, a2}, {b1, b2}} {
				exchange(t, p[0], p[1], "held")
				exchange(t, p[1], p[0], "held")
			}
			// Under qemu the short limit may be past already.
			if time.Since(start) < tc.limit {
				for _, c := range []*net.TCPConn{a1, b1} {
					f := flowOf(t, in, testenv.Cookie(t, c))
					if f == nil || f.Client == nil || f.Server == nil {
						t.Fatalf("not a bypassed flow: %+v", f)
					}
					if f.Client.TxMsgs+f.Server.TxMsgs != 0 || f.Client.Reader != bypass.ReaderUnseen || f.Server.Reader != bypass.ReaderUnseen {
						t.Fatalf("on probation: %d and %d sends redirected, readers %q and %q; want 0, unseen",
							f.Client.TxMsgs, f.Server.TxMsgs, f.Client.Reader, f.Server.Reader)
					}
				}
				st, err := in.Stats()
				if err != nil {
					t.Fatal(err)
				}
				if st.Counters.ReaderHeld != 4 {
					t.Fatalf("readers held %d, want the 4", st.Counters.ReaderHeld)
				}
				ps := wantNewPrograms(t, in, 2)
				// Admitted by time once the limit passed: not yet if it
				// has not passed now.
				for _, p := range ps {
					if p.Admitted && time.Since(start) < tc.limit {
						t.Fatalf("new program %+v admitted on probation", p)
					}
				}
			}

			tc.end(t, a1, a2, b1, b2)
			exchange(t, b1, b2, "again") // each reader admitted at this read
			exchange(t, b2, b1, "again")
			exchange(t, b1, b2, "now")
			exchange(t, b2, b1, "now")
			elapsed := time.Since(start)
			fb := flowOf(t, in, testenv.Cookie(t, b1))
			if fb == nil || fb.Client == nil || fb.Server == nil {
				t.Fatalf("b is not a bypassed flow: %+v", fb)
			}
			if fb.Client.TxMsgs == 0 || fb.Server.TxMsgs == 0 {
				t.Fatalf("b after the probation ended (%v): %d and %d sends redirected, want the last at least", elapsed, fb.Client.TxMsgs, fb.Server.TxMsgs)
			}
			for _, p := range wantNewPrograms(t, in, 2) {
				if !p.Admitted {
					t.Fatalf("new program %+v not admitted after its probation", p)
				}
			}
		})
	}
}

// wantNewPrograms checks that the install lists this process's program,
// once a role, with the readers it held, and returns the two.
func wantNewPrograms(t *testing.T, in *bypass.Install, held uint64) []bypass.NewProgram {
	t.Helper()
	comm, err := os.ReadFile("/proc/self/comm")
	if err != nil {
		t.Fatal(err)
	}
	ps, err := in.NewPrograms()
	if err != nil {
		t.Fatal(err)
	}
	roles := map[string]bool{}
	for _, p := range ps {
		if p.Command != strings.TrimSpace(string(comm)) || p.Held != held {
			t.Fatalf("new program %+v: want %q, %d held", p, strings.TrimSpace(string(comm)), held)
		}
		roles[p.Role] = true
	}
	if len(ps) != 2 || !roles["accepted"] || !roles["connected"] {
		t.Fatalf("new programs %+v: want one a role", ps)
	}
	return ps
}

// Time alone does not end a probation: past ProbationTime a program's
// readers are still held while its probe has read once (a proxy's probe
// that read a header and waits for the body it will splice), and admitted
// once the probe reads again without splicing (guard's
// TestSlowUpstreamSplicerIsNeverCaught). Seen failing when the limit alone
// admitted: "b past the limit, its probe read once: 1 and 1 sends redirected".
func TestProbationTimeWaitsForTheProbesSecondRead(t *testing.T) {
	const limit = 300 * time.Millisecond
	in, cg := mustInstallNew(t, bypass.Options{ProbationLimit: limit})
	a1, a2 := connPair(t, cg)
	b1, b2 := connPair(t, cg)
	exchange(t, a1, a2, "w") // a's readers: the probes, one read each
	exchange(t, a2, a1, "w")
	time.Sleep(limit + 100*time.Millisecond)
	for range 2 {
		exchange(t, b1, b2, "held")
		exchange(t, b2, b1, "held")
	}
	fb := flowOf(t, in, testenv.Cookie(t, b1))
	if fb == nil || fb.Client == nil || fb.Server == nil {
		t.Fatalf("b is not a bypassed flow: %+v", fb)
	}
	if fb.Client.TxMsgs+fb.Server.TxMsgs != 0 {
		t.Fatalf("b past the limit, its probe read once: %d and %d sends redirected, want 0", fb.Client.TxMsgs, fb.Server.TxMsgs)
	}
	for _, p := range wantNewPrograms(t, in, 2) {
		if p.Admitted {
			t.Fatalf("new program %+v admitted by time alone", p)
		}
	}

	exchange(t, a1, a2, "again") // the probes' second reads, past the limit
	exchange(t, a2, a1, "again")
	for range 2 {
		exchange(t, b1, b2, "now")
		exchange(t, b2, b1, "now")
	}
	fb = flowOf(t, in, testenv.Cookie(t, b1))
	if fb.Client.TxMsgs == 0 || fb.Server.TxMsgs == 0 {
		t.Fatalf("b after the probes read again: %d and %d sends redirected, want the last at least", fb.Client.TxMsgs, fb.Server.TxMsgs)
	}
	for _, p := range wantNewPrograms(t, in, 2) {
		if !p.Admitted {
			t.Fatalf("new program %+v not admitted after its probe's second read", p)
		}
	}
}

// A reader held on probation reads by TCP from a socket still in the
// sockhash, whose FIONREAD leaves TCP's bytes out (6.18): a reader that
// trusts it is told 0 with bytes queued, as any other, and the stall watch
// must wake it. nginx's stream proxy, new to the install, was told 0 after
// its second read on its first connection and waited out the stall scan's
// 0.5 s (200 MiB through it to a slow sink: 1.87-2.12 s against 1.44-1.75
// over TCP, every run). Seen failing without the watch on held reads: 1 MiB
// in 0.5 s or more.
func TestHeldReaderToldZeroIsWoken(t *testing.T) {
	testenv.RequireRoot(t)
	if host.Probe().FionreadCountsTCP {
		t.Skip("FIONREAD counts TCP's bytes here: no held reader is told 0 for them")
	}
	got := toldZeroReaderIsQuick(t, true, "the stall watch left the held reader to the scan")
	if got.ReaderHeld == 0 {
		t.Fatal("no reader was held: the test did not read as a program new to the install")
	}
}
