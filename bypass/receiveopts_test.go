package bypass_test

import (
	"bytes"
	"encoding/binary"
	"errors"
	"net"
	"testing"
	"time"

	"golang.org/x/sys/unix"

	"github.com/shunt-project/shunt/internal/testenv"
)

// Receive options only TCP's own receive path honours: SO_RCVLOWAT (no
// readiness below the mark), TCP_INQ (each recvmsg tells the bytes left),
// SO_PEEK_OFF (a peek goes on where the last one ended), receive
// timestamps (SO_TIMESTAMPNS: each recvmsg carries one). A psock serves
// none of them, so a bypassed socket whose reader sets one goes back to
// TCP, and the option works as over TCP. (Set on a listener, the accepted
// socket has it from the start and is never paired: checked by hand with
// Python's sockets; Go's accepted sockets do not inherit SO_RCVLOWAT.)
func TestReceiveOptionsKeepTCPSemantics(t *testing.T) {
	in, cg := mustInstall(t)
	side := testenv.Side{NS: testenv.MustNetNS(t), CG: cg}
	options := []struct {
		name  string
		set   func(fd int) error
		check func(t *testing.T, c, s *net.TCPConn)
	}{
		{"SO_RCVLOWAT", func(fd int) error { return unix.SetsockoptInt(fd, unix.SOL_SOCKET, unix.SO_RCVLOWAT, 100) }, checkRcvlowat},
		{"TCP_INQ", func(fd int) error { return unix.SetsockoptInt(fd, unix.SOL_TCP, unix.TCP_INQ, 1) }, checkInq},
		{"SO_PEEK_OFF", func(fd int) error { return unix.SetsockoptInt(fd, unix.SOL_SOCKET, unix.SO_PEEK_OFF, 0) }, checkPeekOff},
		{"SO_TIMESTAMPNS", func(fd int) error { return unix.SetsockoptInt(fd, unix.SOL_SOCKET, unix.SO_TIMESTAMPNS, 1) }, checkTimestamps},
	}
	for _, o := range options {
		t.Run(o.name, func(t *testing.T) {
			before, err := in.Counters()
			if err != nil {
				t.Fatal(err)
			}
			c, s := testenv.ConnPair(t, "tcp4", side, "127.0.0.1:0", side, "127.0.0.1:0")
			testenv.Warm(t, c, s)
			var setErr error
			rawFD(t, s, func(fd int) { setErr = o.set(fd) })
			if errors.Is(setErr, unix.EOPNOTSUPP) {
				// TCP took SO_PEEK_OFF in 6.9: before, the kernel
				// refuses it on any TCP socket, and so must it here.
				plain, err := unix.Socket(unix.AF_INET, unix.SOCK_STREAM, 0)
				if err != nil {
					t.Fatal(err)
				}
				defer unix.Close(plain)
				if err := o.set(plain); !errors.Is(err, unix.EOPNOTSUPP) {
					t.Fatalf("refused through shunt (%v), but not on a plain TCP socket (%v)", setErr, err)
				}
				t.Logf("this kernel's TCP refuses %s: refused alike", o.name)
				return
			}
			if setErr != nil {
				t.Fatal(setErr)
			}
			o.check(t, c, s)
			after, err := in.Counters()
			if err != nil {
				t.Fatal(err)
			}
			if after.ReceiveOptions != before.ReceiveOptions+1 {
				t.Errorf("connections sent back for a receive option: %d, want %d", after.ReceiveOptions, before.ReceiveOptions+1)
			}
		})
	}
}

// checkRcvlowat: 10 bytes under a mark of 100 do not make s readable; 100
// more do.
func checkRcvlowat(t *testing.T, c, s *net.TCPConn) {
	write(t, c, string(bytes.Repeat([]byte{'x'}, 10)))
	if readable(t, s, 200*time.Millisecond) {
		t.Error("readable with 10 bytes under SO_RCVLOWAT 100")
	}
	write(t, c, string(bytes.Repeat([]byte{'y'}, 100)))
	if !readable(t, s, 2*time.Second) {
		t.Error("not readable with 110 bytes over SO_RCVLOWAT 100")
	}
	s.SetReadDeadline(time.Now().Add(5 * time.Second))
	readExactly(t, s, string(bytes.Repeat([]byte{'x'}, 10))+string(bytes.Repeat([]byte{'y'}, 100)))
}

