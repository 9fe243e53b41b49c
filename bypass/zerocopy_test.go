package bypass_test

import (
	"bytes"
	"context"
	"crypto/sha256"
	"encoding/binary"
	"fmt"
	"io"
	"net"
	"os"
	"runtime"
	"syscall"
	"testing"
	"time"
	"unsafe"

	"github.com/cilium/ebpf"
	"github.com/cilium/ebpf/link"
	"golang.org/x/sys/unix"

	"github.com/shunt-project/shunt/bypass"
	"github.com/shunt-project/shunt/host"
	"github.com/shunt-project/shunt/internal/testenv"
)

// MSG_ZEROCOPY completions never come for a socket whose sends go through
// sk_msg, so a connection with an SO_ZEROCOPY end must stay on TCP: set on
// the client before connect, or on the listener (accepted sockets inherit
// it). The application must see the same data and the same completions as
// over plain TCP.
func TestZerocopyStaysOnTCP(t *testing.T) {
	in, enabled := mustInstall(t)
	plain := testenv.MustCgroup(t)
	for _, who := range []string{"client", "server"} {
		t.Run(who+" sets SO_ZEROCOPY", func(t *testing.T) {
			var got [2]transcript
			for i, cg := range []host.Cgroup{plain, enabled} {
				side := testenv.Side{NS: testenv.MustNetNS(t), CG: cg}
				before := counters(t, in)
				c, s := zerocopyPair(t, side, who)
				sender, receiver := c, s
				if who == "server" {
					sender, receiver = s, c
				}
				zerocopyExchange(t, &got[i], sender, receiver)
				if i == 1 {
					after := counters(t, in)
					if after.Paired != before.Paired || after.Zerocopy != before.Zerocopy+1 {
						t.Errorf("counters before %+v after %+v: want the connection left on TCP and counted", before, after)
					}
					if f := flowOf(t, in, testenv.Cookie(t, c)); f != nil {
						t.Errorf("the client is still listed as bypassed: %+v", f)
					}
				}
			}
			if p, b := got[0].String(), got[1].String(); p != b {
				t.Errorf("application saw something else through shunt\n--- plain TCP:\n%s\n--- shunt:\n%s", p, b)
			}
		})
	}
}

func counters(t *testing.T, in *bypass.Install) bypass.Counters {
	t.Helper()
	st, err := in.Stats()
	if err != nil {
		t.Fatal(err)
	}
	return st.Counters
}

func setZerocopy(_, _ string, c syscall.RawConn) error {
	var serr error
	err := c.Control(func(fd uintptr) { serr = unix.SetsockoptInt(int(fd), unix.SOL_SOCKET, unix.SO_ZEROCOPY, 1) })
	if err != nil {
		return err
	}
	return serr
}

// zerocopyPair connects a client and a server in side, with SO_ZEROCOPY set
// before connect on the client or before listen on the server.
func zerocopyPair(t *testing.T, side testenv.Side, who string) (c, s *net.TCPConn) {
	t.Helper()
	lc := net.ListenConfig{}
	d := net.Dialer{Timeout: 5 * time.Second}
	if who == "server" {
		lc.Control = setZerocopy
	} else {
		d.Control = setZerocopy
	}
	var ln net.Listener
	var conn net.Conn
	var err error
	side.Make(t, func() {
		if ln, err = lc.Listen(context.Background(), "tcp4", "127.0.0.1:0"); err != nil {
			return
		}
		conn, err = d.Dial("tcp4", ln.Addr().String())
	})
	if err != nil {
		t.Fatal(err)
	}
	defer ln.Close()
	t.Cleanup(func() { conn.Close() })
	s = testenv.Accept(t, ln.(*net.TCPListener))
	return conn.(*net.TCPConn), s
}

