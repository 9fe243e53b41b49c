package daemon_test

import (
	"encoding/json"
	"errors"
	"io"

	"context"
	"net"
	"os"
	"os/exec"
	"path/filepath"
	"strings"
	"syscall"
	"testing"
	"time"

	"golang.org/x/sys/unix"

	"github.com/shunt-project/shunt/daemon"
	"github.com/shunt-project/shunt/internal/testenv"
	"github.com/shunt-project/shunt/splice"
)

// mustDaemon serves on a socket in a temporary directory until the test ends.
func mustDaemon(t *testing.T) string {
	t.Helper()
	_, path := mustServer(t)
	return path
}

// mustServer is mustDaemon that also returns the server.
func mustServer(t *testing.T) (*daemon.Server, string) {
	t.Helper()
	testenv.RequireRoot(t)
	path := filepath.Join(t.TempDir(), "shunt.sock")
	srv, err := daemon.Listen(path, splice.Options{}, t.Logf)
	if err != nil {
		t.Fatal(err)
	}
	ctx, cancel := context.WithCancel(context.Background())
	done := make(chan error, 1)
	go func() { done <- srv.Serve(ctx) }()
	t.Cleanup(func() {
		cancel()
		if err := <-done; err != nil {
			t.Error(err)
		}
		if err := srv.Close(); err != nil {
			t.Error(err)
		}
		if _, err := os.Stat(path); !os.IsNotExist(err) {
			t.Errorf("control socket left behind: %v", err)
		}
	})
	return srv, path
}

func mustClient(t *testing.T, path string) *daemon.Client {
	t.Helper()
	cl, err := daemon.Dial(path)
	if err != nil {
		t.Fatal(err)
	}
	t.Cleanup(func() { cl.Close() })
	return cl
}

// pairs returns a client-side and a server-side connection in ns twice: the
// middle sockets (front, back) are what a proxy would hand over.
func sockets(t *testing.T, ns *testenv.NetNS) (client, front, back, server *net.TCPConn) {
	side := testenv.Side{NS: ns}
	client, front = testenv.ConnPair(t, "tcp4", side, "127.0.0.1:0", side, "127.0.0.1:0")
	back, server = testenv.ConnPair(t, "tcp4", side, "127.0.0.1:0", side, "127.0.0.1:0")
	return
}

// mustJoined hands a proxy's two sockets to the daemon through cl and
// returns the far ends and the pair's handle.
func mustJoined(t *testing.T, cl *daemon.Client) (client, server *net.TCPConn, handle uint64) {
	t.Helper()
	client, front, back, server := sockets(t, testenv.MustNetNS(t))
	h, err := cl.Join(front, back)
	if err != nil {
		t.Fatal(err)
	}
	front.Close() // the daemon holds its own descriptors
	back.Close()
	return client, server, h
}

// TestJoinByHandOver: two sockets sent over the control socket are joined;
// bytes flow both ways, the pair shows in stats, and when both ends close
// the client that joined it hears "ended" with the byte counts, which the
// daemon's totals (its metrics) keep.
func TestJoinByHandOver(t *testing.T) {
	srv, path := mustServer(t)
	cl := mustClient(t, path)
	client, server, h := mustJoined(t, cl)

	st, err := cl.Stats()
	if err != nil || len(st) != 1 || st[0].Handle != h || !st[0].InKernel {
		t.Fatalf("stats %+v, %v; want the one pair %d in the kernel", st, err, h)
	}
	up := testenv.Stream{Seed: 51, Size: 32 << 20, MaxChunk: 30000}
	down := testenv.Stream{Seed: 52, Size: 1 << 20, MaxChunk: 3000}
	if err := testenv.BothWays(client, server, up, down)(); err != nil {
		t.Fatal(err)
	}
	wantEnded(t, cl, h, up, down)
	if st, err := cl.Stats(); err != nil || len(st) != 0 {
		t.Fatalf("stats after the end: %+v, %v", st, err)
	}
	tot := srv.Totals()
	if tot.Joined != 1 || tot.Open != 0 || tot.Ended != 1 || tot.Failed != 0 || tot.Bytes != uint64(up.Size+down.Size) || tot.Kernel == 0 || tot.Kernel > tot.Bytes {
		t.Fatalf("totals %+v, want 1 pair joined and ended cleanly, %d bytes, some moved by the kernel", tot, up.Size+down.Size)
	}
}

