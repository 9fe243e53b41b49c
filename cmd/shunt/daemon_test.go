package main

import (
	"bufio"
	"encoding/json"
	"io"
	"os/exec"
	"path/filepath"
	"strings"
	"syscall"
	"testing"
	"time"

	"github.com/shunt-project/shunt/daemon"
	"github.com/shunt-project/shunt/internal/testenv"
)

// TestDaemonWithPythonClient runs `shunt daemon` and the example Python
// client: the client hands over its two sockets, bytes flow through the
// kernel, stats list the pair, and the client hears that it ended.
func TestDaemonWithPythonClient(t *testing.T) {
	testenv.RequireRoot(t)
	sock := filepath.Join(t.TempDir(), "shunt.sock")
	run := startShunt(t, nil, "daemon: listening on "+sock, "daemon", "--socket", sock)

	ns := testenv.MustNetNS(t)
	upstream := testenv.Listen(t, testenv.Side{NS: ns}, "tcp", "127.0.0.1:0")
	py := exec.Command("ip", "netns", "exec", ns.Name, "python3", "../../examples/splice_client.py",
		"--socket", sock, "--listen", "127.0.0.1:18000", "--upstream", upstream.Addr().String())
	pyOut, _ := py.StdoutPipe()
	py.Stderr = py.Stdout
	if err := py.Start(); err != nil {
		t.Fatal(err)
	}
	defer py.Process.Kill()
	lines := bufio.NewScanner(pyOut)
	if !lines.Scan() || !strings.HasPrefix(lines.Text(), "listening on") {
		t.Fatalf("client said %q", lines.Text())
	}
	c := testenv.Dial(t, testenv.Side{NS: ns}, "tcp", "127.0.0.1:18000", nil)
	s := testenv.Accept(t, upstream)
	if !lines.Scan() || !strings.HasPrefix(lines.Text(), "joined, handle 1") {
		t.Fatalf("client said %q", lines.Text())
	}
	out, stderr, code := runShunt(t, nil, "daemon", "stats", "--socket", sock, "--json")
	var pairs []daemon.PairInfo
	if code != 0 || json.Unmarshal([]byte(out), &pairs) != nil || len(pairs) != 1 || !pairs[0].InKernel {
		t.Fatalf("stats: exit %d %s %s", code, out, stderr)
	}

	stream := testenv.Stream{Seed: 61, Size: 8 << 20, MaxChunk: 20000}
	if err := stream.Through(c, s); err != nil {
		t.Fatal(err)
	}
	io.WriteString(s, "bye")
	s.CloseWrite()
	if got, err := io.ReadAll(c); err != nil || string(got) != "bye" {
		t.Fatalf("client read %q, %v", got, err)
	}
	if !lines.Scan() {
		t.Fatal("the Python client heard no end")
	}
	var ev daemon.Event
	if err := json.Unmarshal([]byte(lines.Text()), &ev); err != nil || ev.Event != "ended" || ev.BytesAB != uint64(stream.Size) || ev.BytesBA != 3 {
		t.Fatalf("event %q (%v)", lines.Text(), err)
	}
	if err := py.Wait(); err != nil {
		t.Fatalf("python client: %v", err)
	}

	run.cmd.Process.Signal(syscall.SIGINT)
	done := make(chan struct{})
	var rest []string
	var err error
	go func() { rest, err = run.wait(); close(done) }()
	select {
	case <-done:
	case <-time.After(10 * time.Second):
		t.Fatal("daemon did not stop")
	}
	if err != nil || len(rest) == 0 || !strings.Contains(rest[len(rest)-1], "daemon: stopped; 0 pairs reset") {
		t.Fatalf("daemon exit %v, said %q", err, rest)
	}
	if _, _, code := runShunt(t, nil, "daemon", "stats", "--socket", sock); code != 1 {
		t.Fatalf("stats with no daemon: exit %d", code)
	}
}

// TestDaemonTakeOver: `shunt daemon --take-over` replaces a running daemon
// without dropping its pair.
func TestDaemonTakeOver(t *testing.T) {
	testenv.RequireRoot(t)
	sock := filepath.Join(t.TempDir(), "shunt.sock")
	old := startShunt(t, nil, "daemon: listening on "+sock, "daemon", "--socket", sock)
	ns := testenv.MustNetNS(t)
	side := testenv.Side{NS: ns}
	client, front := testenv.ConnPair(t, "tcp4", side, "127.0.0.1:0", side, "127.0.0.1:0")
	back, server := testenv.ConnPair(t, "tcp4", side, "127.0.0.1:0", side, "127.0.0.1:0")
	cl, err := daemon.Dial(sock)
	if err != nil {
		t.Fatal(err)
	}
	if _, err := cl.Join(front, back); err != nil {
		t.Fatal(err)
	}
	cl.Close()
	front.Close()
	back.Close()
	io.WriteString(client, "before ")

	next := startShunt(t, nil, "daemon: took over 1 pairs; listening on "+sock, "daemon", "--socket", sock, "--take-over")
	rest, err := old.wait()
	if err != nil || len(rest) == 0 || !strings.Contains(rest[len(rest)-1], "handed 1 pairs over") {
		t.Fatalf("old daemon: %v, %q", err, rest)
	}
	io.WriteString(client, "and after")
	client.CloseWrite()
	if got, err := io.ReadAll(server); err != nil || string(got) != "before and after" {
		t.Fatalf("server read %q, %v", got, err)
	}
	server.CloseWrite()
	if got, err := io.ReadAll(client); err != nil || len(got) != 0 {
		t.Fatalf("client read %q, %v", got, err)
	}
	// The daemon ends the pair once both directions ended: wait for it.
	for deadline := time.Now().Add(10 * time.Second); ; time.Sleep(10 * time.Millisecond) {
		out, _, _ := runShunt(t, nil, "daemon", "stats", "--socket", sock, "--json")
		if out == "[]\n" {
			break
		}
		if time.Now().After(deadline) {
			t.Fatalf("the pair is still held 10 s after both directions ended: %s", out)
		}
	}
	next.cmd.Process.Signal(syscall.SIGINT)
	if rest, err := next.wait(); err != nil || !strings.Contains(rest[len(rest)-1], "stopped; 0 pairs reset") {
		t.Fatalf("new daemon: %v, %q", err, rest)
	}
}
