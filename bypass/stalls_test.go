package bypass_test

import (
	"bytes"
	"cmp"
	"fmt"
	"io"
	"math/rand/v2"
	"net"
	"runtime"
	"slices"
	"strings"
	"sync"
	"testing"
	"time"

	"golang.org/x/sys/unix"

	"github.com/shunt-project/shunt/bypass"
	"github.com/shunt-project/shunt/bypass/bypasstest"
	"github.com/shunt-project/shunt/host"
	"github.com/shunt-project/shunt/internal/testenv"
)

// Readers that trust FIONREAD, as nginx does: on an edge-triggered EPOLLIN
// they read a full buffer, ask FIONREAD how much is left and, told 0, wait
// for the next edge. On 6.18 FIONREAD of a socket in the sockhash leaves out
// bytes that came by TCP (a connection's first bytes), on 6.1 the redirected
// ones: such a reader waited for ever once the writer had nothing more to
// send. Through shunt, with the guard running and FIONREAD left as the
// kernel answers it, every byte must arrive, soon.
func TestFIONREADReaderNeverStalls(t *testing.T) {
	for k, tc := range []struct {
		name string
		// warm: a round trip first, so the bytes come by redirect;
		// else they are the connection's first bytes, by TCP.
		warm bool
		// askFirst: FIONREAD before the first read, which the read
		// watch never sees (the FIONREAD watch, or where FIONREAD is
		// corrected nothing, or the stall scan must find it).
		askFirst bool
		// end: the writer closes after its last byte and the reader
		// reads on to the end, as nginx does once an edge has carried
		// EPOLLRDHUP (it then reads until 0, whatever FIONREAD says).
		end bool
		// late: the reader starts once the writer is done, so its first
		// edge tells the bytes and the end at once.
		late bool
		// size: how much the writer sends (0: 1 MiB).
		size int
	}{
		{name: "first bytes"},
		{name: "first bytes, FIONREAD before reading", askFirst: true},
		{name: "redirected", warm: true},
		{name: "redirected, then the end", warm: true, end: true},
		{name: "first bytes, then the end", end: true},
		// nginx's stream proxy on 6.1 never read its upstream's end
		// after a 64 KiB response: FIONREAD there misses redirected
		// bytes, so after one full buffer it was told 0, read one more
		// (the end had come), counted below 0 and waited for an edge.
		// That read took the last bytes: only the end was left.
		{name: "redirected 24 KiB and the end, read late", warm: true, end: true, late: true, size: 24 << 10},
	} {
		for f, network := range []string{"tcp4", "tcp6"} {
			if !onDiagonal(k, f) {
				continue
			}
			for _, watchOnly := range []bool{false, true} {
				name := tc.name + "/" + network
				if watchOnly {
					name += "/without the FIONREAD watch"
				}
				t.Run(name, func(t *testing.T) {
					// FIONREAD as the kernel answers it (under lockdown
					// shunt cannot correct it): the FIONREAD watch, the
					// stall watch and the scan must make the reader
					// progress; the last two alone as well.
					opts := bypass.Options{Mechanisms: host.Mechanisms{KernelFIONREAD: true}}
					if watchOnly {
						opts.NoFIONREADWatch = true
					}
					in, c, s, said := guardedPairLog(t, network, opts)
					if st, err := in.Stats(); err != nil || watchOnly && slices.ContainsFunc(st.Programs, func(p bypass.Program) bool { return p.Name == "fionread_told" }) {
						t.Fatalf("installed with NoFIONREADWatch, the FIONREAD watch is attached (%v)", err)
					}
					if tc.warm {
						testenv.Warm(t, c, s)
					}
					data := randomBytes(cmp.Or(tc.size, 1<<20), 7)
					written := sendAll(t, s, data, tc.end)
					if tc.late {
						written()
						time.Sleep(50 * time.Millisecond) // the FIN on its way
					}
					start := time.Now()
					got, err := fionreadRead(t, c, len(data), fionreadReader{askFirst: tc.askFirst, end: tc.end}, 10*time.Second)
					took := time.Since(start)
					written()
					st, serr := in.Stats()
					if serr != nil {
						t.Fatal(serr)
					}
					t.Logf("%d bytes in %v; stalls rescued %d, sockets left %d", len(got), took.Round(time.Millisecond), st.Counters.StallsRescued, st.Counters.Left)
					if err != nil {
						t.Fatal(err)
					}
					if !bytes.Equal(got, data) {
						t.Fatalf("got %d bytes that differ from the %d sent", len(got), len(data))
					}
					// Found within a second (the scan), woken at once; on
					// 6.1, where redirected bytes are what FIONREAD misses,
					// read one buffer a wake-up (2.3 s under qemu).
					if took > 5*time.Second {
						t.Errorf("the reader took %v: it waited on a stall", took)
					}
					// Each stall's line says how it was found.
					for _, l := range said() {
						if strings.Contains(l, "goes back to TCP") && strings.Contains(l, " waited on ") == strings.Contains(l, " asked FIONREAD on ") {
							t.Errorf("the guard's line says neither that the reader waited nor what FIONREAD told it: %s", l)
						}
						if strings.Contains(l, " waited on ") && !strings.Contains(l, ", asleep in epoll_") &&
							!strings.Contains(l, ", nothing read for the stall scan's") {
							t.Errorf("the guard's line does not say how the stall was found: %s", l)
						}
					}
				})
			}
		}
	}
}

