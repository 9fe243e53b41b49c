package daemon

import (
	"bytes"
	"encoding/json"
	"math/rand/v2"
	"net"
	"os"
	"strings"
	"syscall"
	"testing"
	"time"

	"golang.org/x/sys/unix"

	"github.com/shunt-project/shunt/internal/testenv"
	"github.com/shunt-project/shunt/splice"
)

// seqpacketPair is two connected unix SOCK_SEQPACKET sockets.
func seqpacketPair(t *testing.T) (a, b *net.UnixConn) {
	t.Helper()
	fds, err := unix.Socketpair(unix.AF_UNIX, unix.SOCK_SEQPACKET|unix.SOCK_CLOEXEC, 0)
	if err != nil {
		t.Fatal(err)
	}
	conn := func(fd int) *net.UnixConn {
		f := os.NewFile(uintptr(fd), "seqpacket")
		defer f.Close()
		c, err := net.FileConn(f)
		if err != nil {
			t.Fatal(err)
		}
		t.Cleanup(func() { c.Close() })
		return c.(*net.UnixConn)
	}
	return conn(fds[0]), conn(fds[1])
}

// openFDs counts this process's open descriptors.
func openFDs(t *testing.T) int {
	t.Helper()
	ents, err := os.ReadDir("/proc/self/fd")
	if err != nil {
		t.Fatal(err)
	}
	return len(ents)
}

// sampleState is a state with two TCP pairs (one with pending bytes over
// several Data messages each way), a UDP pair and two clients, on real
// sockets; the objects are descriptors of /dev/null (the wire does not
// look at them).
func sampleState(t *testing.T) *handoverState {
	t.Helper()
	ns := testenv.MustNetNS(t)
	side := testenv.Side{NS: ns}
	tcp := func() (a, b *net.TCPConn) {
		return testenv.ConnPair(t, "tcp4", side, "127.0.0.1:0", side, "127.0.0.1:0")
	}
	st := &handoverState{}
	for i := range st.objs {
		st.objs[i] = devNull(t)
	}
	for i := range st.uobjs {
		st.uobjs[i] = devNull(t)
	}
	pending := make([]byte, 100<<10)
	rand.NewChaCha8([32]byte{1}).Read(pending)
	a, b := tcp()
	st.tcp = append(st.tcp, handoverPair{
		Info:  PairInfo{Handle: 7, Proto: "tcp", A: "a", B: "b", BytesAB: 12, Since: time.Unix(1700000000, 0).UTC()},
		State: splice.PairState{Index: 3, AB: splice.DirState{UserRead: 5, UserWrote: 4, DstOrigin: 9, Pending: pending}, BA: splice.DirState{Ended: true, Pending: []byte("tail!")}, A: a, B: b},
		Owner: 2,
	})
	a, b = tcp()
	st.tcp = append(st.tcp, handoverPair{Info: PairInfo{Handle: 9, Proto: "tcp", InKernel: true}, State: splice.PairState{Index: 0, UserOnly: true, A: a, B: b}})
	x, y := testenv.UDPConnPair(t, ns, "127.0.0.1:0")
	st.udp = append(st.udp, handoverUDPPair{Info: PairInfo{Handle: 11, Proto: "udp", DatagramsAB: 3}, State: splice.UDPPairState{Index: 1, CopiedAB: 2, RefusedB: 1, A: x, B: y}, Owner: 1})
	for range 2 {
		c, _ := seqpacketPair(t)
		st.clients = append(st.clients, c)
	}
	return st
}

func devNull(t *testing.T) int {
	t.Helper()
	fd, err := unix.Open(os.DevNull, unix.O_RDONLY|unix.O_CLOEXEC, 0)
	if err != nil {
		t.Fatal(err)
	}
	t.Cleanup(func() { unix.Close(fd) })
	return fd
}

// sameFile says whether two descriptors are the same open socket.
func sameFile(t *testing.T, a, b syscall.Conn) bool {
	t.Helper()
	stat := func(c syscall.Conn) unix.Stat_t {
		fd, err := fdOf(c)
		var st unix.Stat_t
		if err == nil {
			err = unix.Fstat(fd, &st)
		}
		if err != nil {
			t.Fatal(err)
		}
		return st
	}
	sa, sb := stat(a), stat(b)
	return sa.Ino == sb.Ino && sa.Dev == sb.Dev
}

// TestHandOverRoundTrip: every field of a state, its pending bytes (over
// several messages) and its descriptors arrive as sent.
func TestHandOverRoundTrip(t *testing.T) {
	testenv.RequireRoot(t)
	sent := sampleState(t)
	giver, taker := seqpacketPair(t)
	errs := make(chan error, 1)
	go func() { errs <- newHandoverConn(giver).sendState(sent) }()
	got, err := newHandoverConn(taker).recvState()
	if err != nil {
		t.Fatal(err)
	}
	defer got.close()
	if err := <-errs; err != nil {
		t.Fatal(err)
	}
	if len(got.tcp) != 2 || len(got.udp) != 1 || len(got.clients) != 2 {
		t.Fatalf("got %d TCP, %d UDP pairs, %d clients", len(got.tcp), len(got.udp), len(got.clients))
	}
	same := func(what string, a, b any) {
		ja, _ := json.Marshal(a)
		jb, _ := json.Marshal(b)
		if !bytes.Equal(ja, jb) {
			t.Errorf("%s: got %s, sent %s", what, jb, ja)
		}
	}
	for i, p := range sent.tcp {
		g := got.tcp[i]
		same("TCP info", p.Info, g.Info)
		same("TCP state", p.State, g.State)
		if g.Owner != p.Owner {
			t.Errorf("TCP pair %d owner %d, sent %d", i, g.Owner, p.Owner)
		}
		if !bytes.Equal(g.State.AB.Pending, p.State.AB.Pending) || !bytes.Equal(g.State.BA.Pending, p.State.BA.Pending) {
			t.Errorf("TCP pair %d: pending bytes differ (%d, %d; sent %d, %d)", i, len(g.State.AB.Pending), len(g.State.BA.Pending), len(p.State.AB.Pending), len(p.State.BA.Pending))
		}
		if !sameFile(t, p.State.A, g.State.A) || !sameFile(t, p.State.B, g.State.B) {
			t.Errorf("TCP pair %d: sockets are not the ones sent", i)
		}
	}
	same("UDP pairs", sent.udp, got.udp)
	if !sameFile(t, sent.udp[0].State.A, got.udp[0].State.A) || !sameFile(t, sent.udp[0].State.B, got.udp[0].State.B) {
		t.Error("UDP pair: sockets are not the ones sent")
	}
	for i := range sent.clients {
		if !sameFile(t, sent.clients[i], got.clients[i]) {
			t.Errorf("client %d is not the connection sent", i)
		}
	}
	for i := range sent.objs {
		var a, b unix.Stat_t
		unix.Fstat(sent.objs[i], &a)
		unix.Fstat(got.objs[i], &b)
		if a.Ino != b.Ino || got.objs[i] == sent.objs[i] {
			t.Errorf("object %d: got fd %d, not a copy of %d", i, got.objs[i], sent.objs[i])
		}
	}
}

