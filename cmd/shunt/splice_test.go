package main

import (
	"bytes"
	"fmt"
	"net"
	"os"
	"os/exec"
	"strings"
	"syscall"
	"testing"
	"time"

	"github.com/shunt-project/shunt/internal/testenv"
)

// holder is a process in ns holding two connected sockets (and a pipe on
// fd 0), standing in for a proxy that wants its sockets joined.
type holder struct {
	cmd      *exec.Cmd
	fdA, fdB int
}

// mustHeld makes a namespace, two listeners and a holder connected to both;
// it returns the holder and the listeners' ends of its two connections.
func mustHeld(t *testing.T) (h *holder, farA, farB *net.TCPConn) {
	t.Helper()
	ns := testenv.MustNetNS(t)
	side := testenv.Side{NS: ns}
	lnA := testenv.Listen(t, side, "tcp", "127.0.0.1:0")
	lnB := testenv.Listen(t, side, "tcp", "127.0.0.1:0")
	h = mustHolder(t, ns, lnA.Addr().(*net.TCPAddr).Port, lnB.Addr().(*net.TCPAddr).Port)
	return h, testenv.Accept(t, lnA), testenv.Accept(t, lnB)
}

func mustHolder(t *testing.T, ns *testenv.NetNS, portA, portB int) *holder {
	t.Helper()
	return startHolder(t, ns, fmt.Sprintf(`a = socket.create_connection(("127.0.0.1", %d))
b = socket.create_connection(("127.0.0.1", %d))`, portA, portB))
}

// startHolder runs a holder whose python lines connect sockets a and b.
func startHolder(t *testing.T, ns *testenv.NetNS, connect string) *holder {
	t.Helper()
	script := "import socket, sys\n" + connect + "\nprint(a.fileno(), b.fileno(), flush=True)\nsys.stdin.read()"
	cmd := exec.Command("ip", "netns", "exec", ns.Name, "python3", "-c", script)
	stdin, _ := cmd.StdinPipe()
	out, _ := cmd.StdoutPipe()
	if err := cmd.Start(); err != nil {
		t.Fatal(err)
	}
	t.Cleanup(func() { stdin.Close(); cmd.Wait() })
	h := &holder{cmd: cmd}
	if _, err := fmt.Fscan(out, &h.fdA, &h.fdB); err != nil {
		t.Fatalf("holder: %v", err)
	}
	return h
}

// TestSpliceCommand joins two sockets of a running process: what one far end
// sends reaches the other both ways, EOF follows, and the command reports.
func TestSpliceCommand(t *testing.T) {
	testenv.RequireRoot(t)
	h, farA, farB := mustHeld(t)

	run := startShunt(t, nil, "splice: joined fd", "splice", "--pid", fmt.Sprint(h.cmd.Process.Pid), "--fd", fmt.Sprint(h.fdA), "--fd", fmt.Sprint(h.fdB))
	there := testenv.Stream{Seed: 31, Size: 16 << 20, MaxChunk: 40000}
	back := testenv.Stream{Seed: 32, Size: 1 << 20, MaxChunk: 4000}
	errs := make(chan error, 3)
	go func() { errs <- there.WriteAndClose(farA) }()
	go func() { errs <- back.WriteAndClose(farB) }()
	go func() { errs <- back.Check(farA, true) }()
	if err := there.Check(farB, true); err != nil {
		t.Fatal(err)
	}
	for range 3 {
		if err := <-errs; err != nil {
			t.Fatal(err)
		}
	}
	rest, err := run.wait()
	if err != nil {
		t.Fatalf("exit: %v (%q)", err, rest)
	}
	want := fmt.Sprintf("splice: both sides closed; %d bytes fd %d -> fd %d, %d bytes back", there.Size, h.fdA, h.fdB, back.Size)
	if len(rest) != 1 || !strings.HasPrefix(rest[0], want) {
		t.Fatalf("summary %q, want %q...", rest, want)
	}
}

func TestSpliceErrors(t *testing.T) {
	testenv.RequireRoot(t)
	h, _, _ := mustHeld(t)
	pid := fmt.Sprint(h.cmd.Process.Pid)
	a := fmt.Sprint(h.fdA)
	for _, tc := range []struct {
		name string
		args []string
		code int
		want string
	}{
		{"one-fd", []string{"--pid", pid, "--fd", a}, 2, "exactly two --fd"},
		{"same-fd", []string{"--pid", pid, "--fd", a, "--fd", a}, 2, "twice"},
		{"no-process", []string{"--pid", "999999999", "--fd", "3", "--fd", "4"}, 1, "no process 999999999"},
		{"no-such-fd", []string{"--pid", pid, "--fd", a, "--fd", "999"}, 1, "has no descriptor 999"},
		{"not-a-socket", []string{"--pid", pid, "--fd", "0", "--fd", a}, 1, "descriptor 0 of process " + pid + ": is not a socket"},
	} {
		t.Run(tc.name, func(t *testing.T) {
			_, stderr, code := runShunt(t, nil, append([]string{"splice"}, tc.args...)...)
			if code != tc.code {
				t.Errorf("exit %d, want %d (%s)", code, tc.code, stderr)
			}
			oneLine(t, stderr, tc.want)
		})
	}
}