// The peer's end counts as unread until a read returns 0. A read with room
// to spare takes the peer's FIN with the last bytes (tcp_recvmsg consumes
// a queued FIN), and a reader that takes such a short read for all there
// is and waits for an edge is not told the end by any (nginx's stream
// proxy on 6.18, woken by the stall watch: 2 of 6 runs hung until the end
// counted as unread). The reader here starts once the writer is done and
// does not ask for EPOLLRDHUP, so its one edge is spent on that read; a
// zero-length recv returns 0 too, here with the bytes and the end queued,
// and must not count as being told. Checked failing with each rule taken out: the end taken with
// the bytes (febb1fe before), and the zero-length read.
func TestEndTakenWithTheLastBytesIsTold(t *testing.T) {
	for k, zeroRead := range []bool{false, true} {
		for f, network := range []string{"tcp4", "tcp6"} {
			if !onDiagonal(k, f) {
				continue
			}
			t.Run(fmt.Sprintf("zero-length recv before %v/%s", zeroRead, network), func(t *testing.T) {
				in, c, s, _ := guardedPairLog(t, network, bypass.Options{Mechanisms: host.Mechanisms{KernelFIONREAD: true}})
				// The connection's first bytes, by TCP, fewer than the
				// reader's buffer: one read takes them and the end.
				data := randomBytes(1000, 17)
				sendAll(t, s, data, true)()
				time.Sleep(50 * time.Millisecond) // the FIN on its way
				if zeroRead {
					rawFD(t, c, func(fd int) {
						if n, _, err := unix.Recvfrom(fd, nil, 0); n != 0 || err != nil {
							t.Fatalf("zero-length recv: %d, %v", n, err)
						}
					})
				}
				start := time.Now()
				got, err := fionreadRead(t, c, len(data), fionreadReader{end: true, noRDHUP: true}, 5*time.Second)
				took := time.Since(start)
				st, serr := in.Stats()
				if serr != nil {
					t.Fatal(serr)
				}
				t.Logf("%d bytes and the end in %v; stalls rescued %d", len(got), took.Round(time.Millisecond), st.Counters.StallsRescued)
				if err != nil {
					t.Fatal(err)
				}
				if !bytes.Equal(got, data) {
					t.Fatalf("got %d bytes that differ from the %d sent", len(got), len(data))
				}
			})
		}
	}
}

// A socket whose peer's reader needed TCP leaves the sockhash after the
// settle (a redirect decided before may still land), unless only TCP bytes
// wait for it, behind which none can. A reader that FIONREAD tells 0 for
// those bytes (6.18) waited the settle out: nginx's FastCGI connection to
// php-fpm, whose first blocking read sent both sockets back to TCP, took
// 85 ms more per first request (the settle is 100 ms; 5 s here). A reader
// that reads first hastens the leave at that read; one that asks FIONREAD
// first and sleeps while told 0 (a Perl client polling FIONREAD in front of
// a forked server's blocking read: 113-118 ms for its first answer against
// 12 ms over TCP) is hastened by the FIONREAD watch, where FIONREAD leaves
// those bytes out (6.18 under lockdown).
func TestLeaveBehindTCPBytesDoesNotWaitTheSettle(t *testing.T) {
	for _, tc := range []struct {
		name   string
		poller bool
	}{{"reads first", false}, {"asks FIONREAD first", true}} {
		t.Run(tc.name, func(t *testing.T) {
			// Where FIONREAD counts TCP's bytes (6.1, 6.12) the poller
			// is told them at once, and nothing waits either.
			opts := bypass.Options{Mechanisms: host.Mechanisms{KernelFIONREAD: true}}
			in, c, s, _ := guardedPairLog(t, "tcp4", bypass.WithSettle(opts, 5*time.Second))
			// The request reaches the server by TCP (it never read
			// before), and its blocking read marks it a reader that
			// needs TCP: it leaves at once, its peer after the settle.
			if _, err := c.Write([]byte("req")); err != nil {
				t.Fatal(err)
			}
			rawFD(t, s, func(fd int) {
				if err := unix.SetNonblock(fd, false); err != nil {
					t.Fatal(err)
				}
				defer unix.SetNonblock(fd, true)
				buf := make([]byte, 3)
				if n, err := unix.Read(fd, buf); n != 3 || err != nil {
					t.Fatalf("blocking read: %d, %v", n, err)
				}
			})
			data := randomBytes(256<<10, 9)
			written := sendAll(t, s, data, true)
			start := time.Now()
			var got []byte
			var err error
			if tc.poller {
				got, err = pollFIONREAD(t, c, len(data), 10*time.Second)
			} else {
				got, err = fionreadRead(t, c, len(data), fionreadReader{end: true}, 10*time.Second)
			}
			took := time.Since(start)
			written()
			st, serr := in.Stats()
			if serr != nil {
				t.Fatal(serr)
			}
			t.Logf("%d bytes in %v; directions kept for their reader %d, sockets left %d", len(got), took.Round(time.Millisecond), st.Counters.TCPReaders, st.Counters.Left)
			if err != nil {
				t.Fatal(err)
			}
			if !bytes.Equal(got, data) {
				t.Fatalf("got %d bytes that differ from the %d sent", len(got), len(data))
			}
			if st.Counters.TCPReaders == 0 {
				t.Fatal("the blocking read did not mark the server a reader that needs TCP")
			}
			if took > 2*time.Second {
				t.Errorf("the reader took %v: its socket waited out the settle with only TCP bytes queued", took)
			}
		})
	}
}

