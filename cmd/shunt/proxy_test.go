package main

import (
	"fmt"
	"io"
	"net"
	"os"
	"path/filepath"
	"strings"
	"syscall"
	"testing"
	"time"

	"github.com/shunt-project/shunt/bypass"
	"github.com/shunt-project/shunt/bypass/bypasstest"
	"github.com/shunt-project/shunt/host"
	"github.com/shunt-project/shunt/internal/testenv"
)

// TestProxyCommand runs `shunt proxy` in a namespace against an echo
// upstream: the reply comes back through the kernel, SIGINT ends it with
// exit 0 and a summary.
func TestProxyCommand(t *testing.T) {
	testenv.RequireRoot(t)
	ns := testenv.MustNetNS(t)
	run := startShunt(t, ns, "listening on 127.0.0.1:17000, mode kernel", "proxy",
		"--listen", "127.0.0.1:17000", "--upstream", echoUpstream(t, testenv.Side{NS: ns}))
	idle := openFDs(t, run.cmd.Process.Pid)
	c := testenv.Dial(t, testenv.Side{NS: ns}, "tcp", "127.0.0.1:17000", nil)
	stream := testenv.Stream{Seed: 21, Size: 8 << 20, MaxChunk: 50000}
	if err := stream.Through(c, c); err != nil {
		t.Fatal(err)
	}
	rest := stopProxy(t, run, idle)
	if len(rest) == 0 || !strings.Contains(rest[len(rest)-1], "stopped after 1 connections (0 refused, 0 failed); 8388608 bytes up, 8388608 down") {
		t.Fatalf("summary %q", rest)
	}
}

// stopProxy waits until the proxy has closed a connection's sockets (it
// counts a connection when it ends), interrupts it and returns the lines it
// printed after the ones read so far; it must exit 0.
func stopProxy(t *testing.T, run *running, idle int) []string {
	t.Helper()
	for deadline := time.Now().Add(10 * time.Second); openFDs(t, run.cmd.Process.Pid) > idle; time.Sleep(10 * time.Millisecond) {
		if time.Now().After(deadline) {
			t.Fatal("the proxy still holds the connection's sockets 10 s after it ended")
		}
	}
	run.cmd.Process.Signal(syscall.SIGINT)
	rest, err := run.wait()
	if err != nil {
		t.Fatalf("exit: %v (%q)", err, rest)
	}
	return rest
}

// echoUpstream serves an echo on a port made by side; it returns the address.
func echoUpstream(t *testing.T, side testenv.Side) string {
	ln := testenv.Listen(t, side, "tcp", "127.0.0.1:0")
	testenv.EchoServer(ln)
	return ln.Addr().String()
}

func TestProxyErrors(t *testing.T) {
	testenv.RequireRoot(t)
	bin := shuntBinary(t)
	for _, tc := range []struct {
		name string
		args []string
		code int
		want string
	}{
		{"no-upstream", []string{"proxy", "--listen", "127.0.0.1:0"}, 2, "--listen and --upstream are required"},
		{"bad-listen", []string{"proxy", "--listen", "localhost:80", "--upstream", "127.0.0.1:1"}, 2, `--listen: address "localhost:80": want IP:PORT`},
		{"bad-upstream", []string{"proxy", "--listen", "127.0.0.1:0", "--upstream", "127.0.0.1:1,nope"}, 2, `--upstream: address "nope"`},
		{"bad-mode", []string{"proxy", "--listen", "127.0.0.1:0", "--upstream", "127.0.0.1:1", "--mode", "fast"}, 2, "--mode: unknown mode"},
		{"bad-route", []string{"proxy", "--listen", "127.0.0.1:0", "--upstream", "127.0.0.1:1", "--route", "a.example"}, 2, "want HOST=ADDR:PORT"},
		{"bad-proxy-protocol", []string{"proxy", "--listen", "127.0.0.1:0", "--upstream", "127.0.0.1:1", "--proxy-protocol", "v3"}, 2, "unknown PROXY protocol version"},
		{"unspecified-upstream", []string{"proxy", "--listen", "127.0.0.1:0", "--upstream", "0.0.0.0:80"}, 1, "want a concrete address"},
		{"listen-not-permitted", []string{"proxy", "--listen", "127.0.0.1:1", "--upstream", "127.0.0.1:2", "--mode", "copy"}, 1, "listen on 127.0.0.1:1"},
		{"udp-pipe", []string{"proxy", "--udp", "--listen", "127.0.0.1:0", "--upstream", "127.0.0.1:2", "--mode", "pipe"}, 1, "use kernel or copy mode with UDP"},
		{"old-splice-mode", []string{"proxy", "--listen", "127.0.0.1:0", "--upstream", "127.0.0.1:2", "--mode", "splice"}, 2, "is --mode pipe"},
		{"udp-idle", []string{"proxy", "--udp", "--listen", "127.0.0.1:0", "--upstream", "127.0.0.1:2", "--idle", "0s"}, 2, "--idle: want a positive duration"},
		{"bad-metrics-addr", []string{"proxy", "--listen", "127.0.0.1:0", "--upstream", "127.0.0.1:2", "--metrics-addr", "9464"}, 2, `--metrics-addr "9464": want HOST:PORT`},
		{"metrics-addr-taken", []string{"proxy", "--listen", "127.0.0.1:0", "--upstream", "127.0.0.1:2", "--mode", "copy", "--metrics-addr", "127.0.0.1:1"}, 1, "--metrics-addr: listen tcp 127.0.0.1:1"},
	} {
		t.Run(tc.name, func(t *testing.T) {
			cmd := subprocess(bin, tc.args...)
			if tc.name == "listen-not-permitted" || tc.name == "metrics-addr-taken" {
				// Port 1 needs privileges we drop below.
				cmd.SysProcAttr = &syscall.SysProcAttr{Credential: &syscall.Credential{Uid: 65534, Gid: 65534}}
			}
			out, code := combined(cmd)
			if code != tc.code {
				t.Errorf("exit %d, want %d (%s)", code, tc.code, out)
			}
			oneLine(t, out, tc.want)
		})
	}
	t.Run("kernel-mode-not-root", func(t *testing.T) {
		cmd := subprocess(bin, "proxy", "--listen", "127.0.0.1:0", "--upstream", "127.0.0.1:1")
		cmd.SysProcAttr = &syscall.SysProcAttr{Credential: &syscall.Credential{Uid: 65534, Gid: 65534}}
		out, code := combined(cmd)
		if code != 1 {
			t.Errorf("exit %d, want 1", code)
		}
		oneLine(t, out, "run shunt as root")
	})
}

