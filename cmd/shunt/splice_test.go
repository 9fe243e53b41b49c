package main

import (
	"fmt"
	"net"
	"os"
	"os/exec"
	"strings"
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
	script := fmt.Sprintf(`import socket, sys, time
a = socket.create_connection(("127.0.0.1", %d))
b = socket.create_connection(("127.0.0.1", %d))
print(a.fileno(), b.fileno(), flush=True)
sys.stdin.read()`, portA, portB)
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
