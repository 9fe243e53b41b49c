package main

import (
	"encoding/json"
	"net"
	"os"
	"path/filepath"
	"strings"
	"syscall"
	"testing"
	"time"

	"github.com/shunt-project/shunt/fanout"
	"github.com/shunt-project/shunt/internal/testenv"
)

func TestFanoutCommand(t *testing.T) {
	for _, path := range []string{"batch", "zerocopy", "kernel"} {
		t.Run(path, func(t *testing.T) { testFanoutCommand(t, path) })
	}
}

func testFanoutCommand(t *testing.T, path string) {
	testenv.RequireRoot(t)
	ns := testenv.MustNetNS(t)
	ctl := filepath.Join(t.TempDir(), "fanout.sock")
	run := startShunt(t, ns, "relaying udp://127.0.0.1:15000", "fanout", "--path", path,
		"--source", "udp://127.0.0.1:15000", "--listen", "tcp://127.0.0.1:16000", "--framing", "u32", "--control", ctl)
	cmd := run.cmd
	var err error

	var sub net.Conn
	ns.Do(t, func() { sub, err = net.Dial("tcp", "127.0.0.1:16000") })
	if err != nil {
		t.Fatal(err)
	}
	defer sub.Close()
	for deadline := time.Now().Add(5 * time.Second); ; {
		if st, err := fanout.Query(ctl); err == nil && st.Totals.Subscribers == 1 {
			break
		}
		if time.Now().After(deadline) {
			t.Fatal("the subscriber never showed up in stats")
		}
		time.Sleep(10 * time.Millisecond)
	}
	sendDatagram(t, ns, "127.0.0.1:15000", "tick")
	sub.SetReadDeadline(time.Now().Add(5 * time.Second))
	got := make([]byte, 8)
	if _, err := sub.Read(got); err != nil || string(got) != "\x00\x00\x00\x04tick" {
		t.Fatalf("subscriber read %q, %v", got, err)
	}

	out, _, code := runShunt(t, nil, "fanout", "stats", "--control", ctl, "--json")
	var st fanout.Stats
	if code != 0 || json.Unmarshal([]byte(out), &st) != nil || len(st.Subscribers) != 1 || st.Subscribers[0].Messages != 1 || st.Totals.Received != 1 {
		t.Errorf("stats --json: exit %d, %s", code, out)
	}
	out, _, _ = runShunt(t, nil, "fanout", "stats", "--control", ctl)
	if !strings.Contains(out, sub.LocalAddr().String()) {
		t.Errorf("stats table lacks the subscriber: %q", out)
	}

	cmd.Process.Signal(syscall.SIGINT)
	if err := cmd.Wait(); err != nil {
		t.Errorf("fanout after SIGINT: %v", err)
	}
	if _, err := os.Stat(ctl); !os.IsNotExist(err) {
		t.Errorf("control socket left behind")
	}
}

// sendDatagram sends msg to addr from inside ns.
func sendDatagram(t *testing.T, ns *testenv.NetNS, addr, msg string) {
	ns.Do(t, func() {
		u, err := net.Dial("udp", addr)
		if err != nil {
			t.Fatal(err)
		}
		u.Write([]byte(msg))
		u.Close()
	})
}

func TestFanoutErrors(t *testing.T) {
	for _, tc := range []struct {
		args []string
		code int
		want string
	}{
		{[]string{"fanout"}, 2, "--source and --listen are required"},
		{[]string{"fanout", "--source", "127.0.0.1:5000", "--listen", "tcp://127.0.0.1:6000"}, 2, "want udp://ADDR:PORT"},
		{[]string{"fanout", "--source", "udp://127.0.0.1:5000", "--listen", "udp://127.0.0.1:6000"}, 2, "want tcp://ADDR:PORT"},
		{[]string{"fanout", "--source", "udp://127.0.0.1:5000", "--listen", "tcp://127.0.0.1:6000", "--framing", "u8"}, 2, "want none, u16 or u32"},
		{[]string{"fanout", "--source", "udp://127.0.0.1:5000", "--listen", "tcp://127.0.0.1:6000", "--slow", "wait"}, 2, "want drop or disconnect"},
		{[]string{"fanout", "--source", "udp://127.0.0.1:5000", "--listen", "tcp://127.0.0.1:6000", "--queue", "lots"}, 2, "--queue"},
		{[]string{"fanout", "--source", "udp://127.0.0.1:5000", "--listen", "tcp://127.0.0.1:6000", "--queue", "1K"}, 1, "below one datagram"},
		{[]string{"fanout", "--source", "udp://127.0.0.1:5000", "--listen", "tcp://127.0.0.1:6000", "--path", "teleport"}, 2, "want batch, per-message, uring, kernel or zerocopy"},
		{[]string{"fanout", "stats", "--control", "/nonexistent/fanout.sock"}, 1, "no forwarder answers"},
		{[]string{"fanout", "--source", "udp://127.0.0.1:5000", "--listen", "tcp://127.0.0.1:6000", "--metrics-addr", "127.0.0.1:9465", "--control", ""}, 2, "--metrics-addr reads the forwarder's counters through --control"},
	} {
		t.Run(strings.Join(tc.args, " "), func(t *testing.T) {
			_, stderr, code := runShunt(t, nil, tc.args...)
			if code != tc.code {
				t.Errorf("exit %d, want %d", code, tc.code)
			}
			oneLine(t, stderr, tc.want)
		})
	}
}