// TestPairsOutliveTheirClient: a pair keeps flowing after the client that
// handed it over disconnects; another client can abort it.
func TestPairsOutliveTheirClient(t *testing.T) {
	srv, path := mustServer(t)
	cl := mustClient(t, path)
	client, server, h := mustJoined(t, cl)
	cl.Close()

	client.Write([]byte("still here"))
	buf := make([]byte, 10)
	server.SetReadDeadline(time.Now().Add(5 * time.Second))
	if _, err := server.Read(buf); err != nil || string(buf) != "still here" {
		t.Fatalf("%q, %v", buf, err)
	}
	// The bytes are counted once the forwarder is done with them, which
	// may be just after the server read them.
	for deadline := time.Now().Add(5 * time.Second); ; time.Sleep(5 * time.Millisecond) {
		tot := srv.Totals()
		if tot.Joined == 1 && tot.Open == 1 && tot.Bytes == 10 {
			break
		}
		if time.Now().After(deadline) {
			t.Fatalf("totals %+v with the pair open, want 1 joined and open, 10 bytes", tot)
		}
	}
	other := mustClient(t, path)
	if err := other.Abort(h); err != nil {
		t.Fatal(err)
	}
	client.SetReadDeadline(time.Now().Add(5 * time.Second))
	if _, err := client.Read(buf); !errorsIsReset(err) {
		t.Fatalf("client read %v after abort, want a reset", err)
	}
	for deadline := time.Now().Add(5 * time.Second); srv.Totals().Ended == 0 && time.Now().Before(deadline); {
		time.Sleep(time.Millisecond)
	}
	if tot := srv.Totals(); tot.Open != 0 || tot.Ended != 1 || tot.Closed != 1 || tot.Failed != 0 || tot.Bytes != 10 {
		t.Fatalf("totals %+v after the abort, want the pair ended as closed, its 10 bytes kept", tot)
	}
}

// TestBadRequests: each mistake gets an error reply, nothing leaks, and the
// connection stays usable.
func TestBadRequests(t *testing.T) {
	path := mustDaemon(t)
	cl := mustClient(t, path)
	client, front, _, _ := sockets(t, testenv.MustNetNS(t))
	_ = client
	fd := func(c *net.TCPConn) int {
		f, err := c.File()
		if err != nil {
			t.Fatal(err)
		}
		t.Cleanup(func() { f.Close() })
		return int(f.Fd())
	}
	pr, pw, _ := os.Pipe()
	defer pr.Close()
	defer pw.Close()
	var lc net.ListenConfig
	lc.SetMultipathTCP(false) // Go listens with MPTCP by default
	ln, err := lc.Listen(context.Background(), "tcp", "127.0.0.1:0")
	if err != nil {
		t.Fatal(err)
	}
	defer ln.Close()
	lf, _ := ln.(*net.TCPListener).File()
	defer lf.Close()
	for _, tc := range []struct {
		name string
		call func() error
		want string
	}{
		{"one-fd", func() error { return rawJoin(t, path, fd(front)) }, "join needs exactly two descriptors, got 1"},
		{"three-fds", func() error { return rawJoin(t, path, fd(front), fd(front), fd(front)) }, "join needs exactly two descriptors"},
		{"pipe", func() error { _, err := cl.JoinFDs(int(pr.Fd()), fd(front)); return err }, "first descriptor is not a socket"},
		{"listener", func() error { _, err := cl.JoinFDs(fd(front), int(lf.Fd())); return err }, "second descriptor is not a connected TCP socket"},
		{"abort-unknown", func() error { return cl.Abort(999) }, "no pair with handle 999"},
	} {
		err := tc.call()
		if err == nil || !strings.Contains(err.Error(), tc.want) {
			t.Errorf("%s: %v, want %q", tc.name, err, tc.want)
		}
	}
	if st, err := cl.Stats(); err != nil || len(st) != 0 {
		t.Fatalf("stats after bad requests: %+v, %v", st, err)
	}
}

