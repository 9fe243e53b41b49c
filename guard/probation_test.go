package guard_test

import (
	"errors"
	"io"
	"net"
	"strings"
	"testing"
	"time"

	"golang.org/x/sys/unix"

	"github.com/shunt-project/shunt/bypass"
	"github.com/shunt-project/shunt/internal/testenv"
)

// A header-then-splice program behind a slow upstream: its probe reads the
// header, then waits for the body longer than the probation's time limit
// before it splices. Another of its connections reads a header meanwhile.
// That read must not admit the program (time alone shows nothing about
// reads after a header): admitted there, the second connection's body came
// by redirect and its splice was caught, the client reset. Seen failing
// when the time limit alone proved a program: "caught 1 (client reset 1)".
func TestSlowUpstreamSplicerIsNeverCaught(t *testing.T) {
	const limit = 300 * time.Millisecond
	in, side := installedAsIs(t, bypass.Options{ProbationLimit: limit})
	reports := runGuard(t, in)
	body := strings.Repeat("slow body ", 10000)
	type conn struct {
		c, s   *net.TCPConn
		served chan error
	}
	conns := make([]conn, 2) // [0]: the probe; [1]: reads its header after the limit
	for i := range conns {
		c, s := testenv.ConnPair(t, "tcp4", side, "127.0.0.1:0", side, "127.0.0.1:0")
		for _, x := range []*net.TCPConn{c, s} {
			_ = x.SetDeadline(time.Now().Add(20 * time.Second))
		}
		conns[i] = conn{c, s, make(chan error, 1)}
	}
	// Each server starts reading when its header is sent: the first, the
	// probe, is the program's first reader.
	serve := func(k conn) {
		go func() { _, err := headerWaitSplice(k.s); k.served <- err }()
	}
	send := func(k conn, what string) {
		t.Helper()
		if _, err := k.c.Write([]byte(what)); err != nil {
			t.Fatal(err)
		}
	}
	serve(conns[0])
	send(conns[0], "HEAD") // the probe's first read
	time.Sleep(limit + 100*time.Millisecond)
	serve(conns[1])
	send(conns[1], "HEAD") // a read past the limit: held, the probe read once
	time.Sleep(100 * time.Millisecond)
	send(conns[1], body) // by TCP: its splice finds every byte
	time.Sleep(100 * time.Millisecond)
	send(conns[0], body)
	var reset int
	for i, k := range conns {
		_ = k.c.CloseWrite()
		got, err := io.ReadAll(k.c)
		if errors.Is(err, unix.ECONNRESET) {
			reset++
			continue
		}
		if err != nil || string(got) != body {
			t.Errorf("connection %d: read %d of %d bytes back, intact %v: %v", i, len(got), len(body), string(got) == body, err)
		}
		if err := <-k.served; err != nil && !errors.Is(err, unix.ECONNABORTED) {
			t.Errorf("connection %d: server: %v", i, err)
		}
	}
	st, err := in.Stats()
	if err != nil {
		t.Fatal(err)
	}
	if st.Counters.SpliceCaught != 0 || reset != 0 {
		t.Fatalf("caught %d (client reset %d); want none", st.Counters.SpliceCaught, reset)
	}
	learnedQuietly(t, st, reports)
}

// headerWaitSplice reads a 4-byte header by recv, waits in poll(2) until
// more is queued, and then echoes the rest by splice (io.Copy between TCP
// sockets), as a proxy that splices a body once it comes: its splice is
// seen when the body is there, not at the header.
func headerWaitSplice(s *net.TCPConn) (int64, error) {
	head := make([]byte, 4)
	if _, err := io.ReadFull(s, head); err != nil {
		return 0, err
	}
	rc, err := s.SyscallConn()
	if err != nil {
		return 0, err
	}
	var perr error
	if err := rc.Control(func(fd uintptr) {
		pfd := []unix.PollFd{{Fd: int32(fd), Events: unix.POLLIN}}
		for {
			if _, perr = unix.Poll(pfd, 20_000); !errors.Is(perr, unix.EINTR) {
				return
			}
		}
	}); err != nil {
		return 0, err
	}
	if perr != nil {
		return 0, perr
	}
	n, err := io.Copy(s, s)
	_ = s.CloseWrite()
	return n, err
}