// TestProxyUDPCommand: `shunt proxy --udp` answers a client through its
// upstream and reports the flow when interrupted.
func TestProxyUDPCommand(t *testing.T) {
	testenv.RequireRoot(t)
	ns := testenv.MustNetNS(t)
	var echo *net.UDPConn
	ns.Do(t, func() {
		var err error
		if echo, err = net.ListenUDP("udp", &net.UDPAddr{IP: net.IPv4(127, 0, 0, 1)}); err != nil {
			t.Fatal(err)
		}
	})
	defer echo.Close()
	go func() {
		buf := make([]byte, 2048)
		for {
			n, from, err := echo.ReadFromUDPAddrPort(buf)
			if err != nil {
				return
			}
			echo.WriteToUDPAddrPort(buf[:n], from)
		}
	}()
	run := startShunt(t, ns, "listening on udp 127.0.0.1:17002, mode kernel", "proxy", "--udp",
		"--listen", "127.0.0.1:17002", "--upstream", echo.LocalAddr().String())
	var c *net.UDPConn
	ns.Do(t, func() {
		var err error
		if c, err = net.DialUDP("udp", nil, &net.UDPAddr{IP: net.IPv4(127, 0, 0, 1), Port: 17002}); err != nil {
			t.Fatal(err)
		}
	})
	defer c.Close()
	buf := make([]byte, 2048)
	for i := 0; i < 10; i++ {
		msg := strings.Repeat("u", 100+i)
		c.Write([]byte(msg))
		c.SetReadDeadline(time.Now().Add(5 * time.Second))
		if n, err := c.Read(buf); err != nil || string(buf[:n]) != msg {
			t.Fatalf("datagram %d: %q, %v", i, buf[:n], err)
		}
	}
	run.cmd.Process.Signal(syscall.SIGINT)
	rest, err := run.wait()
	if err != nil {
		t.Fatalf("exit: %v (%q)", err, rest)
	}
	if len(rest) == 0 || !strings.Contains(rest[len(rest)-1], "stopped after 1 UDP flows (0 refused, 0 upstream refusals); 10 datagrams up, 10 down") {
		t.Fatalf("summary %q", rest)
	}
}

// openFDs counts a process's open file descriptors.
func openFDs(t *testing.T, pid int) int {
	t.Helper()
	ents, err := os.ReadDir(fmt.Sprintf("/proc/%d/fd", pid))
	if err != nil {
		t.Fatal(err)
	}
	return len(ents)
}