// TestNotRoot: the control socket is root's; nobody cannot connect.
func TestNotRoot(t *testing.T) {
	path := mustDaemon(t)
	fi, err := os.Stat(path)
	if err != nil || fi.Mode().Perm() != 0o600 {
		t.Fatalf("socket mode %v, %v; want 0600", fi.Mode(), err)
	}
	cmd := exec.Command("/usr/bin/python3", "-c", "import socket,sys; s=socket.socket(socket.AF_UNIX, socket.SOCK_SEQPACKET); s.connect(sys.argv[1])", path)
	cmd.SysProcAttr = &syscall.SysProcAttr{Credential: &syscall.Credential{Uid: 65534, Gid: 65534}}
	out, err := cmd.CombinedOutput()
	if err == nil || !strings.Contains(string(out), "Permission denied") {
		t.Fatalf("nobody connected: %v %s", err, out)
	}
}

// TestSecondDaemonRefused: a second daemon on the same socket says so.
func TestSecondDaemonRefused(t *testing.T) {
	path := mustDaemon(t)
	if _, err := daemon.Listen(path, splice.Options{}, nil); err == nil || !strings.Contains(err.Error(), "another daemon is listening") {
		t.Fatalf("second daemon: %v", err)
	}
}

func errorsIsReset(err error) bool {
	return err != nil && strings.Contains(err.Error(), "connection reset")
}

// rawJoin sends a join with the given descriptors and returns the daemon's
// error, if any.
func rawJoin(t *testing.T, path string, fds ...int) error {
	c, err := net.DialUnix("unixpacket", nil, &net.UnixAddr{Name: path, Net: "unixpacket"})
	if err != nil {
		t.Fatal(err)
	}
	defer c.Close()
	if _, _, err := c.WriteMsgUnix([]byte(`{"op":"join"}`), unix.UnixRights(fds...), nil); err != nil {
		t.Fatal(err)
	}
	buf := make([]byte, 4096)
	n, err := c.Read(buf)
	if err != nil {
		t.Fatal(err)
	}
	var r daemon.Reply
	if err := json.Unmarshal(buf[:n], &r); err != nil {
		t.Fatal(err)
	}
	if !r.OK {
		return errors.New(r.Error)
	}
	return nil
}

// TestTakeOver: a new daemon takes the pairs of a running one in the middle
// of a stream; the old one ends without resetting anything, the stream ends
// intact, and the new daemon knows the pair by its old handle. The client
// that joined it never notices: its connection moves to the new daemon,
// which answers it and sends it the pair's "ended" event.
func TestTakeOver(t *testing.T) {
	testenv.RequireRoot(t)
	path := filepath.Join(t.TempDir(), "shunt.sock")
	old, oldDone := startOldDaemon(t, path)

	cl := mustClient(t, path)
	client, server, h := mustJoined(t, cl)
	up := testenv.Stream{Seed: 81, Size: 256 << 20, MaxChunk: 64 << 10}
	down := testenv.Stream{Seed: 82, Size: 16 << 20, MaxChunk: 8 << 10}
	wait := testenv.BothWays(client, server, up, down)
	time.Sleep(50 * time.Millisecond)

	takeOver(t, path, 1, oldDone)
	if handed, ok := old.HandedOver(); !ok || handed != 1 {
		t.Fatalf("old daemon: handed %d, %v", handed, ok)
	}
	if err := old.Close(); err != nil {
		t.Fatal(err)
	}
	if _, err := os.Stat(path); err != nil {
		t.Fatalf("the old daemon removed the new one's socket: %v", err)
	}
	st, err := mustClient(t, path).Stats()
	if err != nil || len(st) != 1 || st[0].Handle != h {
		t.Fatalf("new daemon's stats %+v, %v; want handle %d", st, err, h)
	}
	// The old client's connection, now served by the new daemon.
	if st, err := cl.Stats(); err != nil || len(st) != 1 || st[0].Handle != h {
		t.Fatalf("the joining client's stats after the take-over: %+v, %v", st, err)
	}
	if err := wait(); err != nil {
		t.Fatal(err)
	}
	wantEnded(t, cl, h, up, down)
}

