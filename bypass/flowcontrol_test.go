package bypass_test

import (
	"fmt"
	"io"
	"os"
	"sync/atomic"
	"testing"
	"time"

	"golang.org/x/sys/unix"

	"github.com/shunt-project/shunt/bypass"
	"github.com/shunt-project/shunt/host"
	"github.com/shunt-project/shunt/internal/testenv"
)

// counting counts what a writer's Write calls accepted.
type counting struct {
	w io.Writer
	n *atomic.Int64
}

func (c counting) Write(b []byte) (int, error) {
	n, err := c.w.Write(b)
	c.n.Add(int64(n))
	return n, err
}

// Flow control: a reader that stops reading bounds what its writer can hand
// over, the writer blocks as over TCP, no byte is lost or reordered, and the
// flow returns to the redirect path once the reader has caught up. A reader
// that set SO_RCVBUF is held to that instead of the install's limit. One
// whose netns lets TCP grow its buffer less (tcp_rmem[2] of 6 MiB, 6.1's
// and 6.12's default) is held to what that leaves beside its writer's send
// buffer (its SO_SNDBUF, else tcp_wmem[2]) and an eighth of it: with the
// install's 8 MiB there, a throttled stream's TCP segments were dropped and
// resent after RTOs.
func TestFlowControlBoundsBacklog(t *testing.T) {
	flowControlBoundsBacklog(t, bypass.Options{})
}

// The same where sk_msg reads the receiver with bpf_probe_read_kernel, as on
// kernels without bpf_rdonly_cast (6.1), forced on this one.
func TestFlowControlByProbeReads(t *testing.T) {
	flowControlBoundsBacklog(t, bypass.Options{Mechanisms: host.Mechanisms{ProbeReads: true}})
}

// backlogCase is a reader stopped behind a writer, with the buffers each set.
type backlogCase struct {
	name           string
	rcvbuf, sndbuf int // 0: leave the socket's buffer to the kernel
	rmem, wmem     int // 0: the netns's tcp_rmem[2], tcp_wmem[2] as they come
	held           int64
}

func flowControlBoundsBacklog(t *testing.T, opts bypass.Options) {
	// The stopped reader's 64 MiB stream goes by TCP once throttled, more
	// than it redirected: past BehindBytes the connection would go back to
	// TCP before the check that redirects resume (TestReaderBehindGoesBackToTCP).
	in, cg := mustInstallWith(t, bypass.WithBehindReader(opts, ^uint32(0), 0))
	// held: what the writer may hand over in all: the bound, one send more,
	// and what TCP itself buffers once sends take it (send and receive queue).
	for _, tc := range []backlogCase{
		{name: "install limit", held: bypass.DefaultMaxBacklog + 8<<20},
		// Below the install's limit alone: only the receiver's own
		// SO_RCVBUF can have stopped the redirect this early.
		{name: "receiver SO_RCVBUF", rcvbuf: 256 << 10, held: 8 << 20},
		{name: "netns tcp_rmem 6 MiB", rmem: 6 << 20, held: bypass.DefaultMaxBacklog + 8<<20},
		// A writer whose send buffer is set small leaves the reader more
		// room: 6 MiB less 9/8 of its buffer.
		{name: "writer SO_SNDBUF", sndbuf: 256 << 10, rmem: 6 << 20, held: bypass.DefaultMaxBacklog + 8<<20},
		// Send buffers that may grow to the whole receive buffer leave no
		// room: the redirect carries only what the reader keeps up with.
		{name: "netns tcp_wmem as tcp_rmem", rmem: 6 << 20, wmem: 6 << 20, held: bypass.DefaultMaxBacklog + 8<<20},
	} {
		t.Run(tc.name, func(t *testing.T) { boundedBacklog(t, in, cg, tc) })
	}
}