// Flow control sends a writer's bytes by TCP once its reader holds more
// than the backlog of redirected ones; those TCP bytes queue behind the
// redirected ones, and the read that drains the psock returns short
// (tcp_bpf_recvmsg reads the psock alone while it holds any). nginx takes a
// short read for all there is and waits for an edge, which those TCP bytes
// raised long before: it hung behind nginx's kept-alive upstreams on 6.1
// (compat's TestNginxProxy/http-keepalive under qemu, 2 of 3 10 MiB
// downloads). Where FIONREAD counts every byte (6.12) or shunt corrects it
// (6.1), nothing counted as hidden and neither the watch nor the scan
// looked; now TCP bytes behind a drained psock of a reader flow control
// marked count (6.18 found it already: FIONREAD misses TCP bytes there).
// The reader starts once the writer is done, so no later edge comes.
func TestShortReadBehindFlowControlNeverStalls(t *testing.T) {
	for _, network := range []string{"tcp4", "tcp6"} {
		t.Run(network, func(t *testing.T) {
			in, c, s := guardedPair(t, network, bypass.Options{MaxBacklog: 64 << 10})
			testenv.Warm(t, c, s)
			// 10,000-byte writes: the psock's bytes are no multiple of
			// the reader's 16 KiB buffer, so the read that drains them
			// is short.
			data := randomBytes(100_000, 13)
			for off := 0; off < len(data); off += 10_000 {
				if _, err := s.Write(data[off : off+10_000]); err != nil {
					t.Fatal(err)
				}
			}
			st, err := in.Stats()
			if err != nil {
				t.Fatal(err)
			}
			if st.Counters.Throttled == 0 {
				t.Fatalf("counters %+v: flow control never sent bytes by TCP: the case is not made", st.Counters)
			}
			start := time.Now()
			got, err := fionreadRead(t, c, len(data), fionreadReader{}, 10*time.Second)
			took := time.Since(start)
			if st, serr := in.Stats(); serr == nil {
				t.Logf("%d bytes in %v; stalls rescued %d, throttled %d", len(got), took.Round(time.Millisecond), st.Counters.StallsRescued, st.Counters.Throttled)
			}
			if err != nil {
				t.Fatal(err)
			}
			if !bytes.Equal(got, data) {
				t.Fatalf("got %d bytes that differ from the %d sent", len(got), len(data))
			}
		})
	}
}

// A reader that never waits for readiness but polls FIONREAD, sleeping a
// millisecond while told 0 and reading exactly what it is told (Java's
// InputStream.available() loops, C programs that sleep-poll): request and
// answer rounds, the first answer a connection's first bytes (by TCP: 6.18
// leaves those out), the later ones redirected (6.1 leaves those out). On
// 6.1 such a reader waited for ever (no edge wakes a sleeper); where
// shunt corrects FIONREAD (no lockdown) it is told every byte and nothing
// has to be rescued; under lockdown (these VMs' 6.18) the stall scan finds
// it within a second and moves the connection to TCP.
func TestFIONREADPollerReadsEverything(t *testing.T) {
	for _, network := range []string{"tcp4", "tcp6"} {
		t.Run(network, func(t *testing.T) {
			in, c, s := guardedPair(t, network, bypass.Options{})
			answer := make([]byte, 300_000)
			rng := rand.NewChaCha8([32]byte{11})
			var slowest time.Duration
			for round := range 4 {
				_, _ = rng.Read(answer)
				go func() {
					if _, err := s.Write(answer); err != nil {
						t.Errorf("answer: %v", err)
					}
				}()
				start := time.Now()
				got, err := pollFIONREAD(t, c, len(answer), 10*time.Second)
				took := time.Since(start)
				t.Logf("round %d: %d bytes in %v", round, len(got), took.Round(time.Millisecond))
				slowest = max(slowest, took)
				if err != nil {
					t.Fatalf("round %d: %v", round, err)
				}
				if !bytes.Equal(got, answer) {
					t.Fatalf("round %d: the %d bytes read differ from the answer", round, len(got))
				}
				// Found by the scan (every 500 ms) where nothing
				// corrects FIONREAD; qemu without KVM is slower.
				if took > 3*time.Second {
					t.Errorf("round %d took %v: the reader waited on a stall", round, took)
				}
				exchange(t, c, s, "next")
			}
			st, err := in.Stats()
			if err != nil {
				t.Fatal(err)
			}
			n := st.Counters
			t.Logf("stalls rescued %d, FIONREAD answers corrected %d", n.StallsRescued, n.FionreadCorrected)
			switch {
			case in.FionreadCorrected():
				if n.FionreadCorrected == 0 || n.StallsRescued != 0 {
					t.Errorf("FIONREAD corrected %d times, %d stalls rescued: want corrected answers and no stall", n.FionreadCorrected, n.StallsRescued)
				}
				programGoesWithTheInstall(t, in, st.Programs, "fionread", "the FIONREAD correction", c, s)
			case host.Probe().FionreadMisses():
				if n.StallsRescued == 0 {
					t.Error("FIONREAD misses bytes here and is not corrected, yet no stall was rescued")
				}
				// Rescued as FIONREAD told it too few, not after the
				// stall scan's 0.5 s with nothing read (508-579 ms
				// for the first answer before the watch on FIONREAD).
				if slowest > 250*time.Millisecond {
					t.Errorf("an answer took %v: the reader FIONREAD told too few was left to the stall scan", slowest)
				}
				programGoesWithTheInstall(t, in, st.Programs, "fionread_told", "the watch on FIONREAD's answers", c, s)
			default:
				if n.StallsRescued != 0 {
					t.Errorf("%d stalls rescued where FIONREAD counts every byte", n.StallsRescued)
				}
			}
		})
	}
}

