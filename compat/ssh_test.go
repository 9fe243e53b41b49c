package compat_test

import (
	"errors"
	"fmt"
	"os"
	"os/exec"
	"path/filepath"
	"strings"
	"testing"
	"time"

	"github.com/shunt-project/shunt/internal/testenv"
)

// OpenSSH's port forwarding (ssh -L) in front of nginx: curl to the ssh
// client, the client's tunnel to sshd, sshd to nginx, each a connection
// shunt may pair. sshd stops asking ppoll for a forwarded socket's input
// while its channel's window is full, which the stall watch once took for a
// reader waiting for an edge (2 of 40 10 MiB downloads "rescued" by hand).
// Every download must be intact and no wait of sshd's counted as a stall.
func TestSSHPortForwarding(t *testing.T) {
	testenv.NeedProgram(t, "ssh")
	testenv.NeedProgram(t, "ssh-keygen")
	testenv.NeedProgram(t, "sshd")
	privsep(t)
	body := newBlob(10<<20, 17)
	bothWays(t, eitherPath, 0, func(t *testing.T, e *env) {
		dir := t.TempDir()
		for _, key := range []string{"host", "user"} {
			if out, err := exec.Command("ssh-keygen", "-q", "-t", "ed25519", "-N", "", "-f", filepath.Join(dir, key)).CombinedOutput(); err != nil {
				t.Fatalf("ssh-keygen: %v: %s", err, out)
			}
		}
		pub, err := os.ReadFile(filepath.Join(dir, "user.pub"))
		if err != nil {
			t.Fatal(err)
		}
		writeFile(t, filepath.Join(dir, "authorized_keys"), pub)
		origin := nginxOrigin(t, e, body, true)
		sshPort, fwdPort := e.freePort(t), e.freePort(t)
		// sshd wants its full path to re-execute itself.
		sshd, err := exec.LookPath("sshd")
		if err != nil {
			t.Fatal(err)
		}
		e.start(t, sshd, "-D", "-e", "-p", fmt.Sprint(sshPort), "-o", "ListenAddress=127.0.0.1",
			"-o", "HostKey="+filepath.Join(dir, "host"), "-o", "AuthorizedKeysFile="+filepath.Join(dir, "authorized_keys"),
			"-o", "StrictModes=no", "-o", "PidFile=none")
		e.waitListenSocket(t, sshPort)
		e.start(t, "ssh", "-N", "-i", filepath.Join(dir, "user"), "-p", fmt.Sprint(sshPort),
			"-o", "BatchMode=yes", "-o", "StrictHostKeyChecking=no", "-o", "UserKnownHostsFile=/dev/null",
			"-o", "ExitOnForwardFailure=yes", "-L", fmt.Sprintf("127.0.0.1:%d:%s", fwdPort, origin), "root@127.0.0.1")
		e.waitListenSocket(t, fwdPort)
		addr := fmt.Sprintf("127.0.0.1:%d", fwdPort)
		counts := fetchAll(t, 1, 12, func() (outcome, string) { return e.download(t, addr, body, 20*time.Second) })
		if counts[intact] != 12 {
			t.Errorf("12 downloads through the tunnel: %v", counts)
		}
		for _, line := range e.guardSaid() {
			if strings.Contains(line, "(sshd) waited on") {
				t.Errorf("sshd's wait counted as a stall: %s", line)
			}
		}
	})
}

// privsep makes the directory sshd wants for privilege separation, as its
// package's service would, and removes it after the test if it made it.
func privsep(t *testing.T) {
	const dir = "/run/sshd"
	if _, err := os.Stat(dir); !errors.Is(err, os.ErrNotExist) {
		return
	}
	if err := os.Mkdir(dir, 0o755); err != nil {
		t.Fatal(err)
	}
	t.Cleanup(func() { os.Remove(dir) })
}
