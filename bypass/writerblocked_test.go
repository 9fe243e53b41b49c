package bypass_test

import (
	"fmt"
	"runtime"
	"testing"
	"time"

	"golang.org/x/sys/unix"
)

// A proxy whose client is slow reads one buffer from its upstream, tries
// to write it, gets EAGAIN and sleeps in epoll_wait until the client takes
// more (tokio's copy_bidirectional; Go's io.Copy). On 6.18 under lockdown,
// with the upstream's bytes hidden from FIONREAD, the stall watch took that
// for nginx told 0: it woke the reader, which read one buffer more and
// slept on its write again, and moved the connection to TCP. Now the stall
// check looks through the reader's sockets: one whose send found its
// buffer full (SOCK_NOSPACE) leaves it to its writes, neither woken nor
// moved.
// Where nothing is hidden (6.1 corrects FIONREAD, 6.12 counts TCP's bytes)
// the watch never looks, and this passes there too.
func TestReaderWaitingToWriteKeepsTheBypass(t *testing.T) {
	for _, network := range []string{"tcp4", "tcp6"} {
		t.Run(network, func(t *testing.T) {
			readerKeepsTheBypass(t, network, 128<<10, 0, func(fd, want int) ([]byte, int, error) {
				return writeBlockedRead(fd, want, 8<<10, 300*time.Millisecond)
			})
		})
	}
}

// writeBlockedRead reads want bytes from fd as a proxy in front of a slow
// client: it reads one buffer, writes it to a full socket (EAGAIN) and
// sleeps in epoll_wait on both for pause; an event of fd in the pause (the
// guard's wake-up: the writer is done) makes it read one buffer more and
// try the write again, as tokio's copy does. Then the client drains and it
// reads the rest. woken: the events of fd in the pause.
func writeBlockedRead(fd, want, buffer int, pause time.Duration) (got []byte, woken int, err error) {
	runtime.LockOSThread() // the watches look at the thread that read
	defer runtime.UnlockOSThread()
	sink, err := unix.Socketpair(unix.AF_UNIX, unix.SOCK_STREAM|unix.SOCK_NONBLOCK|unix.SOCK_CLOEXEC, 0)
	if err != nil {
		return nil, 0, err
	}
	defer unix.Close(sink[0])
	defer unix.Close(sink[1])
	fill := make([]byte, 64<<10)
	for {
		if _, err := unix.Write(sink[0], fill); err == unix.EAGAIN {
			break
		} else if err != nil {
			return nil, 0, fmt.Errorf("fill the client: %w", err)
		}
	}
	ep, err := edgeEpoll(fd, sink[0])
	if err != nil {
		return nil, 0, err
	}
	defer unix.Close(ep)
	events := make([]unix.EpollEvent, 2)
	if _, err := unix.EpollWait(ep, events, 5000); err != nil && err != unix.EINTR {
		return nil, 0, err
	}
	got = make([]byte, 0, want)
	buf := make([]byte, buffer)
	readAndWrite := func() error {
		n, _, err := unix.Recvfrom(fd, buf, unix.MSG_DONTWAIT)
		if err != nil {
			return fmt.Errorf("read before the client drains: %w", err)
		}
		got = append(got, buf[:n]...)
		if _, err := unix.Write(sink[0], buf[:n]); err != unix.EAGAIN {
			return fmt.Errorf("write to the full client: %v, want EAGAIN", err)
		}
		return nil
	}
	if err := readAndWrite(); err != nil {
		return got, 0, err
	}
	for end := time.Now().Add(pause); time.Now().Before(end); {
		n, err := unix.EpollWait(ep, events, int(time.Until(end)/time.Millisecond)+1)
		if err == unix.EINTR {
			continue
		}
		if err != nil {
			return got, woken, err
		}
		for _, ev := range events[:n] {
			if int(ev.Fd) == fd && ev.Events&unix.EPOLLIN != 0 {
				woken++
				if err := readAndWrite(); err != nil {
					return got, woken, err
				}
			}
		}
	}
	got, err = readRest(fd, ep, got, want)
	return got, woken, err
}

// edgeEpoll is an epoll set watching fd for input and output and the
// others for output, edge-triggered, as tokio registers its sockets.
func edgeEpoll(fd int, out ...int) (int, error) {
	ep, err := unix.EpollCreate1(unix.EPOLL_CLOEXEC)
	if err != nil {
		return -1, err
	}
	ev := unix.EpollEvent{Events: unix.EPOLLIN | unix.EPOLLOUT | unix.EPOLLRDHUP | unix.EPOLLET, Fd: int32(fd)}
	if err := unix.EpollCtl(ep, unix.EPOLL_CTL_ADD, fd, &ev); err != nil {
		unix.Close(ep)
		return -1, err
	}
	for _, o := range out {
		ev := unix.EpollEvent{Events: unix.EPOLLOUT | unix.EPOLLET, Fd: int32(o)}
		if err := unix.EpollCtl(ep, unix.EPOLL_CTL_ADD, o, &ev); err != nil {
			unix.Close(ep)
			return -1, err
		}
	}
	return ep, nil
}