// Connections of one process that FIONREAD tells too few at once (a
// server's clients whose first bytes came together) are all rescued at
// once, where the answer cannot be corrected: the guard takes the FIONREAD
// watch's reports of one process together, in one pass of the stall scan
// over its files, and none may be left to the scan's 0.5 s.
func TestManyToldShortAtOnceAreAllRescued(t *testing.T) {
	testenv.RequireRoot(t)
	if f := host.Probe(); !f.FionreadMisses() || f.WriteUser {
		t.Skip("the FIONREAD watch runs only where FIONREAD leaves bytes out and cannot be corrected")
	}
	in, cg := mustInstallWith(t, bypass.Options{})
	bypasstest.RunGuard(t, in, func(s string) { t.Logf("guard: %s", s) })
	side := testenv.Side{NS: testenv.MustNetNS(t), CG: cg}
	const n, size = 20, 64 << 10
	fds := make([]int, n)
	for i := range fds {
		c, s := testenv.ConnPair(t, "tcp4", side, "127.0.0.1:0", side, "127.0.0.1:0")
		if _, err := s.Write(randomBytes(size, byte(i))); err != nil {
			t.Fatal(err)
		}
		rawFD(t, c, func(fd int) { fds[i] = fd })
	}
	time.Sleep(20 * time.Millisecond) // loopback: delivered by now
	start := time.Now()
	for _, fd := range fds {
		if _, err := unix.IoctlGetInt(fd, unix.SIOCINQ); err != nil {
			t.Fatal(err)
		}
	}
	// Told right once out of the sockhash.
	for i, fd := range fds {
		for {
			n, err := unix.IoctlGetInt(fd, unix.SIOCINQ)
			if err != nil {
				t.Fatal(err)
			}
			if n == size {
				break
			}
			if time.Since(start) > 250*time.Millisecond {
				t.Fatalf("connection %d of %d: FIONREAD still says %d of %d after %v: left to the stall scan", i+1, len(fds), n, size, time.Since(start).Round(time.Millisecond))
			}
			time.Sleep(time.Millisecond)
		}
	}
	st, err := in.Stats()
	if err != nil {
		t.Fatal(err)
	}
	t.Logf("%d connections told right after %v; %d stalls rescued", len(fds), time.Since(start).Round(time.Millisecond), st.Counters.StallsRescued)
	if st.Counters.StallsRescued < n {
		t.Errorf("%d stalls rescued, want %d", st.Counters.StallsRescued, n)
	}
}

// programGoesWithTheInstall removes the install (its connection closed
// first) and checks that its program name, which runs for every task of the
// host (a tracepoint's), went with it.
func programGoesWithTheInstall(t *testing.T, in *bypass.Install, progs []bypass.Program, name, what string, c, s *net.TCPConn) {
	t.Helper()
	i := slices.IndexFunc(progs, func(p bypass.Program) bool { return p.Name == name })
	if i < 0 {
		t.Fatalf("the install lists no %s program (%s): %+v", name, what, progs)
	}
	c.Close()
	s.Close()
	removeLeavesNoProgram(t, in, progs[i].ID, what)
}

// guardedPair installs shunt with opts, runs a guard on the install and
// connects a pair on loopback (tcp4: 127.0.0.1, tcp6: ::1) in a network
// namespace and cgroup of its own.
func guardedPair(t *testing.T, network string, opts bypass.Options) (*bypass.Install, *net.TCPConn, *net.TCPConn) {
	t.Helper()
	in, c, s, _ := guardedPairLog(t, network, opts)
	return in, c, s
}

// guardedPairLog is guardedPair that also returns what the guard said so
// far.
func guardedPairLog(t *testing.T, network string, opts bypass.Options) (*bypass.Install, *net.TCPConn, *net.TCPConn, func() []string) {
	t.Helper()
	in, cg := mustInstallWith(t, opts)
	c, s, said := guardedPairIn(t, network, in, cg)
	return in, c, s, said
}

// guardedPairIn is guardedPairLog on an install the caller made.
func guardedPairIn(t *testing.T, network string, in *bypass.Install, cg host.Cgroup) (*net.TCPConn, *net.TCPConn, func() []string) {
	t.Helper()
	var mu sync.Mutex
	var lines []string
	bypasstest.RunGuard(t, in, func(s string) {
		t.Logf("guard: %s", s)
		mu.Lock()
		lines = append(lines, s)
		mu.Unlock()
	})
	c, s := connPairOver(t, network, cg)
	return c, s, func() []string {
		mu.Lock()
		defer mu.Unlock()
		return slices.Clone(lines)
	}
}

// pollFIONREAD reads want bytes from c as a reader that polls FIONREAD
// does: asks, sleeps 1 ms while told 0, reads what it was told. Fails after
// timeout with what it got.
func pollFIONREAD(t *testing.T, c *net.TCPConn, want int, timeout time.Duration) ([]byte, error) {
	t.Helper()
	got := make([]byte, 0, want)
	var rerr error
	rawFD(t, c, func(fd int) {
		buf := make([]byte, want)
		for deadline := time.Now().Add(timeout); len(got) < want; {
			n, err := unix.IoctlGetInt(fd, unix.SIOCINQ)
			if err != nil {
				rerr = err
				return
			}
			if n == 0 {
				if time.Now().After(deadline) {
					rerr = fmt.Errorf("stalled: %d of %d bytes read, FIONREAD says 0", len(got), want)
					return
				}
				time.Sleep(time.Millisecond)
				continue
			}
			r, err := unix.Read(fd, buf[:min(n, want-len(got))])
			if err != nil {
				rerr = fmt.Errorf("read after FIONREAD said %d: %w", n, err)
				return
			}
			got = append(got, buf[:r]...)
		}
	})
	return got, rerr
}