// checkInq: a recvmsg of 100 of 1000 bytes tells 900 left.
func checkInq(t *testing.T, c, s *net.TCPConn) {
	write(t, c, string(bytes.Repeat([]byte{'z'}, 1000)))
	if !readable(t, s, 2*time.Second) {
		t.Fatal("1000 bytes never arrived")
	}
	time.Sleep(20 * time.Millisecond) // all of them
	msgs := recvmsgN(t, s, 100)
	left, got := 0, false
	for _, m := range msgs {
		if m.Header.Level == unix.SOL_TCP && m.Header.Type == unix.TCP_CM_INQ && len(m.Data) >= 4 {
			left, got = int(binary.NativeEndian.Uint32(m.Data)), true
		}
	}
	if !got || left != 900 {
		t.Errorf("TCP_INQ: told %d left (message there: %v), want 900", left, got)
	}
	s.SetReadDeadline(time.Now().Add(5 * time.Second))
	readExactly(t, s, string(bytes.Repeat([]byte{'z'}, 900)))
}

// checkPeekOff: two peeks of 3 give "abc" then "def".
func checkPeekOff(t *testing.T, c, s *net.TCPConn) {
	write(t, c, "abcdef")
	if !readable(t, s, 2*time.Second) {
		t.Fatal("the bytes never arrived")
	}
	time.Sleep(20 * time.Millisecond)
	var peeks []string
	rawFD(t, s, func(fd int) {
		for range 2 {
			b := make([]byte, 3)
			n, _, err := unix.Recvfrom(fd, b, unix.MSG_PEEK)
			if err != nil {
				t.Fatal(err)
			}
			peeks = append(peeks, string(b[:n]))
		}
	})
	if len(peeks) != 2 || peeks[0] != "abc" || peeks[1] != "def" {
		t.Errorf("peeks with SO_PEEK_OFF: %q, want [abc def]", peeks)
	}
	s.SetReadDeadline(time.Now().Add(5 * time.Second))
	readExactly(t, s, "abcdef")
}

// checkTimestamps: data comes with its receive time (SCM_TIMESTAMPNS). The
// kernel turns receive timestamps on for the host in a work item after the
// first socket asks (net_enable_timestamp): a segment that arrives before
// that has none, over TCP too. So up to 20 sends of 7 bytes, one read each:
// one must carry it.
func checkTimestamps(t *testing.T, c, s *net.TCPConn) {
	for try := 0; try < 20; try++ {
		write(t, c, "stamped")
		if !readable(t, s, 2*time.Second) {
			t.Fatal("the bytes never arrived")
		}
		time.Sleep(20 * time.Millisecond)
		stamped := false
		for _, m := range recvmsgN(t, s, 7) {
			stamped = stamped || (m.Header.Level == unix.SOL_SOCKET && m.Header.Type == unix.SO_TIMESTAMPNS)
		}
		if stamped {
			return
		}
		time.Sleep(50 * time.Millisecond)
	}
	t.Error("no SCM_TIMESTAMPNS with the data in 20 reads")
}

// recvmsgN reads n bytes from s with one recvmsg and returns the control
// messages that came with them.
func recvmsgN(t *testing.T, s *net.TCPConn, n int) []unix.SocketControlMessage {
	t.Helper()
	var got, oobn int
	var err error
	oob := make([]byte, 256)
	rawFD(t, s, func(fd int) { got, oobn, _, _, err = unix.Recvmsg(fd, make([]byte, n), oob, 0) })
	if err != nil || got != n {
		t.Fatalf("recvmsg: %d bytes (%v), want %d", got, err, n)
	}
	msgs, err := unix.ParseSocketControlMessage(oob[:oobn])
	if err != nil {
		t.Fatalf("control messages: %v", err)
	}
	return msgs
}

// readable polls c for input for up to d.
func readable(t *testing.T, c *net.TCPConn, d time.Duration) bool {
	t.Helper()
	var revents int16
	rawFD(t, c, func(fd int) {
		pfd := []unix.PollFd{{Fd: int32(fd), Events: unix.POLLIN}}
		if _, err := unix.Poll(pfd, int(d.Milliseconds())); err != nil && err != unix.EINTR {
			t.Fatal(err)
		}
		revents = pfd[0].Revents
	})
	return revents&unix.POLLIN != 0
}
