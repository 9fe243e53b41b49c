package bypass_test

import (
	"bufio"
	"fmt"
	"io"
	"net"
	"os"
	"os/exec"
	"runtime"
	"strconv"
	"strings"
	"testing"
	"time"

	"golang.org/x/sys/unix"

	"github.com/shunt-project/shunt/bypass"
	"github.com/shunt-project/shunt/host"
	"github.com/shunt-project/shunt/internal/testenv"
)

// blockingReader reads a connection with blocking recv (MSG_WAITALL or 0 for
// flags), as a C program would: Go's own sockets are non-blocking, where
// MSG_WAITALL has no effect.
type blockingReader struct {
	t     *testing.T
	c     *net.TCPConn
	flags int
}

func (r blockingReader) Read(b []byte) (n int, err error) {
	rawFD(r.t, r.c, func(fd int) {
		unix.SetNonblock(fd, false)
		defer unix.SetNonblock(fd, true)
		unix.SetsockoptTimeval(fd, unix.SOL_SOCKET, unix.SO_RCVTIMEO, &unix.Timeval{Sec: 10})
		for {
			n, _, err = unix.Recvfrom(fd, b, r.flags)
			// A blocking read on a sockhash socket gives EAGAIN where TCP
			// restarts (the "signal" row of docs/TRANSPARENCY.md).
			if err != unix.EAGAIN && err != unix.EINTR {
				break
			}
		}
	})
	if n == 0 && err == nil {
		return 0, fmt.Errorf("EOF")
	}
	return max(n, 0), err
}

// waitLeft waits until no socket of the install is left in the sockhash.
func waitLeft(t *testing.T, in *bypass.Install, within time.Duration) {
	t.Helper()
	deadline := time.Now().Add(within)
	for mapEntries(t, in, "sock_hash") != 0 {
		if time.Now().After(deadline) {
			t.Fatalf("%d socket(s) still in the sockhash after %v", mapEntries(t, in, "sock_hash"), within)
		}
		time.Sleep(10 * time.Millisecond)
	}
}

// A reader that blocks in recv, or asks for MSG_WAITALL, from its first read:
// its direction never takes a redirect, and the connection leaves the
// sockhash at once, so what the kernel gives a sockhash socket differently
// (FIONREAD of bytes that came by TCP, here) is TCP's own again.
func TestBlockingReaderLeaves(t *testing.T) {
	for _, tc := range []struct {
		name  string
		flags int
	}{{"recv", 0}, {"MSG_WAITALL", unix.MSG_WAITALL}} {
		t.Run(tc.name, func(t *testing.T) {
			in, cg := mustInstall(t)
			c, s := connPair(t, cg)
			before, _ := in.Stats()

			go c.Write([]byte("hello"))
			b := make([]byte, 5)
			if n, err := (blockingReader{t, s, tc.flags}).Read(b); n != 5 || err != nil || string(b) != "hello" {
				t.Fatalf("blocking read %q %v", b[:n], err)
			}
			waitLeft(t, in, 2*time.Second)
			after, _ := in.Stats()
			if after.Counters.TCPReaders-before.Counters.TCPReaders != 1 || after.Counters.Left-before.Counters.Left != 2 {
				t.Errorf("counters: %d TCP readers, %d sockets left; want 1 and 2",
					after.Counters.TCPReaders-before.Counters.TCPReaders, after.Counters.Left-before.Counters.Left)
			}

			c.Write([]byte("twelve bytes"))
			if q := waitQueued(t, s, 12); q != 12 {
				t.Errorf("FIONREAD %d after leaving, want 12 (a sockhash socket counts only redirected bytes)", q)
			}
			if _, err := io.ReadFull(s, make([]byte, 12)); err != nil {
				t.Fatal(err)
			}
			testenv.Warm(t, c, s)
			exchange(t, s, c, "and back")
			if f := flowOf(t, in, testenv.Cookie(t, c)); f != nil {
				t.Errorf("connection paired again after it left: %+v", f)
			}
		})
	}
}

// A reader that switches to MSG_WAITALL in the middle of a redirected stream:
// every byte arrives in order across the switch, and the connection leaves the
// sockhash once nothing redirected is left unread.
func TestWaitAllSwitchMidStream(t *testing.T) {
	in, cg := mustInstall(t)
	c, s := warmPair(t, cg)
	for _, conn := range []*net.TCPConn{c, s} {
		conn.SetDeadline(time.Now().Add(30 * time.Second))
	}

	stream := testenv.Stream{Seed: 11, Size: 16 << 20, MaxChunk: 64 << 10}
	wrote := make(chan error, 1)
	go func() { wrote <- stream.Write(c) }()
	if err := stream.Check(&switchingReader{plain: s, waitAll: blockingReader{t, s, unix.MSG_WAITALL}, switchAt: 4 << 20}, false); err != nil {
		t.Fatal(err)
	}
	if err := <-wrote; err != nil {
		t.Fatal(err)
	}
	waitLeft(t, in, 2*time.Second)
	st, _ := in.Stats()
	if st.Counters.TCPReaders == 0 {
		t.Error("the MSG_WAITALL reader was not counted")
	}
}