// A reader found waiting while the guard's ring has no room (no guard ran
// yet, or it fell behind) is still woken once a guard runs: its socket
// stays in the sockhash until the wake-up's event fits. Before, it left
// with the event dropped and nothing looked at it again: the reader
// waited for ever, with only a counter to show.
func TestStallWithTheRingFullIsWokenLater(t *testing.T) {
	// The bytes FIONREAD leaves out on this kernel: a connection's first,
	// which come by TCP (6.18), or redirected ones (6.1).
	f := host.Probe()
	if f.FionreadCountsTCP && f.PsockCounts {
		t.Skip("FIONREAD counts every queued byte on this kernel: no reader waits on bytes it is not told of")
	}
	// As under lockdown, where shunt cannot correct FIONREAD.
	in, cg := mustInstallWith(t, bypass.Options{Mechanisms: host.Mechanisms{KernelFIONREAD: true}})
	bypasstest.FillGuardRing(t, in.Dir())
	side := testenv.Side{NS: testenv.MustNetNS(t), CG: cg}
	c, s := testenv.ConnPair(t, "tcp4", side, "127.0.0.1:0", side, "127.0.0.1:0")
	if f.FionreadCountsTCP {
		testenv.Warm(t, c, s)
	}
	data := randomBytes(1<<20, 9)
	wrote := make(chan error, 1)
	go func() {
		_, err := s.Write(data)
		wrote <- err
	}()
	// No guard until the watch found the reader waiting and had no room
	// to say so.
	read, started := make(chan struct{}), make(chan struct{})
	go func() {
		defer close(started)
		for deadline := time.Now().Add(10 * time.Second); time.Now().Before(deadline); time.Sleep(20 * time.Millisecond) {
			select {
			case <-read:
				return
			default:
			}
			st, err := in.Stats()
			if err != nil {
				t.Errorf("stats: %v", err)
				return
			}
			if st.Counters.EventsLost > 0 {
				break
			}
		}
		bypasstest.RunGuard(t, in, func(s string) { t.Logf("guard: %s", s) })
	}()
	start := time.Now()
	got, err := fionreadRead(t, c, len(data), fionreadReader{}, 20*time.Second)
	close(read)
	<-started
	st, serr := in.Stats()
	if serr != nil {
		t.Fatal(serr)
	}
	t.Logf("%d bytes in %v; stalls rescued %d, guard events lost %d", len(got), time.Since(start).Round(time.Millisecond), st.Counters.StallsRescued, st.Counters.EventsLost)
	if err != nil {
		c.Close() // the writer, blocked on a reader that stopped, gets an error
		<-wrote
		t.Fatal(err)
	}
	if werr := <-wrote; werr != nil {
		t.Fatalf("write: %v", werr)
	}
	if !bytes.Equal(got, data) {
		t.Fatalf("got %d bytes that differ from the %d sent", len(got), len(data))
	}
	if st.Counters.EventsLost == 0 {
		t.Error("no guard event was lost: the ring was not full when the reader was found")
	}
}

// fionreadReader is how a reader that trusts FIONREAD goes about it.
type fionreadReader struct {
	// askFirst: it asks before its first read after an edge, and reads
	// only when told bytes are there.
	askFirst bool
	// end: it reads until the end (read returns 0), and from the edge that
	// carried EPOLLRDHUP on it reads without asking (nginx's pending_eof).
	end bool
	// noRDHUP: it does not ask epoll for EPOLLRDHUP, so only a read that
	// returns 0 tells it the end.
	noRDHUP bool
}

// fionreadRead reads want bytes from c (and then the end, if how.end) as
// nginx's recv does (src/os/unix/ngx_recv.c, epoll with EPOLLRDHUP): on an
// edge-triggered EPOLLIN it reads 16 KiB buffers; after a full one it asks
// FIONREAD how much is left and counts its reads down from that; told 0, or
// having read more than it was told, it waits for the next edge, even once
// an edge said the end had come. Fails after timeout with what it got.
func fionreadRead(t *testing.T, c *net.TCPConn, want int, how fionreadReader, timeout time.Duration) ([]byte, error) {
	t.Helper()
	raw, err := c.SyscallConn()
	if err != nil {
		t.Fatal(err)
	}
	var got []byte
	var rerr error
	// One thread, as nginx's worker: the watch looks at the thread that
	// read last, and a goroutine moved to another between its read and
	// its wait left the watch looking at a thread parked in futex (the
	// stall scan then found the reader, after 0.5 s).
	runtime.LockOSThread()
	defer runtime.UnlockOSThread()
	err = raw.Control(func(fd uintptr) {
		got, rerr = fionreadLoop(int(fd), want, how, time.Now().Add(timeout))
	})
	if err != nil {
		t.Fatal(err)
	}
	return got, rerr
}

