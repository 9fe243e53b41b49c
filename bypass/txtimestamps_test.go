package bypass_test

import (
	"net"
	"syscall"
	"testing"
	"time"

	"golang.org/x/sys/unix"

	"github.com/shunt-project/shunt/internal/testenv"
)

// txTimestampFlags asks for a software timestamp of each send as it leaves
// (OPT_ID: the key says which byte; TSONLY: the timestamp alone).
const txTimestampFlags = unix.SOF_TIMESTAMPING_TX_SOFTWARE | unix.SOF_TIMESTAMPING_SOFTWARE |
	unix.SOF_TIMESTAMPING_OPT_TSONLY

// awaitTxTimestamp waits up to wait for a transmit timestamp on c's error
// queue, as a program that polls for POLLERR does, and says whether one
// came.
func awaitTxTimestamp(t *testing.T, c *net.TCPConn, wait time.Duration) bool {
	t.Helper()
	var got bool
	rawFD(t, c, func(fd int) {
		for deadline := time.Now().Add(wait); time.Now().Before(deadline); {
			fds := []unix.PollFd{{Fd: int32(fd)}} // POLLERR is always reported
			if n, err := unix.Poll(fds, 10); err != nil || n == 0 {
				continue
			}
			oob := make([]byte, 256)
			_, oobn, _, _, err := unix.Recvmsg(fd, make([]byte, 1), oob, unix.MSG_ERRQUEUE|unix.MSG_DONTWAIT)
			if err != nil {
				continue
			}
			msgs, err := unix.ParseSocketControlMessage(oob[:oobn])
			if err != nil {
				t.Fatal(err)
			}
			for _, m := range msgs {
				if m.Header.Level == unix.SOL_SOCKET && (m.Header.Type == unix.SO_TIMESTAMPING || m.Header.Type == unix.SO_TIMESTAMPING_NEW) {
					got = true
					return
				}
			}
		}
	})
	return got
}

// Transmit timestamps (SO_TIMESTAMPING with a TX flag) come from TCP's
// transmit path, which a redirected send never takes: through shunt a
// program that polled for its timestamp waited for ever (the 2 s here: no
// POLLERR, an empty error queue). Asked for after the connection is
// established, the asking socket's sends take TCP from the next one on;
// asked for before it connects, the connection stays on TCP. Either way
// the timestamp comes, and the stream stays in order.
func TestTransmitTimestampsComeThroughShunt(t *testing.T) {
	in, cg := mustInstall(t)
	side := testenv.Side{NS: testenv.MustNetNS(t), CG: cg}
	for _, fam := range loopbacks {
		t.Run(fam.network+"/after-connect", func(t *testing.T) {
			c, s := testenv.ConnPair(t, fam.network, side, fam.addr, side, fam.addr)
			testenv.Warm(t, c, s)
			before := counters(t, in)
			write(t, c, "redirected ")
			rawFD(t, c, func(fd int) {
				if err := unix.SetsockoptInt(fd, unix.SOL_SOCKET, unix.SO_TIMESTAMPING, txTimestampFlags|unix.SOF_TIMESTAMPING_OPT_ID); err != nil {
					t.Fatal(err)
				}
			})
			write(t, c, "then by TCP")
			s.SetReadDeadline(time.Now().Add(5 * time.Second))
			readExactly(t, s, "redirected then by TCP")
			if !awaitTxTimestamp(t, c, 2*time.Second) {
				t.Error("no transmit timestamp within 2 s")
			}
			if got := counters(t, in).TxTimestamps - before.TxTimestamps; got != 1 {
				t.Errorf("connections_tx_timestamps went up by %d, want 1", got)
			}
		})
		t.Run(fam.network+"/before-connect", func(t *testing.T) {
			before := counters(t, in)
			ln := testenv.Listen(t, side, fam.network, fam.addr)
			d := net.Dialer{Timeout: 5 * time.Second, Control: func(_, _ string, rc syscall.RawConn) error {
				var serr error
				if err := rc.Control(func(fd uintptr) {
					serr = unix.SetsockoptInt(int(fd), unix.SOL_SOCKET, unix.SO_TIMESTAMPING, txTimestampFlags)
				}); err != nil {
					return err
				}
				return serr
			}}
			var cc net.Conn
			var err error
			side.Make(t, func() { cc, err = d.Dial(fam.network, ln.Addr().String()) })
			if err != nil {
				t.Fatal(err)
			}
			c := cc.(*net.TCPConn)
			defer c.Close()
			s := testenv.Accept(t, ln)
			testenv.Warm(t, c, s)
			// The warm-up's sends took TCP (a connection's first bytes
			// do): only a timestamp of the next send counts.
			for awaitTxTimestamp(t, c, 50*time.Millisecond) {
				t.Log("a warm-up send's timestamp, drained")
			}
			write(t, c, "on TCP")
			s.SetReadDeadline(time.Now().Add(5 * time.Second))
			readExactly(t, s, "on TCP")
			if !awaitTxTimestamp(t, c, 2*time.Second) {
				t.Error("no transmit timestamp within 2 s")
			}
			after := counters(t, in)
			if after.Paired != before.Paired || after.TxTimestamps != before.TxTimestamps+1 {
				t.Errorf("paired %d -> %d, tx timestamps %d -> %d: want the connection left on TCP and counted", before.Paired, after.Paired, before.TxTimestamps, after.TxTimestamps)
			}
		})
	}
}

// Receive timestamps asked for through SO_TIMESTAMPING before the
// connection exists (on the client before it connects) keep it on TCP, as
// SO_TIMESTAMP(NS) does: a psock's data comes without them.
func TestReceiveTimestampingBeforeConnectStaysOnTCP(t *testing.T) {
	in, cg := mustInstall(t)
	side := testenv.Side{NS: testenv.MustNetNS(t), CG: cg}
	before := counters(t, in)
	ln := testenv.Listen(t, side, "tcp4", "127.0.0.1:0")
	d := net.Dialer{Timeout: 5 * time.Second, Control: func(_, _ string, rc syscall.RawConn) error {
		var serr error
		if err := rc.Control(func(fd uintptr) {
			serr = unix.SetsockoptInt(int(fd), unix.SOL_SOCKET, unix.SO_TIMESTAMPING, unix.SOF_TIMESTAMPING_RX_SOFTWARE|unix.SOF_TIMESTAMPING_SOFTWARE)
		}); err != nil {
			return err
		}
		return serr
	}}
	var cc net.Conn
	var err error
	side.Make(t, func() { cc, err = d.Dial("tcp4", ln.Addr().String()) })
	if err != nil {
		t.Fatal(err)
	}
	defer cc.Close()
	s := testenv.Accept(t, ln)
	testenv.Warm(t, cc, s)
	after := counters(t, in)
	if after.Paired != before.Paired || after.ReceiveOptions != before.ReceiveOptions+1 {
		t.Errorf("paired %d -> %d, receive options %d -> %d: want the connection left on TCP and counted", before.Paired, after.Paired, before.ReceiveOptions, after.ReceiveOptions)
	}
}