// With bypass installed at --pin-dir and the client, the proxy and the
// upstream in the cgroup it is enabled for, `shunt proxy` says it passes the
// join by, the stream comes back whole, and its summary counts the bytes
// that went straight between client and upstream. With --shortcuts=false
// the join carries (and counts) every byte.
func TestProxyCommandPassesTheJoinBy(t *testing.T) {
	testenv.RequireRoot(t)
	in, cg := bypasstest.MustEnabled(t, bypass.Options{NoProbation: true}) // client and upstream: this process, past its probation
	pin := in.Dir()
	ns := testenv.MustNetNS(t)
	side := testenv.Side{NS: ns, CG: cg}
	upstream := echoUpstream(t, side)
	for i, shortcuts := range []bool{true, false} {
		t.Run(fmt.Sprintf("shortcuts=%v", shortcuts), func(t *testing.T) {
			listen := fmt.Sprintf("127.0.0.1:%d", 17001+i)
			first, next := "bypass is installed at "+pin, "listening on "+listen
			if !shortcuts {
				first, next = next, ""
			}
			var run *running
			testenv.InCgroup(t, cg, func() {
				run = startShunt(t, ns, first, "proxy", "--pin-dir", pin,
					"--listen", listen, "--upstream", upstream, fmt.Sprintf("--shortcuts=%v", shortcuts))
			})
			if next != "" && (!run.lines.Scan() || !strings.Contains(run.lines.Text(), next)) {
				t.Fatalf("then %q", run.lines.Text())
			}
			idle := openFDs(t, run.cmd.Process.Pid)
			c := testenv.Dial(t, side, "tcp", listen, nil)
			// A round trip first, and a pause: the join starts in user space and
			// hands each direction to the kernel once it has run dry, and both
			// readers are seen in recv (bypass redirects to no other).
			for range 3 {
				if _, err := c.Write([]byte{'w'}); err != nil {
					t.Fatal(err)
				}
				if _, err := io.ReadFull(c, make([]byte, 1)); err != nil {
					t.Fatal(err)
				}
				time.Sleep(50 * time.Millisecond)
			}
			stream := testenv.Stream{Seed: 22, Size: 8 << 20, MaxChunk: 50000}
			if err := stream.Through(c, c); err != nil {
				// What the proxy said of it (it logs why a pair failed).
				run.cmd.Process.Signal(syscall.SIGINT)
				rest, _ := run.wait()
				t.Fatalf("%v; the proxy said %q", err, rest)
			}
			rest := stopProxy(t, run, idle)
			last := ""
			if len(rest) > 0 {
				last = rest[len(rest)-1]
			}
			// The join's own counts are the totals less what passed it by:
			// whole here means no byte went round it uncounted.
			i := strings.Index(last, "down, ")
			if i < 0 || !strings.Contains(last, "8388611 bytes up, 8388611 down") {
				t.Fatalf("summary %q", rest)
			}
			if !shortcuts {
				if strings.Contains(last, "straight") {
					t.Fatalf("summary %q: shortcuts counted with --shortcuts=false", last)
				}
				return
			}
			var kernel, passed int64
			if !strings.Contains(last, "on 1 connections with both legs paired") {
				t.Fatalf("summary %q", rest)
			}
			if _, err := fmt.Sscanf(last[i:], "down, %d of them moved by the kernel (%d straight", &kernel, &passed); err != nil || passed <= 0 {
				t.Fatalf("summary %q: no byte passed the join by (%v)", last, err)
			}
		})
	}
}

// An install made before shortcuts (no shortcuts map) still runs the proxy,
// and `shunt proxy` says once what to do to get them; so it does where it
// cannot see bpffs at all.
func TestProxyShortcutsNeedANewerInstall(t *testing.T) {
	testenv.RequireRoot(t)
	in, _ := bypasstest.MustEnabled(t, bypass.Options{})
	if err := os.Remove(filepath.Join(in.Dir(), "maps", "shortcuts")); err != nil {
		t.Fatal(err)
	}
	got, note, err := openShortcuts(in.Dir())
	if err != nil || got != nil {
		t.Fatalf("openShortcuts of an old install: %v, %v", got, err)
	}
	if !strings.Contains(note, "installed by an older shunt") || !strings.Contains(note, "disable --all and enable again") {
		t.Errorf("note %q", note)
	}
	got, note, err = openShortcuts(filepath.Join(host.BPFFSRoot, "shunt-test-none"))
	if err != nil || got != nil || note != "" {
		t.Errorf("openShortcuts without an install: %v, %q, %v; want nothing and no note", got, note, err)
	}
	// What a proxy started by 'ip netns exec' sees.
	got, note, err = openShortcuts(filepath.Join(t.TempDir(), "shunt"))
	if err != nil || got != nil || !strings.Contains(note, "no bpffs at") {
		t.Errorf("openShortcuts off bpffs: %v, %q, %v; want nothing and a note", got, note, err)
	}
}