func fionreadLoop(fd, want int, how fionreadReader, deadline time.Time) ([]byte, error) {
	ep, err := unix.EpollCreate1(unix.EPOLL_CLOEXEC)
	if err != nil {
		return nil, err
	}
	defer unix.Close(ep)
	ev := unix.EpollEvent{Events: unix.EPOLLIN | unix.EPOLLOUT | unix.EPOLLRDHUP | unix.EPOLLET, Fd: int32(fd)}
	if how.noRDHUP {
		ev.Events &^= unix.EPOLLRDHUP
	}
	if err := unix.EpollCtl(ep, unix.EPOLL_CTL_ADD, fd, &ev); err != nil {
		return nil, err
	}
	got := make([]byte, 0, want)
	buf := make([]byte, 16<<10)
	events := make([]unix.EpollEvent, 1)
	var trail []string
	step := func(s string) { trail = append(trail[max(0, len(trail)-8):], s) }
	pendingEnd := false
	for len(got) < want || how.end {
		left := time.Until(deadline)
		if left <= 0 {
			return got, fmt.Errorf("stalled: %d of %d bytes after the deadline (an edge told the end: %v); last steps: %s", len(got), want, pendingEnd, strings.Join(trail, ", "))
		}
		n, err := unix.EpollWait(ep, events, int(left/time.Millisecond)+1)
		if err == unix.EINTR || n == 0 {
			continue
		}
		if err != nil {
			return got, err
		}
		if events[0].Events&unix.EPOLLIN == 0 {
			continue
		}
		if events[0].Events&unix.EPOLLRDHUP != 0 {
			pendingEnd = true
		}
		// avail: what FIONREAD said is left, less what was read since;
		// -1: not asked since the edge.
		avail := -1
		if how.askFirst && !pendingEnd {
			if avail, err = unix.IoctlGetInt(fd, unix.SIOCINQ); err != nil {
				return got, err
			}
			step(fmt.Sprintf("first FIONREAD %d", avail))
		}
		for avail != 0 || pendingEnd {
			r, err := unix.Read(fd, buf)
			if err == unix.EAGAIN {
				break
			}
			if err != nil {
				return got, err
			}
			if r == 0 {
				if how.end && len(got) == want {
					return got, nil
				}
				return got, fmt.Errorf("EOF after %d of %d bytes", len(got), want)
			}
			got = append(got, buf[:r]...)
			if avail >= 0 {
				avail -= r
				if avail < 0 {
					// More than told: nginx takes it that bytes came
					// since, and waits for their edge.
					step(fmt.Sprintf("read past FIONREAD at %d", len(got)))
					break
				}
			} else if r == len(buf) {
				if avail, err = unix.IoctlGetInt(fd, unix.SIOCINQ); err != nil {
					return got, err
				}
				if avail == 0 {
					step(fmt.Sprintf("FIONREAD 0 at %d", len(got)))
				}
			}
			if r < len(buf) {
				if !pendingEnd {
					break
				}
				avail = 0
			}
		}
	}
	return got, nil
}

// BenchmarkStallScan prices one pass of the stall scan (the guard runs it
// every bypass.StallScanInterval) with 15,000 more open files on the host
// than it has, 1,000 of them held sockets: it visits every open file.
func BenchmarkStallScan(b *testing.B) {
	testenv.RequireRoot(b)
	pin := bypasstest.MustPinDir(b)
	cg := testenv.MustCgroup(b)
	in, err := bypass.Create(pin, bypass.Options{})
	if err != nil {
		b.Fatal(err)
	}
	b.Cleanup(func() { in.Close() })
	if _, err := in.Attach(cg); err != nil {
		b.Fatal(err)
	}
	side := testenv.Side{NS: testenv.MustNetNS(b), CG: cg}
	for i := 0; i < 500; i++ {
		c, s := testenv.ConnPair(b, "tcp4", side, "127.0.0.1:0", side, "127.0.0.1:0")
		testenv.Warm(b, c, s)
	}
	testenv.MustOpenFiles(b, 14000)
	scan, err := in.OpenStallScan()
	if err != nil {
		b.Fatal(err)
	}
	defer scan.Close()
	b.ResetTimer()
	for i := 0; i < b.N; i++ {
		if _, err := scan.Run(); err != nil {
			b.Fatal(err)
		}
	}
	b.ReportMetric(float64(b.Elapsed().Microseconds())/float64(b.N)/float64(bypass.StallScanInterval.Milliseconds())/10, "%cpu")
}

// The stall scan also moves a connection whose peer's end sits unread: a
// server that keeps a half-closed connection open and answers later (the
// client shut its side after the request) loses the bypass, not a byte.
// Its answer arrives whole after the move, and its own read of the end
// still returns 0, as over TCP.
func TestHalfClosedServerAnswersAfterTheScan(t *testing.T) {
	for _, network := range []string{"tcp4", "tcp6"} {
		t.Run(network, func(t *testing.T) {
			in, c, s := guardedPair(t, network, bypass.Options{})
			testenv.Warm(t, c, s)
			exchange(t, c, s, "request")
			if err := c.CloseWrite(); err != nil {
				t.Fatal(err)
			}
			// The server leaves the end unread until the scan (every
			// 500 ms) has found it: under qemu without KVM one pass can
			// take longer than a fixed sleep allowed (seen on 6.1: not
			// found in 1.3 s, though the answer came through intact).
			for deadline := time.Now().Add(15 * time.Second); ; time.Sleep(50 * time.Millisecond) {
				if st, err := in.Stats(); err == nil && st.Counters.StallsRescued > 0 {
					break
				}
				if time.Now().After(deadline) {
					t.Fatal("the unread end was not found by the scan in 15 s")
				}
			}
			answer := randomBytes(1<<20, 9)
			go func() {
				if _, err := s.Write(answer); err != nil {
					t.Errorf("answer: %v", err)
				}
				s.CloseWrite()
			}()
			c.SetReadDeadline(time.Now().Add(10 * time.Second))
			got, err := io.ReadAll(c)
			if err != nil || !bytes.Equal(got, answer) {
				t.Fatalf("client read %d bytes (%v), want the %d-byte answer intact", len(got), err, len(answer))
			}
			s.SetReadDeadline(time.Now().Add(5 * time.Second))
			if n, err := s.Read(make([]byte, 1)); n != 0 || err != io.EOF {
				t.Errorf("the server's read of the end: %d, %v; want 0, EOF", n, err)
			}
		})
	}
}