// switchingReader reads plainly up to switchAt bytes, then with MSG_WAITALL.
type switchingReader struct {
	plain    *net.TCPConn
	waitAll  blockingReader
	switchAt int
	read     int
}

func (r *switchingReader) Read(b []byte) (int, error) {
	var n int
	var err error
	if r.read < r.switchAt {
		n, err = r.plain.Read(b[:min(len(b), r.switchAt-r.read)])
	} else {
		n, err = r.waitAll.Read(b)
	}
	r.read += n
	return n, err
}

// Leaving never drops redirected bytes: the peer of a socket that left keeps
// its place in the sockhash until its reader has read what was redirected to
// it, and only then follows.
func TestLeaveWaitsForUnreadBytes(t *testing.T) {
	in, cg := mustInstall(t)
	c, s := warmPair(t, cg)
	c.SetDeadline(time.Now().Add(10 * time.Second))

	unread := strings.Repeat("redirected, not read yet ", 40)
	if _, err := s.Write([]byte(unread)); err != nil {
		t.Fatal(err)
	}
	go c.Write([]byte("1234"))
	if n, err := (blockingReader{t, s, unix.MSG_WAITALL}).Read(make([]byte, 4)); n != 4 || err != nil {
		t.Fatalf("MSG_WAITALL read: %d %v", n, err)
	}
	// The server leaves; the client, holding unread redirected bytes, stays
	// for as long as they are unread (here several times the settle delay).
	deadline := time.Now().Add(2 * time.Second)
	for mapEntries(t, in, "sock_hash") > 1 && time.Now().Before(deadline) {
		time.Sleep(10 * time.Millisecond)
	}
	time.Sleep(500 * time.Millisecond)
	if n := mapEntries(t, in, "sock_hash"); n != 1 {
		t.Fatalf("%d sockets in the sockhash, want 1: the client, holding %d unread redirected bytes", n, len(unread))
	}
	got := make([]byte, len(unread))
	if _, err := io.ReadFull(c, got); err != nil || string(got) != unread {
		t.Fatalf("client read %q %v", got, err)
	}
	waitLeft(t, in, 2*time.Second)
	exchange(t, s, c, "after both left")
	exchange(t, c, s, "both ways")
}

// Without a reader seen in recv the first bytes take TCP; TrustReaders
// redirects them too, keeps a blocking reader's connection, and still moves a
// MSG_WAITALL reader's connection back to plain TCP.
func TestTrustReaders(t *testing.T) {
	for _, trust := range []bool{false, true} {
		t.Run(fmt.Sprintf("trust=%v", trust), func(t *testing.T) {
			in, cg := mustInstallWith(t, bypass.Options{TrustReaders: trust})
			c, s := connPair(t, cg)
			exchange(t, c, s, "first")
			f := flowOf(t, in, testenv.Cookie(t, c))
			if f == nil || f.Client == nil {
				t.Fatalf("not paired: %+v", f)
			}
			if redirected := f.Client.TxMsgs == 1; redirected != trust {
				t.Errorf("first send redirected: %v, want %v (%+v)", redirected, trust, f.Client)
			}

			go c.Write([]byte("1234"))
			if n, err := (blockingReader{t, s, 0}).Read(make([]byte, 4)); n != 4 || err != nil {
				t.Fatalf("blocking read: %d %v", n, err)
			}
			if !trust {
				waitLeft(t, in, 2*time.Second)
				return
			}
			time.Sleep(3 * bypass.RedirectSettle)
			if n := mapEntries(t, in, "sock_hash"); n != 2 {
				t.Fatalf("%d sockets in the sockhash after a blocking read, want both", n)
			}
			go c.Write([]byte("1234"))
			if n, err := (blockingReader{t, s, unix.MSG_WAITALL}).Read(make([]byte, 4)); n != 4 || err != nil {
				t.Fatalf("MSG_WAITALL read: %d %v", n, err)
			}
			waitLeft(t, in, 2*time.Second)
		})
	}
}