// A process we may not ptrace: shunt runs as root but without
// CAP_SYS_PTRACE, and the holder (root, with it) is beyond its reach. One
// line that says what is missing, and the holder's sockets untouched.
func TestSpliceNoPtraceRights(t *testing.T) {
	testenv.RequireRoot(t)
	h, farA, farB := mustHeld(t)
	bin := shuntBinary(t)
	cmd := exec.Command("setpriv", "--inh-caps=-sys_ptrace", "--bounding-set=-sys_ptrace",
		bin, "splice", "--pid", fmt.Sprint(h.cmd.Process.Pid), "--fd", fmt.Sprint(h.fdA), "--fd", fmt.Sprint(h.fdB))
	cmd.Env = append(os.Environ(), "SHUNT_TEST_MAIN=1")
	out, code := combined(cmd)
	if code != 1 {
		t.Errorf("exit %d, want 1 (%s)", code, out)
	}
	oneLine(t, out, fmt.Sprintf("not allowed to take descriptors of process %d (needs ptrace rights", h.cmd.Process.Pid))
	// Still the holder's: nothing was joined, so a byte from one far end
	// waits for the holder instead of reaching the other.
	farA.Write([]byte("x"))
	farB.SetReadDeadline(time.Now().Add(100 * time.Millisecond))
	if n, _ := farB.Read(make([]byte, 1)); n != 0 {
		t.Errorf("a byte crossed from one far end to the other: the sockets were joined")
	}
}

// TestSpliceUDPCommand joins two connected UDP sockets of a running process:
// datagrams cross both ways whole until the command is interrupted, which
// then reports what moved.
func TestSpliceUDPCommand(t *testing.T) {
	testenv.RequireRoot(t)
	ns := testenv.MustNetNS(t)
	var farA, farB *net.UDPConn
	ns.Do(t, func() {
		var err error
		if farA, err = net.ListenUDP("udp", &net.UDPAddr{IP: net.IPv4(127, 0, 0, 1)}); err == nil {
			farB, err = net.ListenUDP("udp", &net.UDPAddr{IP: net.IPv4(127, 0, 0, 1)})
		}
		if err != nil {
			t.Fatal(err)
		}
	})
	defer farA.Close()
	defer farB.Close()
	script := fmt.Sprintf(`import socket, sys
a = socket.socket(socket.AF_INET, socket.SOCK_DGRAM); a.connect(("127.0.0.1", %d))
b = socket.socket(socket.AF_INET, socket.SOCK_DGRAM); b.connect(("127.0.0.1", %d))
print(a.fileno(), b.fileno(), a.getsockname()[1], b.getsockname()[1], flush=True)
sys.stdin.read()`, farA.LocalAddr().(*net.UDPAddr).Port, farB.LocalAddr().(*net.UDPAddr).Port)
	cmd := exec.Command("ip", "netns", "exec", ns.Name, "python3", "-c", script)
	stdin, _ := cmd.StdinPipe()
	out, _ := cmd.StdoutPipe()
	if err := cmd.Start(); err != nil {
		t.Fatal(err)
	}
	defer func() { stdin.Close(); cmd.Wait() }()
	var fdA, fdB, portA, portB int
	if _, err := fmt.Fscan(out, &fdA, &fdB, &portA, &portB); err != nil {
		t.Fatalf("holder: %v", err)
	}
	run := startShunt(t, nil, "splice: joined UDP fd", "splice", "--pid", fmt.Sprint(cmd.Process.Pid), "--fd", fmt.Sprint(fdA), "--fd", fmt.Sprint(fdB))
	toA := &net.UDPAddr{IP: net.IPv4(127, 0, 0, 1), Port: portA}
	toB := &net.UDPAddr{IP: net.IPv4(127, 0, 0, 1), Port: portB}
	buf := make([]byte, 1<<16)
	for i := 0; i < 20; i++ {
		msg := bytes.Repeat([]byte{byte(i)}, 1+i*3000)
		from, to, dst := farA, farB, toA
		if i%2 == 1 {
			from, to, dst = farB, farA, toB
		}
		if _, err := from.WriteToUDP(msg, dst); err != nil {
			t.Fatal(err)
		}
		to.SetReadDeadline(time.Now().Add(5 * time.Second))
		n, err := to.Read(buf)
		if err != nil || !bytes.Equal(buf[:n], msg) {
			t.Fatalf("datagram %d: got %d bytes (%v), want %d intact", i, n, err, len(msg))
		}
	}
	run.cmd.Process.Signal(syscall.SIGINT)
	rest, err := run.wait()
	if err != nil {
		t.Fatalf("exit: %v (%q)", err, rest)
	}
	want := "splice: interrupted; 10 datagrams"
	if len(rest) != 1 || !strings.HasPrefix(rest[0], want) || !strings.Contains(rest[0], "10 (") {
		t.Fatalf("summary %q, want %q...", rest, want)
	}
}