// TestTakeOverRefusedAcrossVersions: a daemon whose state layout differs
// from the taker's refuses before it stops anything; its pairs keep going
// and it keeps serving.
func TestTakeOverRefusedAcrossVersions(t *testing.T) {
	path := mustDaemon(t)
	cl := mustClient(t, path)
	client, server, h := mustJoined(t, cl)
	c, err := net.DialUnix("unixpacket", nil, &net.UnixAddr{Name: path, Net: "unixpacket"})
	if err != nil {
		t.Fatal(err)
	}
	defer c.Close()
	c.Write([]byte(`{"op":"handover","version":"splice-dir-0-pair-0"}`))
	buf := make([]byte, 4096)
	n, err := c.Read(buf)
	var r daemon.Reply
	if err != nil || json.Unmarshal(buf[:n], &r) != nil || r.OK || !strings.Contains(r.Error, "cannot hand over") {
		t.Fatalf("reply %q, %v", buf[:n], err)
	}
	client.Write([]byte("still joined"))
	got := make([]byte, 12)
	server.SetReadDeadline(time.Now().Add(5 * time.Second))
	if _, err := io.ReadFull(server, got); err != nil || string(got) != "still joined" {
		t.Fatalf("%q, %v", got, err)
	}
	if st, err := cl.Stats(); err != nil || len(st) != 1 || st[0].Handle != h {
		t.Fatalf("stats %+v, %v", st, err)
	}
}

// TestJoinHalfClosed: a pair whose server already sent FIN is accepted; it
// cannot join the kernel map, so the daemon copies it, with the same result.
func TestJoinHalfClosed(t *testing.T) {
	path := mustDaemon(t)
	cl := mustClient(t, path)
	client, front, back, server := sockets(t, testenv.MustNetNS(t))
	io.WriteString(server, "bye")
	server.CloseWrite()
	testenv.WaitTCPState(t, back, unix.BPF_TCP_CLOSE_WAIT) // the FIN arrived
	if _, err := cl.Join(front, back); err != nil {
		t.Fatal(err)
	}
	front.Close()
	back.Close()
	if st, err := cl.Stats(); err != nil || len(st) != 1 || st[0].InKernel {
		t.Fatalf("stats %+v, %v; want one pair copied in user space", st, err)
	}
	up := testenv.Stream{Seed: 83, Size: 1 << 20, MaxChunk: 5000}
	errs := make(chan error, 1)
	go func() { errs <- up.WriteAndClose(client) }()
	if got, err := io.ReadAll(client); err != nil || string(got) != "bye" {
		t.Fatalf("client read %q, %v", got, err)
	}
	if err := up.Check(server, true); err != nil {
		t.Fatal(err)
	}
	if err := <-errs; err != nil {
		t.Fatal(err)
	}
	select {
	case ev := <-cl.Events():
		if ev.BytesAB != uint64(up.Size) || ev.BytesBA != 3 || ev.Error != "" {
			t.Fatalf("event %+v", ev)
		}
	case <-time.After(10 * time.Second):
		t.Fatal("no ended event")
	}
}