func boundedBacklog(t *testing.T, in *bypass.Install, cg host.Cgroup, tc backlogCase) {
	ns := testenv.MustNetNS(t)
	var bufs bypass.TCPBuffers
	ns.Do(t, func() {
		for name, most := range map[string]int{"tcp_rmem": tc.rmem, "tcp_wmem": tc.wmem} {
			if most == 0 {
				continue
			}
			if err := os.WriteFile("/proc/sys/net/ipv4/"+name, fmt.Appendf(nil, "4096 131072 %d", most), 0); err != nil {
				t.Fatal(err)
			}
		}
		var err error
		if bufs, err = bypass.ReadTCPBuffers(); err != nil {
			t.Fatal(err)
		}
	})
	side := testenv.Side{NS: ns, CG: cg}
	c, s := testenv.ConnPair(t, "tcp4", side, "127.0.0.1:0", side, "127.0.0.1:0")
	if tc.rcvbuf > 0 {
		if err := s.SetReadBuffer(tc.rcvbuf); err != nil {
			t.Fatal(err)
		}
	}
	writerMost := bufs.WmemMax
	if tc.sndbuf > 0 {
		if err := c.SetWriteBuffer(tc.sndbuf); err != nil {
			t.Fatal(err)
		}
		// The kernel doubles what it is given, within net.core.wmem_max.
		raw, err := c.SyscallConn()
		if err != nil {
			t.Fatal(err)
		}
		var got int
		var gerr error
		if err := raw.Control(func(fd uintptr) { got, gerr = unix.GetsockoptInt(int(fd), unix.SOL_SOCKET, unix.SO_SNDBUF) }); err != nil || gerr != nil {
			t.Fatal(err, gerr)
		}
		writerMost = uint64(got)
	}
	testenv.Warm(t, c, s)

	for _, conn := range []interface{ SetDeadline(time.Time) error }{c, s} {
		_ = conn.SetDeadline(time.Now().Add(60 * time.Second))
	}
	stream := testenv.Stream{Seed: 42, Size: 64 << 20, MaxChunk: 64 << 10}
	var accepted atomic.Int64
	wrote := make(chan error, 1)
	go func() { wrote <- stream.Write(counting{c, &accepted}) }()

	// The reader reads nothing yet: wait until the writer is held (no
	// progress for 300 ms), however long a busy machine takes to get there.
	held := waitStalled(t, &accepted, 300*time.Millisecond, 30*time.Second)
	if held > tc.held {
		t.Fatalf("writer handed over %d MiB with the reader stopped; want at most %d MiB", held>>20, tc.held>>20)
	}
	f := flowOf(t, in, testenv.Cookie(t, c))
	if f == nil || f.Client == nil || !f.Client.Throttled || f.Client.TxBytes == 0 {
		t.Fatalf("flow not shown throttled after a redirected start: %+v", f.Client)
	}
	t.Logf("held %.1f MiB with the reader stopped (%.1f MiB by redirect)", float64(held)/(1<<20), float64(f.Client.TxBytes)/(1<<20))
	// What TCP's buffers leave (as bypass.BacklogBound says: shunt status
	// prints it), and one send more; where the reader kept its own buffer,
	// that much at least, so the writer's send buffer was read, not assumed.
	if tc.rcvbuf == 0 {
		bound := bypass.BacklogBound(bypass.DefaultMaxBacklog, bufs.RmemMax, writerMost)
		if got := f.Client.TxBytes; got > bound+64<<10 || got < bound {
			t.Fatalf("redirected %d bytes to a stopped reader (tcp_rmem[2] %d, writer's send buffer up to %d): want %d and one send at most, at least %d",
				got, bufs.RmemMax, writerMost, bound, bound)
		}
	}

	if err := stream.Check(s, false); err != nil {
		t.Fatal(err)
	}
	if err := <-wrote; err != nil {
		t.Fatal(err)
	}
	// Caught up: sends go by redirect again, unless the stall scan found
	// the stopped reader (it reads nothing for 500 ms with bytes queued, on
	// a slow machine) and moved the connection to TCP, which is allowed.
	f = flowOf(t, in, testenv.Cookie(t, c))
	if f == nil || f.Client == nil {
		st, _ := in.Stats()
		if st.Counters.StallsRescued == 0 {
			t.Fatalf("the connection left shunt after the reader caught up, and no stall was rescued: %+v", st.Counters)
		}
		t.Logf("the stall scan moved the stopped reader's connection to TCP (%d rescued): redirect after catching up not checked", st.Counters.StallsRescued)
		return
	}
	before := f.Client.TxMsgs
	exchange(t, c, s, "caught up")
	f = flowOf(t, in, testenv.Cookie(t, c))
	if f.Client.TxMsgs != before+1 || f.Client.Throttled {
		t.Errorf("after the reader caught up the send took TCP (redirected sends %d -> %d, throttled %v)",
			before, f.Client.TxMsgs, f.Client.Throttled)
	}
	if st, _ := in.Stats(); st.Counters.Throttled == 0 {
		t.Error("throttling not counted")
	}
	c.Close()
	s.Close()
}

