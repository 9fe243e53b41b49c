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
// its sleep alone. What tells them apart: nginx answers a wake-up by
// reading a buffer and waiting again; this one reads nothing when woken,
// and keeps its bypass. Before, on
// 6.18 under lockdown (the connection's first bytes came by TCP, which
// FIONREAD leaves out there), it was taken for a stall within 2 ms and its
// connection moved to TCP for good. It is woken once at most, not at each
// pause within a second (a Go proxy pauses at each write to a slow client, and
// each wake-up costs the guard a look through the process's descriptors).
func TestPausedReaderKeepsTheBypass(t *testing.T) {
	for _, network := range []string{"tcp4", "tcp6"} {
		t.Run(network, func(t *testing.T) {
			// Once where the watch looks (6.18 under lockdown: FIONREAD
			// leaves the TCP bytes out), never where nothing is hidden.
			readerKeepsTheBypass(t, network, 64<<10, 1, func(fd, want int) ([]byte, int, error) {
				return pausedRead(fd, want, 16<<10, 2, 300*time.Millisecond)
			})
		})
	}
}

// readerKeepsTheBypass sends size bytes, all queued before the first read
// (by TCP: the reader was not seen yet, so no new bytes raise an edge while
// it waits), lets read take them on its own terms, and wants them intact,
// no stall rescued, the pair still in the sockhash and bypassed, and the
// reader woken (the events it slept through) maxWoken times at most.
func readerKeepsTheBypass(t *testing.T, network string, size, maxWoken int, read func(fd, want int) ([]byte, int, error)) {
	t.Helper()
	in, c, s, said := guardedPairLog(t, network, bypass.Options{})
	data := randomBytes(size, 9)
	sendAll(t, s, data, false)()
	before, err := in.Stats()
	if err != nil {
		t.Fatal(err)
	}
	var got []byte
	var woken int
	rawFD(t, c, func(fd int) { got, woken, err = read(fd, len(data)) })
	if err != nil {
		t.Fatal(err)
	}
	if woken > maxWoken {
		t.Errorf("woken %d times while it waited on something else, want %d at most", woken, maxWoken)
	}
	if !bytes.Equal(got, data) {
		t.Fatalf("got %d bytes that differ from the %d sent", len(got), len(data))
	}
	after, err := in.Stats()
	if err != nil {
		t.Fatal(err)
	}
	if n := after.Counters.StallsRescued - before.Counters.StallsRescued; n != 0 {
		t.Errorf("%d stalls rescued (guard: %q): the wait was taken for one", n, said())
	}
	if n := mapEntries(t, in, "sock_hash"); n != 2 {
		t.Errorf("%d sockets in the sockhash after the wait, want 2", n)
	}
	exchange(t, s, c, "still bypassed")
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
	got, err = readRest(fd, ep, got, want)
	return got, woken, err
}

// readRest reads fd, registered in the epoll set ep, until got holds want
// bytes (10 s at most).
func readRest(fd, ep int, got []byte, want int) ([]byte, error) {
	buf := make([]byte, 64<<10)
	events := make([]unix.EpollEvent, 2)
	for deadline := time.Now().Add(10 * time.Second); len(got) < want; {
		n, _, err := unix.Recvfrom(fd, buf, unix.MSG_DONTWAIT)
		switch {
		case err == unix.EAGAIN:
			if time.Now().After(deadline) {
				return got, fmt.Errorf("%d of %d bytes after the pause", len(got), want)
			}
			if _, err := unix.EpollWait(ep, events, 100); err != nil && err != unix.EINTR {
				return got, err
			}
		case err != nil:
			return got, err
		case n == 0:
			return got, fmt.Errorf("end of stream at %d of %d bytes", len(got), want)
		default:
			got = append(got, buf[:n]...)
		}
	}
	return got, nil
}