// A connection its program keeps but no one waits on (a pool's idle
// connection: Apache's to its origin, a client library's), whose peer
// closed, is not a stall: any later poll, epoll registration or read sees
// the end at once, as over TCP. The scan neither counts nor logs it (it
// may move it to TCP quietly), and the end is still there to read.
func TestIdleEndIsNotAStall(t *testing.T) {
	for _, network := range []string{"tcp4", "tcp6"} {
		t.Run(network, func(t *testing.T) {
			in, cg := mustInstallWith(t, bypass.Options{})
			bypasstest.RunGuard(t, in, func(s string) { t.Logf("guard: %s", s) })
			side := testenv.Side{NS: testenv.MustNetNS(t), CG: cg}
			addr := map[string]string{"tcp4": "127.0.0.1:0", "tcp6": "[::1]:0"}[network]
			ln := testenv.Listen(t, side, network, addr)
			fd := rawDial(t, side, ln.Addr().(*net.TCPAddr))
			s := testenv.Accept(t, ln)
			// Round trips, so that its reader is seen and the server's
			// bytes come by redirect.
			for range 3 {
				if _, err := unix.Write(fd, []byte{'q'}); err != nil {
					t.Fatal(err)
				}
				if _, err := io.ReadFull(s, make([]byte, 1)); err != nil {
					t.Fatal(err)
				}
				if _, err := s.Write([]byte{'a'}); err != nil {
					t.Fatal(err)
				}
				rawReadN(t, fd, 1)
			}
			answer := bytes.Repeat([]byte{'x'}, 64<<10)
			if _, err := s.Write(answer); err != nil {
				t.Fatal(err)
			}
			if err := s.CloseWrite(); err != nil {
				t.Fatal(err)
			}
			if got := rawReadN(t, fd, len(answer)); !bytes.Equal(got, answer) {
				t.Fatal("the answer differs")
			}
			// Idle, the end unread, no one polling: three scans' time.
			time.Sleep(3*bypass.StallScanInterval + 100*time.Millisecond)
			st, err := in.Stats()
			if err != nil {
				t.Fatal(err)
			}
			if st.Counters.StallsRescued != 0 {
				t.Errorf("an idle connection with its end unread was counted as %d stall(s)", st.Counters.StallsRescued)
			}
			pfd := []unix.PollFd{{Fd: int32(fd), Events: unix.POLLIN | unix.POLLRDHUP}}
			if n, err := unix.Poll(pfd, 0); n != 1 || err != nil || pfd[0].Revents&unix.POLLRDHUP == 0 {
				t.Fatalf("poll of the idle connection: %d, %v, revents %#x; want the end", n, err, pfd[0].Revents)
			}
			if n, _, err := unix.Recvfrom(fd, make([]byte, 16), unix.MSG_DONTWAIT); n != 0 || err != nil {
				t.Errorf("read of the end: %d, %v; want 0", n, err)
			}
		})
	}
}

// rawDial connects a socket no Go poller watches (no epoll registration:
// nothing waits on it between the test's own polls) from side to addr.
func rawDial(t *testing.T, side testenv.Side, addr *net.TCPAddr) int {
	t.Helper()
	var fd int
	var err error
	side.Make(t, func() {
		var sa unix.Sockaddr
		family := unix.AF_INET6
		if ip4 := addr.IP.To4(); ip4 != nil {
			family = unix.AF_INET
			sa = &unix.SockaddrInet4{Port: addr.Port, Addr: [4]byte(ip4)}
		} else {
			sa = &unix.SockaddrInet6{Port: addr.Port, Addr: [16]byte(addr.IP.To16())}
		}
		if fd, err = unix.Socket(family, unix.SOCK_STREAM|unix.SOCK_CLOEXEC, 0); err != nil {
			return
		}
		if err = unix.Connect(fd, sa); err != nil {
			unix.Close(fd)
		}
	})
	if err != nil {
		t.Fatalf("raw dial %v: %v", addr, err)
	}
	t.Cleanup(func() { unix.Close(fd) })
	return fd
}

// rawReadN reads n bytes from fd as an event loop does: poll, then recv
// with MSG_DONTWAIT, never past n (so an end behind them stays unread).
func rawReadN(t *testing.T, fd, n int) []byte {
	t.Helper()
	got := make([]byte, 0, n)
	buf := make([]byte, n)
	for deadline := time.Now().Add(10 * time.Second); len(got) < n; {
		pfd := []unix.PollFd{{Fd: int32(fd), Events: unix.POLLIN}}
		if _, err := unix.Poll(pfd, 100); err != nil && err != unix.EINTR {
			t.Fatal(err)
		}
		m, _, err := unix.Recvfrom(fd, buf[:n-len(got)], unix.MSG_DONTWAIT)
		switch {
		case err == unix.EAGAIN || err == unix.EINTR:
		case err != nil:
			t.Fatal(err)
		case m == 0:
			t.Fatalf("end of stream after %d of %d bytes", len(got), n)
		default:
			got = append(got, buf[:m]...)
		}
		if time.Now().After(deadline) {
			t.Fatalf("%d of %d bytes in 10 s", len(got), n)
		}
	}
	return got
}

// A reader that stops reading to sleep or to wait for something else is
// not waiting for an edge of its socket, however many bytes FIONREAD leaves
// out meanwhile: no stall is counted or logged, and the connection stays
// bypassed. PostgreSQL does both in a COPY that left bytes unread: its
// pg_usleep is a select with no descriptors (between retries while its
// checkpointer's queue is full), and it waits for its latch in an epoll set
// of its own, apart from the one that watches the client's socket. The
// watch took either for a wait for readiness: pgbench -i's COPY was
// "rescued" with 3-5 MiB queued. OpenSSH polls a forwarded connection
// without asking for input while its channel's window is full: sshd was
// "rescued" in ppoll in 2 of 40 10 MiB downloads through ssh -L. The bytes
// are the connection's first (TCP's: hidden on 6.18) or redirected (hidden
// on 6.1).
func TestSleepingReaderIsNotAStall(t *testing.T) {
	for p, pause := range []struct {
		name string
		do   func(t *testing.T, fd int)
	}{
		{"select and poll without descriptors", sleepWithoutDescriptors},
		{"epoll_wait on another set", waitOnAnotherSet},
		{"poll and select not for input", pollNotForInput},
		{"epoll_wait on a set not watching input", epollNotForInput},
	} {
		for w, warm := range []bool{false, true} {
			for f, network := range []string{"tcp4", "tcp6"} {
				if !onDiagonal(p+w, f) {
					continue
				}
				t.Run(fmt.Sprintf("%s/%s/warm=%v", pause.name, network, warm), func(t *testing.T) {
					sleepingReader(t, network, warm, pause.do)
				})
			}
		}
	}
}