// A non-blocking writer to a reader that stopped: as over plain TCP it gets
// EAGAIN after a bounded amount and poll says not writable; once the reader
// has read everything (in order), the socket is writable again.
func TestFlowControlNonBlockingWriter(t *testing.T) {
	in, enabled := mustInstall(t)
	plain := testenv.MustCgroup(t)
	for _, tc := range []struct {
		name  string
		cg    host.Cgroup
		bound int64
	}{
		{"plain TCP", plain, 64 << 20},
		{"shunt", enabled, bypass.DefaultMaxBacklog + 8<<20},
	} {
		t.Run(tc.name, func(t *testing.T) {
			ns := testenv.MustNetNS(t)
			side := testenv.Side{NS: ns, CG: tc.cg}
			c, s := testenv.ConnPair(t, "tcp4", side, "127.0.0.1:0", side, "127.0.0.1:0")
			testenv.Warm(t, c, s)
			s.SetDeadline(time.Now().Add(30 * time.Second))

			var accepted int64
			chunk := make([]byte, 64<<10)
			writable := func(fd int) bool {
				fds := []unix.PollFd{{Fd: int32(fd), Events: unix.POLLOUT}}
				unix.Poll(fds, 0)
				return fds[0].Revents&unix.POLLOUT != 0
			}
			rawFD(t, c, func(fd int) {
				for {
					for i := range chunk {
						chunk[i] = byte((accepted + int64(i)) % 251)
					}
					n, err := unix.Write(fd, chunk)
					if err == unix.EAGAIN {
						break
					}
					if err != nil {
						t.Fatalf("write: %v", err)
					}
					if accepted += int64(n); accepted > tc.bound {
						t.Fatalf("the writer handed over %d MiB without EAGAIN, want at most %d MiB", accepted>>20, tc.bound>>20)
					}
				}
				if writable(fd) {
					t.Errorf("poll says writable right after EAGAIN")
				}
			})
			t.Logf("EAGAIN after %.1f MiB", float64(accepted)/(1<<20))
			if f := flowOf(t, in, testenv.Cookie(t, c)); tc.cg == enabled && (f == nil || f.Client.TxBytes == 0 || !f.Client.Throttled) {
				t.Fatalf("the shunt run did not redirect, then throttle: %+v", f)
			}

			got := make([]byte, 256<<10)
			for read := int64(0); read < accepted; {
				n, err := s.Read(got)
				if err != nil {
					t.Fatalf("read at %d of %d: %v", read, accepted, err)
				}
				for i, b := range got[:n] {
					if want := byte((read + int64(i)) % 251); b != want {
						t.Fatalf("byte %d is %d, want %d", read+int64(i), b, want)
					}
				}
				read += int64(n)
			}
			rawFD(t, c, func(fd int) {
				deadline := time.Now().Add(2 * time.Second)
				for !writable(fd) && time.Now().Before(deadline) {
					time.Sleep(time.Millisecond)
				}
				if !writable(fd) {
					t.Error("not writable after the reader read everything")
				}
			})
		})
	}
}

// waitStalled waits until n has not moved for quiet and returns it; it fails
// the test if n still moves after limit.
func waitStalled(t *testing.T, n *atomic.Int64, quiet, limit time.Duration) int64 {
	t.Helper()
	end := time.Now().Add(limit)
	last, since := n.Load(), time.Now()
	for time.Since(since) < quiet {
		if time.Now().After(end) {
			t.Fatalf("the writer still moves after %v (%d MiB): it is not held", limit, n.Load()>>20)
		}
		time.Sleep(10 * time.Millisecond)
		if now := n.Load(); now != last {
			last, since = now, time.Now()
		}
	}
	return last
}