// startOldDaemon serves at path; the channel gets Serve's end.
func startOldDaemon(t *testing.T, path string) (*daemon.Server, chan error) {
	t.Helper()
	old, err := daemon.Listen(path, splice.Options{}, t.Logf)
	if err != nil {
		t.Fatal(err)
	}
	done := make(chan error, 1)
	go func() { done <- old.Serve(context.Background()) }()
	return old, done
}

// takeOver starts a daemon that takes the want pairs of the one at path,
// serving until the test ends, and waits for the old one's Serve to end.
func takeOver(t *testing.T, path string, want int, oldDone chan error) {
	t.Helper()
	srv, n, err := daemon.TakeOver(path, splice.Options{}, t.Logf)
	if err != nil || n != want {
		t.Fatalf("took over %d pairs, want %d: %v", n, want, err)
	}
	ctx, cancel := context.WithCancel(context.Background())
	newDone := make(chan error, 1)
	go func() { newDone <- srv.Serve(ctx) }()
	t.Cleanup(func() { cancel(); <-newDone; srv.Close() })
	if err := <-oldDone; err != nil {
		t.Fatal(err)
	}
}

// TestTakeOverFailsHalfway: a new daemon that dies or fails anywhere before
// the commit takes nothing: the old daemon thaws its pairs where they stand
// and serves on. A stream in flight through every failed attempt ends
// intact; the joining client keeps its connection, is answered and gets the
// pair's end; a UDP pair still forwards; new joins work; no descriptor is
// left over; and a later take-over still succeeds.
func TestTakeOverFailsHalfway(t *testing.T) {
	testenv.RequireRoot(t)
	path := filepath.Join(t.TempDir(), "shunt.sock")
	_, oldDone := startOldDaemon(t, path)
	cl := mustClient(t, path)
	client, server, h := mustJoined(t, cl)
	ns := testenv.MustNetNS(t)
	uclient, front := testenv.UDPConnPair(t, ns, "127.0.0.1:0")
	back, userver := testenv.UDPConnPair(t, ns, "127.0.0.1:0")
	if _, err := cl.JoinUDP(front, back); err != nil {
		t.Fatal(err)
	}
	front.Close()
	back.Close()
	up := testenv.Stream{Seed: 85, Size: 256 << 20, MaxChunk: 64 << 10}
	down := testenv.Stream{Seed: 86, Size: 16 << 20, MaxChunk: 8 << 10}
	wait := testenv.BothWays(client, server, up, down)

	fds := func() int {
		ents, err := os.ReadDir("/proc/self/fd")
		if err != nil {
			t.Fatal(err)
		}
		return len(ents)
	}
	before := fds()
	for _, attempt := range []struct {
		name string
		take func() error
	}{
		{"dies after the head", func() error { return daemon.TakeOverAndDie(path, 1) }},
		{"dies after a pair", func() error { return daemon.TakeOverAndDie(path, 2) }},
		{"dies before ready", func() error { return daemon.TakeOverAndDie(path, -1) }},
		{"cannot listen", func() error {
			// A directory where the new daemon binds its socket first.
			if err := os.MkdirAll(path+".new/in-the-way", 0o755); err != nil {
				return err
			}
			defer os.RemoveAll(path + ".new")
			srv, _, err := daemon.TakeOver(path, splice.Options{}, t.Logf)
			if err == nil {
				srv.Close()
				return errors.New("took over")
			}
			t.Logf("cannot listen: %v", err)
			return nil
		}},
	} {
		time.Sleep(20 * time.Millisecond) // let the stream move between attempts
		if err := attempt.take(); err != nil {
			t.Fatalf("%s: %v", attempt.name, err)
		}
		// Answered on the connection that joined: the old daemon serves.
		st, err := statsWithin(t, cl, 10*time.Second)
		if err != nil || len(st) != 2 || st[0].Handle != h {
			t.Fatalf("%s: stats %+v, %v; want the TCP pair %d and the UDP pair", attempt.name, st, err, h)
		}
		select {
		case err := <-oldDone:
			t.Fatalf("%s: the old daemon stopped serving (%v)", attempt.name, err)
		default:
		}
		uclient.Write([]byte(attempt.name))
		userver.SetReadDeadline(time.Now().Add(5 * time.Second))
		buf := make([]byte, 100)
		if n, err := userver.Read(buf); err != nil || string(buf[:n]) != attempt.name {
			t.Fatalf("%s: the UDP pair forwarded %q, %v", attempt.name, buf[:n], err)
		}
	}
	if after := fds(); after != before {
		t.Errorf("%d descriptors open after the failed hand-overs, %d before", after, before)
	}
	c2, s2, _ := mustJoined(t, cl)
	testenv.Warm(t, c2, s2)
	if err := wait(); err != nil {
		t.Fatal(err)
	}
	wantEnded(t, cl, h, up, down)
	takeOver(t, path, 2, oldDone) // the UDP pair and the new TCP pair
}

