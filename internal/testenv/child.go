package testenv

import (
	"fmt"
	"net"
	"os"
	"os/exec"
	"syscall"
	"testing"

	"golang.org/x/sys/unix"
)

// DialFromChild connects to addr from another process: python3, started in
// side's network namespace and cgroup, connects, hands the socket over
// (SCM_RIGHTS) and exits. It returns the socket and the pid that made it.
func DialFromChild(t testing.TB, side Side, addr *net.TCPAddr) (*net.TCPConn, int) {
	t.Helper()
	pair, err := unix.Socketpair(unix.AF_UNIX, unix.SOCK_STREAM|unix.SOCK_CLOEXEC, 0)
	if err != nil {
		t.Fatal(err)
	}
	mine, theirs := os.NewFile(uintptr(pair[0]), "mine"), os.NewFile(uintptr(pair[1]), "theirs")
	defer mine.Close()
	defer theirs.Close()
	cgf, err := os.Open(side.CG.Path)
	if err != nil {
		t.Fatal(err)
	}
	defer cgf.Close()
	script := fmt.Sprintf(`import socket
s = socket.create_connection((%q, %d))
socket.send_fds(socket.socket(fileno=3), [b"x"], [s.fileno()])`, addr.IP.String(), addr.Port)
	cmd := exec.Command("ip", "netns", "exec", side.NS.Name, "python3", "-c", script)
	cmd.ExtraFiles = []*os.File{theirs}
	cmd.SysProcAttr = &syscall.SysProcAttr{UseCgroupFD: true, CgroupFD: int(cgf.Fd())}
	if out, err := cmd.CombinedOutput(); err != nil {
		t.Fatalf("the connecting process: %v: %s", err, out)
	}
	buf, oob := make([]byte, 1), make([]byte, unix.CmsgSpace(4))
	_, oobn, _, _, err := unix.Recvmsg(int(mine.Fd()), buf, oob, 0)
	if err != nil {
		t.Fatal(err)
	}
	msgs, err := unix.ParseSocketControlMessage(oob[:oobn])
	if err != nil || len(msgs) != 1 {
		t.Fatalf("no descriptor came: %v", err)
	}
	fds, err := unix.ParseUnixRights(&msgs[0])
	if err != nil || len(fds) != 1 {
		t.Fatalf("no descriptor came: %v", err)
	}
	f := os.NewFile(uintptr(fds[0]), "handed")
	c, err := net.FileConn(f)
	f.Close()
	if err != nil {
		t.Fatal(err)
	}
	t.Cleanup(func() { c.Close() })
	return c.(*net.TCPConn), cmd.Process.Pid
}
