package bypass_test

import (
	"bytes"
	"fmt"
	"net"
	"testing"
	"time"

	"github.com/shunt-project/shunt/bypass"
	"github.com/shunt-project/shunt/internal/testenv"
)

// A reader slower than its writer, whose stream began by TCP (the writer's
// first bytes came before the reader's first read, as a download's do),
// never reads every TCP byte before the next send, so no send may be
// redirected; over the sockhash such a pair ran at 0.62-0.75x plain TCP.
// Past BehindBytes of such sends in a row, once the socket made BehindSends,
// the connection goes back to TCP, every byte in order; so does one whose
// reader kept up for its first sends, until flow control throttled them (a
// run longer than all it redirected). A reader that starts late but is
// faster than its writer catches up and keeps the bypass, and a stream
// shorter than BehindSends is never judged. Seen failing with the rule off
// (bytes ^0): "connections sent back behind their reader: 0, want 1"; and
// without the sends gate: "... 1, want 0" (few-sends).
func TestReaderBehindGoesBackToTCP(t *testing.T) {
	const behind = 4 << 20
	type behindCase struct {
		name     string
		late     time.Duration // the reader's start after the writer's
		wait     time.Duration // the writer's start after the reader's
		step     int           // the reader's bytes a read
		rest     time.Duration // the reader's pause after each 16 KiB
		pace     time.Duration // the writer's pause after each 64 KiB
		sentBack bool
	}
	// A reader that rests is slower than its writer wherever the test
	// runs: under qemu without KVM an unpaced 4 KiB reader kept up with the
	// writer there and the rule never fired.
	slow := behindCase{name: "slow-reader-redirected-first", wait: 50 * time.Millisecond, step: 4 << 10, rest: time.Millisecond, sentBack: true}
	installs := []struct {
		sends uint32 // BehindSends; the stream is 256 sends of 64 KiB
		cases []behindCase
	}{
		{sends: 64, cases: []behindCase{
			{name: "slow-reader", late: 50 * time.Millisecond, step: 4 << 10, rest: time.Millisecond, sentBack: true},
			slow,
			{name: "reader-catches-up", late: 50 * time.Millisecond, step: 256 << 10, pace: 200 * time.Microsecond},
		}},
		{sends: 1 << 20, cases: []behindCase{{name: "few-sends", wait: slow.wait, step: slow.step, rest: slow.rest}}},
	}
	for _, inst := range installs {
		// Flow control throttles at 1 MiB, well before the 4 MiB run.
		in, cg := mustInstallWith(t, bypass.WithBehindReader(bypass.Options{MaxBacklog: 1 << 20}, behind, inst.sends))
		side := testenv.Side{NS: testenv.MustNetNS(t), CG: cg}
		for i, fam := range loopbacks {
			for j, tc := range inst.cases {
				if !onDiagonal(i, j) && !tc.sentBack {
					continue
				}
				t.Run(fam.network+"/"+tc.name, func(t *testing.T) {
					c, s := testenv.ConnPair(t, fam.network, side, fam.addr, side, fam.addr)
					before, err := in.Counters()
					if err != nil {
						t.Fatal(err)
					}
					stream := numbered(4 * behind / sendSize)
					done := make(chan error, 1)
					go func() {
						time.Sleep(tc.late)
						done <- readInSteps(c, stream, tc.step, tc.rest)
					}()
					time.Sleep(tc.wait)
					if tc.wait > 0 {
						// The stream is to start by redirect: its reader
						// read first (a slow guest may take longer than
						// the wait to get there).
						waitReading(t, in, c)
					}
					rawFD(t, s, func(fd int) {
						for k := 0; k < len(stream); k += 64 << 10 {
							writeAll(t, fd, stream[k:min(k+64<<10, len(stream))])
							time.Sleep(tc.pace)
						}
					})
					if err := <-done; err != nil {
						t.Fatal(err)
					}
					requireSentBack(t, in, c, s, before, "behind their reader", func(n bypass.Counters) uint64 { return n.BehindReader }, tc.sentBack,
						func(f *bypass.Flow) *bypass.Endpoint { return f.Server })
				})
			}
		}
	}
}

// waitReading waits until c's reader has been seen reading without
// blocking, so that its peer's sends may be redirected.
func waitReading(t *testing.T, in *bypass.Install, c *net.TCPConn) {
	t.Helper()
	for deadline := time.Now().Add(10 * time.Second); ; time.Sleep(time.Millisecond) {
		f := flowOf(t, in, testenv.Cookie(t, c))
		if f != nil && f.Client != nil && f.Client.Reader == bypass.ReaderRecv {
			return
		}
		if time.Now().After(deadline) {
			t.Fatalf("the reader was not seen reading in 10 s: %+v", f)
		}
	}
}

// readInSteps reads want from c, at most step bytes a read, resting rest
// after each 16 KiB, and says where it differs.
func readInSteps(c *net.TCPConn, want []byte, step int, rest time.Duration) error {
	if err := c.SetReadDeadline(time.Now().Add(60 * time.Second)); err != nil {
		return err
	}
	got := make([]byte, 0, len(want))
	buf := make([]byte, step)
	for len(got) < len(want) {
		n, err := c.Read(buf[:min(step, len(want)-len(got))])
		if err != nil {
			return fmt.Errorf("after %d of %d bytes: %w", len(got), len(want), err)
		}
		if rest > 0 && (len(got)+n)/(16<<10) > len(got)/(16<<10) {
			time.Sleep(rest)
		}
		got = append(got, buf[:n]...)
	}
	if i := firstDifference(got, want); i >= 0 {
		return fmt.Errorf("byte %d of %d differs: the stream lost, doubled or reordered bytes", i, len(want))
	}
	return nil
}

func firstDifference(a, b []byte) int {
	if bytes.Equal(a, b) {
		return -1
	}
	for i := range min(len(a), len(b)) {
		if a[i] != b[i] {
			return i
		}
	}
	return min(len(a), len(b))
}