// sleepWithoutDescriptors sleeps as PostgreSQL's pg_usleep does.
func sleepWithoutDescriptors(t *testing.T, _ int) {
	tv := unix.Timeval{Usec: 150_000}
	if _, err := unix.Select(0, nil, nil, nil, &tv); err != nil && err != unix.EINTR {
		t.Fatalf("select as a sleep: %v", err)
	}
	if _, err := unix.Poll(nil, 150); err != nil && err != unix.EINTR {
		t.Fatalf("poll as a sleep: %v", err)
	}
}

// waitOnAnotherSet waits on an epoll set holding an eventfd alone
// (PostgreSQL's latch).
func waitOnAnotherSet(t *testing.T, _ int) {
	ep := mustEpoll(t, mustEventfd(t), unix.EPOLLIN)
	if _, err := unix.EpollWait(ep, make([]unix.EpollEvent, 1), 300); err != nil && err != unix.EINTR {
		t.Fatalf("epoll_wait on the other set: %v", err)
	}
}

// pollNotForInput polls the socket without asking for input, beside an
// eventfd (OpenSSH's ppoll while its channel's window is full), then
// selects it for exceptions only.
func pollNotForInput(t *testing.T, fd int) {
	fds := []unix.PollFd{{Fd: int32(fd)}, {Fd: int32(mustEventfd(t)), Events: unix.POLLIN}}
	if _, err := unix.Poll(fds, 150); err != nil && err != unix.EINTR {
		t.Fatalf("poll: %v", err)
	}
	var except unix.FdSet
	except.Set(fd)
	tv := unix.Timeval{Usec: 150_000}
	if _, err := unix.Select(fd+1, nil, nil, &except, &tv); err != nil && err != unix.EINTR {
		t.Fatalf("select: %v", err)
	}
}

// epollNotForInput waits on an epoll set that holds the socket with no
// events asked.
func epollNotForInput(t *testing.T, fd int) {
	ep := mustEpoll(t, fd, 0)
	if _, err := unix.EpollWait(ep, make([]unix.EpollEvent, 1), 300); err != nil && err != unix.EINTR {
		t.Fatalf("epoll_wait: %v", err)
	}
}

// mustEventfd is an eventfd closed when the test ends.
func mustEventfd(t *testing.T) int {
	fd, err := unix.Eventfd(0, unix.EFD_CLOEXEC)
	if err != nil {
		t.Fatal(err)
	}
	t.Cleanup(func() { unix.Close(fd) })
	return fd
}

// mustEpoll is an epoll set watching fd for events, closed when the test
// ends.
func mustEpoll(t *testing.T, fd int, events uint32) int {
	ep, err := unix.EpollCreate1(unix.EPOLL_CLOEXEC)
	if err != nil {
		t.Fatal(err)
	}
	t.Cleanup(func() { unix.Close(ep) })
	if err := unix.EpollCtl(ep, unix.EPOLL_CTL_ADD, fd, &unix.EpollEvent{Events: events, Fd: int32(fd)}); err != nil {
		t.Fatal(err)
	}
	return ep
}

func sleepingReader(t *testing.T, network string, warm bool, pause func(t *testing.T, fd int)) {
	in, c, s := guardedPair(t, network, bypass.Options{Mechanisms: host.Mechanisms{KernelFIONREAD: true}})
	if warm {
		testenv.Warm(t, c, s)
	}
	data := randomBytes(1<<20, 9)
	written := sendAll(t, s, data, false)
	var got []byte
	func() {
		// The watch looks at the thread that read last.
		runtime.LockOSThread()
		defer runtime.UnlockOSThread()
		// Queued first, so that the read leaves most of it behind
		// (which arms the watch).
		time.Sleep(50 * time.Millisecond)
		rawFD(t, c, func(fd int) {
			got = rawReadN(t, fd, 64<<10)
			pause(t, fd)
			got = append(got, rawReadN(t, fd, len(data)-len(got))...)
		})
	}()
	written()
	if !bytes.Equal(got, data) {
		t.Fatalf("got %d bytes that differ from the %d sent", len(got), len(data))
	}
	st, err := in.Stats()
	if err != nil {
		t.Fatal(err)
	}
	if st.Counters.StallsRescued != 0 {
		t.Errorf("a reader that paused without waiting on its socket was counted as %d stall(s)", st.Counters.StallsRescued)
	}
}

// randomBytes is n reproducible bytes from seed.
func randomBytes(n int, seed byte) []byte {
	b := make([]byte, n)
	_, _ = rand.NewChaCha8([32]byte{seed}).Read(b)
	return b
}

// sendAll writes data to s from a goroutine, then closes s if end; the
// returned function waits for it.
func sendAll(t *testing.T, s *net.TCPConn, data []byte, end bool) (wait func()) {
	t.Helper()
	done := make(chan struct{})
	go func() {
		defer close(done)
		if _, err := s.Write(data); err != nil {
			t.Errorf("write: %v", err)
		}
		if end {
			s.Close()
		}
	}()
	return func() { <-done }
}