// Both directions stream while the server's reader switches to MSG_WAITALL:
// the connection leaves the sockhash under traffic each way, and neither
// stream loses, repeats or reorders a byte.
func TestLeaveUnderTrafficBothWays(t *testing.T) {
	in, cg := mustInstall(t)
	c, s := warmPair(t, cg)
	for _, conn := range []*net.TCPConn{c, s} {
		conn.SetDeadline(time.Now().Add(60 * time.Second))
	}
	up := testenv.Stream{Seed: 21, Size: 32 << 20, MaxChunk: 64 << 10}
	down := testenv.Stream{Seed: 22, Size: 32 << 20, MaxChunk: 64 << 10}
	errs := make(chan error, 4)
	go func() { errs <- up.Write(c) }()
	go func() { errs <- down.Write(s) }()
	go func() { errs <- down.Check(c, false) }()
	go func() {
		errs <- up.Check(&switchingReader{plain: s, waitAll: blockingReader{t, s, unix.MSG_WAITALL}, switchAt: 8 << 20}, false)
	}()
	for range 4 {
		if err := <-errs; err != nil {
			t.Fatal(err)
		}
	}
	waitLeft(t, in, 2*time.Second)
	exchange(t, c, s, "plain TCP now")
	exchange(t, s, c, "both ways")
}

// An install reports the options it was created with, also through a handle
// opened later from the pins.
func TestOptionsReadBack(t *testing.T) {
	for _, want := range []bypass.Options{{MaxBacklog: bypass.DefaultMaxBacklog}, {MaxBacklog: 1 << 20, TrustReaders: true}} {
		in, _ := mustInstallWith(t, want)
		again, err := bypass.Open(in.Dir())
		if err != nil {
			t.Fatal(err)
		}
		got, err := again.Options()
		again.Close()
		if err != nil || got != want {
			t.Errorf("options %+v (%v), want %+v", got, err, want)
		}
	}
}

// A signal during a blocking read: TCP restarts the read (Go's handlers are
// SA_RESTART) and it returns the data; a socket in the sockhash returns
// EAGAIN instead (tcp_bpf_recvmsg, 6.18). So a blocking reader sends its
// connection back to plain TCP after its first read, and from then on reads
// as over TCP. That first read, if it sleeps and a signal comes, still gets
// EAGAIN (nothing sees a read before it runs): counted, and pinned down here
// as the open part of the "signal" row of docs/TRANSPARENCY.md.
func TestSignalDuringBlockingRead(t *testing.T) {
	in, enabled := mustInstall(t)
	plain := testenv.MustCgroup(t)
	for _, tc := range []struct {
		name       string
		cg         host.Cgroup
		readsFirst bool // one blocking read before the signalled one
		want       string
		eagain     uint64
	}{
		{"plain TCP", plain, false, `"data" <nil>`, 0},
		{"shunt, after a blocking read", enabled, true, `"data" <nil>`, 0},
		{"shunt, the first blocking read", enabled, false, `"" resource temporarily unavailable`, 1},
	} {
		t.Run(tc.name, func(t *testing.T) {
			c, s := warmPair(t, tc.cg)
			if tc.readsFirst {
				go c.Write([]byte("1234"))
				if n, err := (blockingReader{t, s, 0}).Read(make([]byte, 4)); n != 4 || err != nil {
					t.Fatalf("blocking read: %d %v", n, err)
				}
				waitLeft(t, in, 2*time.Second)
			}
			before, _ := in.Stats()
			tids := make(chan int, 1)
			got := make(chan string, 1)
			go func() {
				runtime.LockOSThread()
				defer runtime.UnlockOSThread()
				rawFD(t, s, func(fd int) {
					unix.SetNonblock(fd, false)
					defer unix.SetNonblock(fd, true)
					unix.SetsockoptTimeval(fd, unix.SOL_SOCKET, unix.SO_RCVTIMEO, &unix.Timeval{})
					tids <- unix.Gettid()
					b := make([]byte, 4)
					n, _, err := unix.Recvfrom(fd, b, 0)
					got <- fmt.Sprintf("%q %v", b[:max(n, 0)], err)
				})
			}()
			tid := <-tids
			waitState(t, fmt.Sprintf("/proc/self/task/%d", tid), unix.SYS_RECVFROM, "S")
			unix.Tgkill(unix.Getpid(), tid, unix.SIGURG)
			time.Sleep(50 * time.Millisecond)
			c.Write([]byte("data"))
			var res string
			select {
			case res = <-got:
			case <-time.After(5 * time.Second):
				t.Fatal("the read never returned")
			}
			if res != tc.want {
				t.Errorf("read after a signal: %s, want %s", res, tc.want)
			}
			if after, _ := in.Stats(); after.Counters.EAGAIN-before.Counters.EAGAIN != tc.eagain {
				t.Errorf("EAGAIN counted %d times, want %d", after.Counters.EAGAIN-before.Counters.EAGAIN, tc.eagain)
			}
		})
	}
}