// zerocopyExchange sends three messages with MSG_ZEROCOPY and records what
// arrived and which completions the error queue reported.
func zerocopyExchange(t *testing.T, tr *transcript, sender, receiver *net.TCPConn) {
	msgs := []string{"zero ", "copy ", "please"}
	// The kernel reads a zerocopy send's pages until its completion (over
	// loopback, when the receiver has taken them): the buffers must live
	// and stay unchanged until then. A temporary one was freed and reused
	// once under qemu (6.1): plain TCP's receiver read "zero \x80X\xbe...".
	bufs := make([][]byte, len(msgs))
	rawFD(t, sender, func(fd int) {
		for i, m := range msgs {
			bufs[i] = []byte(m)
			_, err := unix.SendmsgN(fd, bufs[i], nil, nil, unix.MSG_ZEROCOPY)
			tr.add("send %q err=%v", m, errName(err))
		}
	})
	defer runtime.KeepAlive(bufs)
	receiver.SetReadDeadline(time.Now().Add(5 * time.Second))
	buf := make([]byte, len("zero copy please"))
	n, err := io.ReadFull(receiver, buf)
	tr.add("received %q err=%v", buf[:n], errName(err))

	// Completions name ranges of send calls, 0-based.
	var done uint32
	deadline := time.Now().Add(2 * time.Second)
	rawFD(t, sender, func(fd int) {
		for done < uint32(len(msgs)) && time.Now().Before(deadline) {
			lo, hi, ok := readCompletion(fd)
			if !ok {
				time.Sleep(5 * time.Millisecond)
				continue
			}
			if lo == done {
				done = hi + 1
			}
		}
	})
	tr.add("completions cover %d of %d sends", done, len(msgs))
}

// readCompletion reads one MSG_ZEROCOPY notification from the error queue.
func readCompletion(fd int) (lo, hi uint32, ok bool) {
	oob := make([]byte, 128)
	_, oobn, _, _, err := unix.Recvmsg(fd, nil, oob, unix.MSG_ERRQUEUE|unix.MSG_DONTWAIT)
	if err != nil {
		return 0, 0, false
	}
	cmsgs, err := unix.ParseSocketControlMessage(oob[:oobn])
	if err != nil {
		return 0, 0, false
	}
	for _, m := range cmsgs {
		// struct sock_extended_err: errno u32, origin u8, type u8, code u8,
		// pad u8, info u32 (first send), data u32 (last send).
		if len(m.Data) >= 16 && m.Data[4] == unix.SO_EE_ORIGIN_ZEROCOPY {
			return binary.NativeEndian.Uint32(m.Data[8:]), binary.NativeEndian.Uint32(m.Data[12:]), true
		}
	}
	return 0, 0, false
}

// SO_ZEROCOPY set on a connection already bypassed cannot take it off the
// bypass in time (only sockops and timers may leave the sockhash), and its
// MSG_ZEROCOPY sends would never complete: the setsockopt fails with
// EOPNOTSUPP, as on a socket without zerocopy, so the application sends
// without it. Sockets shunt does not hold, and turning it off, are left
// alone; after disable the cgroup has no setsockopt program.
func TestZerocopyAfterEstablishmentRefused(t *testing.T) {
	in, cg := mustInstall(t)
	c, s := connPair(t, cg)
	testenv.Warm(t, c, s)
	if flowOf(t, in, testenv.Cookie(t, c)) == nil {
		t.Fatal("the connection is not bypassed")
	}
	before := counters(t, in)
	if err := zerocopyOn(t, c, 1); err != unix.EOPNOTSUPP {
		t.Errorf("SO_ZEROCOPY on a bypassed socket: %v, want EOPNOTSUPP", err)
	}
	if err := zerocopyOn(t, c, 0); err != nil {
		t.Errorf("SO_ZEROCOPY 0 on a bypassed socket: %v, want success", err)
	}
	if got := counters(t, in).ZerocopyRefused - before.ZerocopyRefused; got != 1 {
		t.Errorf("%d refusals counted, want 1", got)
	}
	exchange(t, c, s, "still bypassed and intact")

	// A connection outside the enabled cgroup: as over TCP.
	other := testenv.Side{NS: testenv.MustNetNS(t), CG: testenv.MustCgroup(t)}
	pc, _ := testenv.ConnPair(t, "tcp4", other, "127.0.0.1:0", other, "127.0.0.1:0")
	if err := zerocopyOn(t, pc, 1); err != nil {
		t.Errorf("SO_ZEROCOPY on a socket shunt does not hold: %v", err)
	}

	if removed, err := in.Detach(cg.ID); err != nil || !removed {
		t.Fatalf("detach: %v %v", removed, err)
	}
	f, err := os.Open(cg.Path)
	if err != nil {
		t.Fatal(err)
	}
	defer f.Close()
	for _, attach := range []ebpf.AttachType{ebpf.AttachCGroupSetsockopt, ebpf.AttachCGroupGetsockopt} {
		res, err := link.QueryPrograms(link.QueryOptions{Target: int(f.Fd()), Attach: attach})
		if err != nil {
			t.Fatal(err)
		}
		if len(res.Programs) != 0 {
			t.Errorf("%d %v program(s) left on the cgroup after detach", len(res.Programs), attach)
		}
	}
}