// TestHandOverCutShort: a giver that stops after any message (it died)
// makes the taker fail, naming what it waited for, with none of the
// descriptors it received left open.
func TestHandOverCutShort(t *testing.T) {
	testenv.RequireRoot(t)
	sent := sampleState(t)
	// Count the messages of a whole hand-over: until the giver closes, not
	// until a pause (under qemu the giver paused over 200 ms between two).
	var total int
	{
		giver, relay := seqpacketPair(t)
		go func() {
			_ = newHandoverConn(giver).sendState(sent)
			giver.Close()
		}()
		total = relayMessages(t, relay, nil, -1)
	}
	if total != 1+2+4+1+1+2 { // head, 2 pairs, 4 + 1 data, UDP pair, 2 clients
		t.Fatalf("a hand-over of the sample took %d messages", total)
	}
	for cut := range total {
		before := openFDs(t)
		giver, in := seqpacketPair(t)
		out, taker := seqpacketPair(t)
		go newHandoverConn(giver).sendState(sent)
		relayMessages(t, in, out, cut)
		out.Close()
		st, err := newHandoverConn(taker).recvState()
		if err == nil {
			st.close()
			t.Fatalf("cut after %d of %d messages: the taker took it", cut, total)
		}
		if !strings.Contains(err.Error(), "waiting for") {
			t.Errorf("cut after %d: %v", cut, err)
		}
		giver.Close()
		in.Close()
		taker.Close()
		if after := openFDs(t); after != before {
			t.Fatalf("cut after %d messages (%v): %d descriptors open, %d before", cut, err, after, before)
		}
	}
}

// relayMessages copies up to n messages (n < 0: until in's peer closes)
// with their descriptors from in to out (nil: drop them); it returns how
// many it copied. A giver sends all it has: the deadline is only a bound.
func relayMessages(t *testing.T, in, out *net.UnixConn, n int) int {
	t.Helper()
	buf := make([]byte, maxMessage)
	oob := make([]byte, unix.CmsgSpace(objectFDs*4))
	copied := 0
	for ; n < 0 || copied < n; copied++ {
		in.SetReadDeadline(time.Now().Add(30 * time.Second))
		m, oobn, flags, _, err := in.ReadMsgUnix(buf, oob)
		if err != nil || m == 0 {
			break
		}
		fds, err := receivedFDs(oob[:oobn], flags)
		if err != nil {
			t.Fatal(err)
		}
		if out != nil {
			if _, _, err := out.WriteMsgUnix(buf[:m], oob[:oobn], nil); err != nil {
				t.Fatal(err)
			}
		}
		closeFDs(fds)
	}
	return copied
}

// TestHandOverRejectsMalformed: a message of the wrong kind or with the
// wrong number of descriptors ends the hand-over with an error that says
// so, and its descriptors are closed.
func TestHandOverRejectsMalformed(t *testing.T) {
	for _, c := range []struct {
		name string
		msg  string
		fds  int
		want string
	}{
		{"kind", `{"client":{"client":0}}`, 1, `got a "client" message, want head`},
		{"descriptors", `{"head":{"tcp_pairs":0}}`, 3, "came with 3 descriptors, want 10"},
		{"empty", `{}`, 0, `got a "" message`},
		{"refusal", `{"ok":false,"error":"versions differ"}`, 0, "refused the hand-over: versions differ"},
	} {
		t.Run(c.name, func(t *testing.T) {
			before := openFDs(t)
			giver, taker := seqpacketPair(t)
			var fds []int
			for range c.fds {
				fd, err := unix.Open(os.DevNull, unix.O_RDONLY|unix.O_CLOEXEC, 0)
				if err != nil {
					t.Fatal(err)
				}
				fds = append(fds, fd)
			}
			var oob []byte
			if len(fds) > 0 {
				oob = unix.UnixRights(fds...)
			}
			if _, _, err := giver.WriteMsgUnix([]byte(c.msg), oob, nil); err != nil {
				t.Fatal(err)
			}
			closeFDs(fds)
			_, err := newHandoverConn(taker).recvState()
			if err == nil || !strings.Contains(err.Error(), c.want) {
				t.Fatalf("error %v, want %q", err, c.want)
			}
			giver.Close()
			taker.Close()
			if after := openFDs(t); after != before {
				t.Fatalf("%d descriptors open, %d before", after, before)
			}
		})
	}
}