// waitState waits until the task whose /proc directory is dir is in state
// ("S": sleeping interruptibly, where a signal ends the wait; "T": stopped)
// and, for nr >= 0, inside syscall nr.
func waitState(t *testing.T, dir string, nr int, state string) {
	t.Helper()
	deadline := time.Now().Add(5 * time.Second)
	for {
		b, err := os.ReadFile(dir + "/syscall")
		st, _ := os.ReadFile(dir + "/stat")
		// stat: "tid (comm) S ...": the state follows the last ')'.
		got := ""
		if i := strings.LastIndexByte(string(st), ')'); i >= 0 && i+2 < len(st) {
			got = string(st[i+2])
		}
		f := strings.Fields(string(b))
		inCall := nr < 0 || err == nil && len(f) > 0 && f[0] == fmt.Sprint(nr)
		if inCall && got == state {
			return
		}
		if time.Now().After(deadline) {
			t.Fatalf("%s not in state %s (syscall %d) after 5 s: %q, %q", dir, state, nr, st, b)
		}
		time.Sleep(time.Millisecond)
	}
}

// stopContinueScript is a program on blocking sockets (Python without a
// timeout): one exchange, then it waits in recv; the test stops and continues
// it there, then tells its child to send. It keeps its sockets until stdin
// closes.
const stopContinueScript = `
import os, socket, sys
ln = socket.create_server(("127.0.0.1", 0))
c = socket.create_connection(ln.getsockname())
s, _ = ln.accept()
c.sendall(b"x"); s.recv(1)
if os.fork() == 0:
    sys.stdin.read(1)
    c.sendall(b"data")
    os._exit(0)
print(os.getpid(), flush=True)
try:
    print("got", s.recv(4), flush=True)
except OSError as e:
    print("error", type(e).__name__, flush=True)
sys.stdin.read()
`

// A program stopped and continued (Ctrl-Z, fg) while it waits in a blocking
// recv: over TCP the read goes on and returns the data. Through shunt the
// same, because its first blocking read sent the connection back to TCP; with
// --trust-readers the connection stays and the read fails with EAGAIN
// (Python's BlockingIOError), which is why blocking readers leave.
func TestStopContinueBlockingReader(t *testing.T) {
	in, enabled := mustInstall(t)
	trust, trusting := mustInstallWith(t, bypass.Options{TrustReaders: true})
	for _, tc := range []struct {
		name string
		in   *bypass.Install // nil: plain TCP
		cg   host.Cgroup
		want string
		left uint64 // sockets that left the sockhash
	}{
		{"plain TCP", nil, testenv.MustCgroup(t), "got b'data'", 0},
		{"shunt", in, enabled, "got b'data'", 2},
		{"shunt --trust-readers", trust, trusting, "error BlockingIOError", 0},
	} {
		t.Run(tc.name, func(t *testing.T) {
			var before bypass.Stats
			if tc.in != nil {
				before, _ = tc.in.Stats()
			}
			ns := testenv.MustNetNS(t)
			cmd := exec.Command("sh", "-c", `echo $$ > "$1/cgroup.procs" && exec ip netns exec "$2" python3 -c "$3"`,
				"sh", tc.cg.Path, ns.Name, stopContinueScript)
			stdin, _ := cmd.StdinPipe()
			out, _ := cmd.StdoutPipe()
			cmd.Stderr = os.Stderr
			if err := cmd.Start(); err != nil {
				t.Fatal(err)
			}
			t.Cleanup(func() {
				stdin.Close()
				cmd.Process.Kill()
				cmd.Wait()
			})
			lines := bufio.NewScanner(out)
			if !lines.Scan() {
				t.Fatalf("no pid from the program: %v", lines.Err())
			}
			pid, err := strconv.Atoi(lines.Text())
			if err != nil {
				t.Fatalf("pid line %q", lines.Text())
			}
			waitState(t, fmt.Sprintf("/proc/%d", pid), unix.SYS_RECVFROM, "S")
			unix.Kill(pid, unix.SIGSTOP)
			waitState(t, fmt.Sprintf("/proc/%d", pid), -1, "T")
			unix.Kill(pid, unix.SIGCONT)
			time.Sleep(50 * time.Millisecond)
			stdin.Write([]byte("g"))
			if !lines.Scan() {
				t.Fatalf("no result from the program: %v", lines.Err())
			}
			if got := lines.Text(); got != tc.want {
				t.Errorf("after a stop and continue: %s, want %s", got, tc.want)
			}
			if tc.in == nil {
				return
			}
			// The client follows the server out once the settle delay is over.
			var paired, left uint64
			for deadline := time.Now().Add(2 * time.Second); time.Now().Before(deadline); time.Sleep(10 * time.Millisecond) {
				after, _ := tc.in.Stats()
				paired, left = after.Counters.Paired-before.Counters.Paired, after.Counters.Left-before.Counters.Left
				if paired == 1 && left == tc.left {
					break
				}
			}
			if paired != 1 || left != tc.left {
				t.Errorf("%d connections paired, %d sockets left; want 1 and %d", paired, left, tc.left)
			}
		})
	}
}