// zerocopyOn sets SO_ZEROCOPY to v on an open connection.
func zerocopyOn(t *testing.T, c *net.TCPConn, v int) (err error) {
	rawFD(t, c, func(fd int) { err = unix.SetsockoptInt(fd, unix.SOL_SOCKET, unix.SO_ZEROCOPY, v) })
	return err
}

// The setsockopt program on enabled cgroups sees every setsockopt of their
// sockets. One whose optval is over a page (iptables' rule blobs, say) must
// work as without shunt: SO_RCVBUF given an 8 KiB buffer, on a bypassed
// socket and on one shunt does not hold, gets the same answer and value.
func TestLargeSetsockoptAsWithoutShunt(t *testing.T) {
	c, pc := bypassedAndPlain(t)
	var got [2]string
	for i, conn := range []*net.TCPConn{pc, c} {
		rawFD(t, conn, func(fd int) {
			buf := make([]byte, 8192)
			binary.NativeEndian.PutUint32(buf, 65536)
			err := unix.SetsockoptString(fd, unix.SOL_SOCKET, unix.SO_RCVBUF, string(buf))
			v, _ := unix.GetsockoptInt(fd, unix.SOL_SOCKET, unix.SO_RCVBUF)
			got[i] = fmt.Sprintf("err=%v rcvbuf=%d", err, v)
		})
	}
	if got[0] != got[1] {
		t.Errorf("setsockopt with an 8 KiB optval: %s without shunt, %s through shunt", got[0], got[1])
	}
}

// The getsockopt program on enabled cgroups runs after every getsockopt of
// their sockets and may rewrite what the caller gets back. It must not:
// an option answered into an 8 KiB buffer (the kernel hands the program a
// page at most), and a call that fails (into a small buffer and into an
// 8 KiB one), give the same error, length and bytes as on a socket shunt
// does not hold; the rest of the buffer stays as the caller left it.
func TestGetsockoptAsWithoutShunt(t *testing.T) {
	c, pc := bypassedAndPlain(t)
	calls := []struct {
		name           string
		level, optname int
		size           int
	}{
		{"SO_TYPE into 8 KiB", unix.SOL_SOCKET, unix.SO_TYPE, 8192},
		{"TCP_CONGESTION into 8 KiB", unix.SOL_TCP, unix.TCP_CONGESTION, 8192},
		{"unknown option into 64 B", unix.SOL_TCP, 9999, 64},
		{"unknown option into 8 KiB", unix.SOL_TCP, 9999, 8192},
	}
	for _, call := range calls {
		var got [2]string
		for i, conn := range []*net.TCPConn{pc, c} {
			rawFD(t, conn, func(fd int) {
				buf := bytes.Repeat([]byte{0xAA}, call.size)
				size := uint32(len(buf))
				_, _, errno := unix.Syscall6(unix.SYS_GETSOCKOPT, uintptr(fd), uintptr(call.level), uintptr(call.optname),
					uintptr(unsafe.Pointer(&buf[0])), uintptr(unsafe.Pointer(&size)), 0)
				got[i] = fmt.Sprintf("errno=%d len=%d bytes=%x", errno, size, sha256.Sum256(buf))
			})
		}
		if got[0] != got[1] {
			t.Errorf("getsockopt %s: %s without shunt, %s through shunt", call.name, got[0], got[1])
		}
	}
}

// bypassedAndPlain returns a bypassed socket and one of a connection shunt
// does not hold (another namespace and cgroup).
func bypassedAndPlain(t *testing.T) (bypassed, plain *net.TCPConn) {
	t.Helper()
	in, cg := mustInstall(t)
	c, s := connPair(t, cg)
	testenv.Warm(t, c, s)
	if flowOf(t, in, testenv.Cookie(t, c)) == nil {
		t.Fatal("the connection is not bypassed")
	}
	other := testenv.Side{NS: testenv.MustNetNS(t), CG: testenv.MustCgroup(t)}
	pc, _ := testenv.ConnPair(t, "tcp4", other, "127.0.0.1:0", other, "127.0.0.1:0")
	return c, pc
}