// statsWithin asks for stats, failing the test if no answer comes in time.
func statsWithin(t *testing.T, cl *daemon.Client, d time.Duration) ([]daemon.PairInfo, error) {
	t.Helper()
	type result struct {
		st  []daemon.PairInfo
		err error
	}
	got := make(chan result, 1)
	go func() { st, err := cl.Stats(); got <- result{st, err} }()
	select {
	case r := <-got:
		return r.st, r.err
	case <-time.After(d):
		t.Fatalf("no answer to stats within %v", d)
		return nil, nil
	}
}

// wantEnded waits for the "ended" event of pair h after up and down went
// through it whole, without error.
func wantEnded(t *testing.T, cl *daemon.Client, h uint64, up, down testenv.Stream) {
	t.Helper()
	select {
	case ev := <-cl.Events():
		if ev.Event != "ended" || ev.Handle != h || ev.BytesAB != uint64(up.Size) || ev.BytesBA != uint64(down.Size) || ev.Error != "" {
			t.Fatalf("event %+v, want pair %d ended after %d and %d bytes", ev, h, up.Size, down.Size)
		}
	case <-time.After(10 * time.Second):
		t.Fatalf("no ended event for pair %d within 10 s", h)
	}
}

// TestLateReplyIsNotTakenForTheNext: a daemon that answers after the
// client gave up must not have that answer taken for the client's next
// request: the client gives up on the connection instead.
func TestLateReplyIsNotTakenForTheNext(t *testing.T) {
	path := filepath.Join(t.TempDir(), "slow.sock")
	ln, err := net.ListenUnix("unixpacket", &net.UnixAddr{Name: path, Net: "unixpacket"})
	if err != nil {
		t.Fatal(err)
	}
	defer ln.Close()
	go func() {
		c, err := ln.AcceptUnix()
		if err != nil {
			return
		}
		defer c.Close()
		buf := make([]byte, 4096)
		if _, err := c.Read(buf); err != nil {
			return
		}
		time.Sleep(400 * time.Millisecond) // past the client's bound
		c.Write([]byte(`{"ok":true,"pairs":[{"handle":41,"proto":"tcp"}]}`))
		c.Read(buf) // the next request, if it comes
		c.Write([]byte(`{"ok":true,"pairs":[{"handle":41,"proto":"tcp"}]}`))
		time.Sleep(time.Second)
	}()
	cl := mustClient(t, path)
	daemon.SetReplyTimeout(cl, 200*time.Millisecond)
	if _, err := cl.Stats(); err == nil || !strings.Contains(err.Error(), "did not answer") {
		t.Fatalf("first request: %v, want the bound", err)
	}
	time.Sleep(300 * time.Millisecond) // the late answer has been sent
	if st, err := cl.Stats(); err == nil {
		t.Fatalf("second request answered with %+v: the first request's late reply", st)
	}
}
