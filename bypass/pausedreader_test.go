package bypass_test

import (
	"bytes"
	"fmt"
	"runtime"
	"testing"
	"time"

	"golang.org/x/sys/unix"

	"github.com/shunt-project/shunt/bypass"
)

// A reader that stops reading for a while with bytes queued, sleeping in
// epoll_wait on its socket among others, waits on its own writes (Go's
// nats-server stops reading a publisher while subscribers are slow; a Go
// proxy blocks in Write to a slow client), not on an edge: it reads on by
// itself. The stall watch cannot tell it from nginx waiting for an edge by
// its sleep alone. What tells them apart: nginx was told 0 by FIONREAD
// since its last read (the FIONREAD watch notes it where shunt cannot
// correct the answer), and answers a wake-up by reading. This one was told
// nothing and reads nothing when woken: it keeps its bypass. Before, on
// 6.18 under lockdown (the connection's first bytes came by TCP, which
// FIONREAD leaves out there), it was taken for a stall within 2 ms and its
// connection moved to TCP for good. It is woken once at most, not at each
// pause within a second (a Go proxy pauses at each write to a slow client, and
// each wake-up costs the guard a look through the process's descriptors).
func TestPausedReaderKeepsTheBypass(t *testing.T) {
	for _, network := range []string{"tcp4", "tcp6"} {
		t.Run(network, func(t *testing.T) {
			in, c, s, said := guardedPairLog(t, network, bypass.Options{})
			// All queued before the first read (by TCP: the reader was
			// not seen yet), so no new bytes raise an edge in the pauses.
			data := randomBytes(64<<10, 9)
			sendAll(t, s, data, false)()
			before, err := in.Stats()
			if err != nil {
				t.Fatal(err)
			}
			var got []byte
			var woken int
			rawFD(t, c, func(fd int) { got, woken, err = pausedRead(fd, len(data), 16<<10, 2, 300*time.Millisecond) })
			if err != nil {
				t.Fatal(err)
			}
			// Once where the watch looks (6.18 under lockdown: FIONREAD
			// leaves the TCP bytes out), never where nothing is hidden.
			if woken > 1 {
				t.Errorf("woken %d times in two pauses 300 ms apart, want once at most", woken)
			}
			if !bytes.Equal(got, data) {
				t.Fatalf("got %d bytes that differ from the %d sent", len(got), len(data))
			}
			after, err := in.Stats()
			if err != nil {
				t.Fatal(err)
			}
			if n := after.Counters.StallsRescued - before.Counters.StallsRescued; n != 0 {
				t.Errorf("%d stalls rescued (guard: %q): the pause was taken for one", n, said())
			}
			if n := mapEntries(t, in, "sock_hash"); n != 2 {
				t.Errorf("%d sockets in the sockhash after the pause, want 2", n)
			}
			exchange(t, s, c, "still bypassed")
		})
	}
}

// pausedRead reads want bytes from fd as an edge-triggered event loop
// whose reads of this socket wait on something else for a while: pauses
// times it reads first bytes once, then sleeps in epoll_wait for pause
// whatever the events; then it reads until it has want. woken: the events
// it slept through (the writer is done: each is the guard's wake-up).
func pausedRead(fd, want, first, pauses int, pause time.Duration) (got []byte, woken int, err error) {
	runtime.LockOSThread() // the watch looks at the thread that read
	defer runtime.UnlockOSThread()
	ep, err := unix.EpollCreate1(unix.EPOLL_CLOEXEC)
	if err != nil {
		return nil, 0, err
	}
	defer unix.Close(ep)
	ev := unix.EpollEvent{Events: unix.EPOLLIN | unix.EPOLLRDHUP | unix.EPOLLET, Fd: int32(fd)}
	if err := unix.EpollCtl(ep, unix.EPOLL_CTL_ADD, fd, &ev); err != nil {
		return nil, 0, err
	}
	events := make([]unix.EpollEvent, 1)
	wait := func(d time.Duration) (int, error) {
		n, err := unix.EpollWait(ep, events, int(d/time.Millisecond)+1)
		if err == unix.EINTR {
			return 0, nil
		}
		return n, err
	}
	got = make([]byte, 0, want)
	if _, err := wait(5 * time.Second); err != nil {
		return nil, 0, err
	}
	buf := make([]byte, first)
	for range pauses {
		n, _, err := unix.Recvfrom(fd, buf, unix.MSG_DONTWAIT)
		if err != nil {
			return got, woken, fmt.Errorf("read before a pause: %w", err)
		}
		got = append(got, buf[:n]...)
		for end := time.Now().Add(pause); time.Now().Before(end); {
			n, err := wait(time.Until(end))
			if err != nil {
				return got, woken, err
			}
			woken += n
		}
	}
	buf = make([]byte, 64<<10)
	for deadline := time.Now().Add(10 * time.Second); len(got) < want; {
		n, _, err := unix.Recvfrom(fd, buf, unix.MSG_DONTWAIT)
		switch {
		case err == unix.EAGAIN:
			if time.Now().After(deadline) {
				return got, woken, fmt.Errorf("%d of %d bytes after the pauses", len(got), want)
			}
			if _, err := wait(100 * time.Millisecond); err != nil {
				return got, woken, err
			}
		case err != nil:
			return got, woken, err
		case n == 0:
			return got, woken, fmt.Errorf("end of stream at %d of %d bytes", len(got), want)
		default:
			got = append(got, buf[:n]...)
		}
	}
	return got, woken, nil
}
