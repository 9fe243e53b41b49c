package bypass_test

import (
	"io"
	"net"
	"testing"
	"time"

	"golang.org/x/sys/unix"

	"github.com/shunt-project/shunt/internal/testenv"
)

// Urgent data (send with MSG_OOB) marks the send's last byte urgent: TCP
// keeps it out of the stream (unless the reader set SO_OOBINLINE), raises
// POLLPRI, and recv(MSG_OOB) returns it until the reader reads past it. A
// Java program's sendUrgentData heartbeat relies on the first: its peer's
// stream never sees the byte. Through shunt an urgent send takes TCP and
// its connection goes back to TCP, whether sent with send(2) (sendto) or
// sendmsg(2), with the stream's bytes before it read already ("read
// ahead") or still queued ("unread ahead", where only the stream and
// POLLPRI are as over TCP: docs/TRANSPARENCY.md).
func TestUrgentDataStaysOutOfBand(t *testing.T) {
	in, cg := mustInstall(t)
	side := testenv.Side{NS: testenv.MustNetNS(t), CG: cg}
	sends := []struct {
		name string
		send func(fd int, b []byte) error
	}{
		{"sendto", func(fd int, b []byte) error { return unix.Sendto(fd, b, unix.MSG_OOB, nil) }},
		{"sendmsg", func(fd int, b []byte) error { _, err := unix.SendmsgN(fd, b, nil, nil, unix.MSG_OOB); return err }},
	}
	for _, fam := range loopbacks {
		for _, how := range sends {
			for _, readAhead := range []bool{true, false} {
				name := fam.network + "/" + how.name + "/unread-ahead"
				if readAhead {
					name = fam.network + "/" + how.name + "/read-ahead"
				}
				t.Run(name, func(t *testing.T) {
					c, s := testenv.ConnPair(t, fam.network, side, fam.addr, side, fam.addr)
					testenv.Warm(t, c, s)
					before, err := in.Counters()
					if err != nil {
						t.Fatal(err)
					}
					s.SetReadDeadline(time.Now().Add(5 * time.Second))
					write(t, c, "abc")
					if readAhead {
						readExactly(t, s, "abc")
					}
					var sendErr error
					rawFD(t, c, func(fd int) { sendErr = how.send(fd, []byte("!")) })
					if sendErr != nil {
						t.Fatalf("urgent send: %v", sendErr)
					}
					if !pollPRI(t, s) {
						t.Error("no POLLPRI for the urgent byte")
					}
					if readAhead {
						oob := make([]byte, 1)
						var n int
						var oobErr error
						rawFD(t, s, func(fd int) { n, _, oobErr = unix.Recvfrom(fd, oob, unix.MSG_OOB) })
						if oobErr != nil || n != 1 || oob[0] != '!' {
							t.Errorf("recv(MSG_OOB): %q (%v), want \"!\"", oob[:max(n, 0)], oobErr)
						}
					}
					write(t, c, "def")
					if readAhead {
						readExactly(t, s, "def")
					} else {
						readExactly(t, s, "abcdef")
					}
					after, err := in.Counters()
					if err != nil {
						t.Fatal(err)
					}
					if after.Urgent != before.Urgent+1 {
						t.Errorf("connections sent back for urgent data: %d, want %d", after.Urgent, before.Urgent+1)
					}
				})
			}
		}
	}
}

func write(t *testing.T, c *net.TCPConn, s string) {
	t.Helper()
	if _, err := c.Write([]byte(s)); err != nil {
		t.Fatal(err)
	}
}

// readExactly reads len(want) bytes from c: they must be want (the urgent
// byte out of them).
func readExactly(t *testing.T, c *net.TCPConn, want string) {
	t.Helper()
	got := make([]byte, len(want))
	if _, err := io.ReadFull(c, got); err != nil || string(got) != want {
		t.Fatalf("the stream: %q (%v), want %q", got, err, want)
	}
}

// pollPRI waits up to 2 s for c to report urgent data.
func pollPRI(t *testing.T, c *net.TCPConn) bool {
	t.Helper()
	var revents int16
	rawFD(t, c, func(fd int) {
		pfd := []unix.PollFd{{Fd: int32(fd), Events: unix.POLLPRI}}
		for deadline := time.Now().Add(2 * time.Second); revents&unix.POLLPRI == 0 && time.Now().Before(deadline); {
			if _, err := unix.Poll(pfd, 100); err != nil && err != unix.EINTR {
				t.Fatal(err)
			}
			revents = pfd[0].Revents
		}
	})
	return revents&unix.POLLPRI != 0
}
