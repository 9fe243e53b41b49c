package main

import (
	"encoding/json"
	"net"
	"os"
	"strings"
	"syscall"
	"testing"

	"github.com/shunt-project/shunt/bypass/bypasstest"
	"github.com/shunt-project/shunt/internal/testenv"
	"github.com/shunt-project/shunt/reap"
)

func TestIndexAndReapEndToEnd(t *testing.T) {
	testenv.RequireRoot(t)
	dir := bypasstest.MustPinDir(t)
	cg := testenv.MustCgroup(t)
	ix := func(args ...string) (string, string, int) {
		return runShunt(t, nil, append(args, "--index-dir", dir)...)
	}

	// The backend: a port of our own, so that the reaps below (which
	// search every namespace of the host, TCP and UDP) touch no other
	// test's sockets. Below the ephemeral range (32768 and up): a socket
	// another test connected elsewhere could otherwise have our port as
	// its peer's, or as its own.
	srv, err := listenUDPBelowEphemeral()
	if err != nil {
		t.Fatal(err)
	}
	defer srv.Close()
	backend := srv.LocalAddr().String()

	// No index: list fails with the fix, reap falls back and says so.
	_, stderr, code := ix("index", "list")
	if code != 1 {
		t.Errorf("index list without an index: exit %d, want 1", code)
	}
	oneLine(t, stderr, "shunt index enable")
	stdout, stderr, code := ix("reap", "--backend", backend)
	if code != 0 || !strings.Contains(stderr, "not enabled") || !strings.Contains(stdout, "no socket connected to "+backend+" (iter") {
		t.Errorf("reap without an index: exit %d, stdout %q, stderr %q", code, stdout, stderr)
	}

	if stdout, stderr, code = ix("index", "enable", "--cgroup", cg.Path); code != 0 {
		t.Fatalf("index enable: exit %d: %s", code, stderr)
	}
	if !strings.Contains(stdout, "index enabled for cgroup "+cg.Path) {
		t.Errorf("index enable said %q", stdout)
	}
	stdout, _, _ = ix("status", "--json")
	var st statusReport
	if err := json.Unmarshal([]byte(stdout), &st); err != nil || st.Index == nil || st.Index.Cgroup != cg.Path || st.Index.Dir != dir {
		t.Errorf("status --json does not show the index: %v %q", err, stdout)
	}

	var c *net.UDPConn
	testenv.InCgroup(t, cg, func() { c, err = net.DialUDP("udp", nil, srv.LocalAddr().(*net.UDPAddr)) })
	if err != nil {
		t.Fatal(err)
	}
	defer c.Close()
	c.Write([]byte("x"))

	if stdout, _, _ = ix("index", "list", "--backend", backend); !strings.Contains(stdout, c.LocalAddr().String()) {
		t.Errorf("index list does not show the socket: %q", stdout)
	}
	stdout, _, code = ix("reap", "--backend", backend, "--dry-run", "--json")
	var res reap.Result
	if err := json.Unmarshal([]byte(stdout), &res); err != nil || code != 0 {
		t.Fatalf("reap --dry-run --json: exit %d, %v: %q", code, err, stdout)
	}
	if len(res.Sockets) != 1 || res.Sockets[0].Destroyed || res.Method != reap.Index {
		t.Errorf("dry run: %+v, want one socket, not destroyed, by index", res)
	}
	if _, err := c.Write([]byte("still alive")); err != nil {
		t.Errorf("a dry run hurt the socket: %v", err)
	}

	stdout, _, code = ix("reap", "--backend", backend)
	if code != 0 || !strings.Contains(stdout, "destroyed 1 sockets connected to "+backend) {
		t.Errorf("reap: exit %d, %q", code, stdout)
	}
	if _, err := c.Read(make([]byte, 8)); !isAborted(err) {
		t.Errorf("read after reap: %v, want ECONNABORTED", err)
	}
	if stdout, _, code = ix("reap", "--backend", backend); code != 0 || !strings.Contains(stdout, "no socket connected") {
		t.Errorf("second reap: exit %d, %q", code, stdout)
	}

	if _, stderr, code = ix("index", "disable"); code != 0 {
		t.Fatalf("index disable: %s", stderr)
	}
	if _, err := os.Stat(dir); !os.IsNotExist(err) {
		t.Errorf("index dir still there after disable")
	}
}

func isAborted(err error) bool {
	var se syscall.Errno
	if oe, ok := err.(*net.OpError); ok {
		if sc, ok := oe.Err.(*os.SyscallError); ok {
			se, _ = sc.Err.(syscall.Errno)
		}
	}
	return se == syscall.ECONNABORTED
}

func TestReapErrors(t *testing.T) {
	testenv.RequireRoot(t)
	for _, tc := range []struct {
		args []string
		code int
		want string
	}{
		{[]string{"reap"}, 2, "--backend is required"},
		{[]string{"reap", "--backend", "example.com"}, 2, "want an IP address"},
		{[]string{"reap", "--backend", "10.0.0.1:0"}, 2, "port 0"},
		{[]string{"reap", "--backend", "10.0.0.1:70000"}, 2, "want an IP address"},
		{[]string{"reap", "--backend", "10.0.0.1", "--proto", "sctp"}, 2, "want tcp, udp or all"},
		{[]string{"reap", "--backend", "10.0.0.1", "--method", "magic"}, 2, "want auto, index or iter"},
		{[]string{"reap", "--backend", "10.0.0.1", "--method", "index", "--index-dir", "/sys/fs/bpf/shunt-test-none"}, 1, "shunt index enable"},
		{[]string{"index", "list", "--backend", "300.1.1.1"}, 2, "want an IP address"},
	} {
		t.Run(strings.Join(tc.args, " "), func(t *testing.T) {
			_, stderr, code := runShunt(t, nil, tc.args...)
			if code != tc.code {
				t.Errorf("exit %d, want %d", code, tc.code)
			}
			oneLine(t, stderr, tc.want)
		})
	}

	t.Run("not-root", func(t *testing.T) {
		cmd := subprocess(shuntBinary(t), "reap", "--backend", "127.0.0.1:9")
		cmd.SysProcAttr = &syscall.SysProcAttr{Credential: &syscall.Credential{Uid: 65534, Gid: 65534}}
		out, code := combined(cmd)
		if code != 1 {
			t.Errorf("exit %d, want 1", code)
		}
		oneLine(t, out, "run shunt as root")
	})
}

// listenUDPBelowEphemeral binds 127.0.0.1 on a free port in 7100-7999, a
// range no other test listens on.
func listenUDPBelowEphemeral() (*net.UDPConn, error) {
	var err error
	for port := 7100; port < 8000; port++ {
		var c *net.UDPConn
		if c, err = net.ListenUDP("udp", &net.UDPAddr{IP: net.IPv4(127, 0, 0, 1), Port: port}); err == nil {
			return c, nil
		}
	}
	return nil, err
}
