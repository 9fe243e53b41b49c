package bench

import (
	"bufio"
	"fmt"
	"io"
	"os"
	"os/exec"
	"path/filepath"
	"strconv"
	"strings"

	"golang.org/x/sys/unix"

	"github.com/shunt-project/shunt/host"
)

// A process may hold only RLIMIT_NOFILE sockets, and without
// CAP_SYS_RESOURCE the hard limit cannot be raised (20,000 on these VMs).
// A million sockets therefore live in helper processes: shunt re-executes
// itself with holderEnv set, makes its share of sockets and holds them until
// its stdin closes.
const holderEnv = "SHUNT_BENCH_REAP_HOLDER"

// holderChunk is how many sockets one helper holds.
const holderChunk = 15000

// MaybeRunReapHolder turns this process into a socket holder if it was
// started as one; it never returns then.
func MaybeRunReapHolder() {
	spec := os.Getenv(holderEnv)
	if spec == "" {
		return
	}
	if err := runHolder(spec); err != nil {
		fmt.Fprintln(os.Stdout, "error:", err)
		os.Exit(1)
	}
	os.Exit(0)
}

// spec: proto;port;cgroup-path;netns=count,netns=count...
func runHolder(spec string) error {
	parts := strings.SplitN(spec, ";", 4)
	if len(parts) != 4 {
		return fmt.Errorf("bad holder spec %q", spec)
	}
	port, _ := strconv.Atoi(parts[1])
	typ := unix.SOCK_DGRAM
	if parts[0] == "tcp" {
		typ = unix.SOCK_STREAM
	}
	if err := os.WriteFile(filepath.Join(parts[2], "cgroup.procs"), []byte(strconv.Itoa(os.Getpid())), 0); err != nil {
		return err
	}
	for _, nc := range strings.Split(parts[3], ",") {
		path, cnt, _ := strings.Cut(nc, "=")
		n, _ := strconv.Atoi(cnt)
		err := host.InNetns(path, func() error {
			for i := 0; i < n; i++ {
				fd, err := unix.Socket(unix.AF_INET, typ|unix.SOCK_CLOEXEC, 0)
				if err != nil {
					return err
				}
				if err := unix.Connect(fd, &unix.SockaddrInet4{Port: port, Addr: [4]byte{127, 0, 0, 1}}); err != nil {
					return err
				}
			}
			return nil
		})
		if err != nil {
			return err
		}
	}
	fmt.Fprintln(os.Stdout, "ready")
	_, _ = io.Copy(io.Discard, os.Stdin)
	return nil
}

// holder is a running helper process.
type holder struct {
	cmd   *exec.Cmd
	stdin io.WriteCloser
}

func startHolder(spec string) (*holder, error) {
	self, err := os.Executable()
	if err != nil {
		return nil, err
	}
	cmd := exec.Command(self)
	cmd.Env = append(os.Environ(), holderEnv+"="+spec)
	stdin, err := cmd.StdinPipe()
	if err != nil {
		return nil, err
	}
	stdout, err := cmd.StdoutPipe()
	if err != nil {
		return nil, err
	}
	if err := cmd.Start(); err != nil {
		return nil, err
	}
	h := &holder{cmd: cmd, stdin: stdin}
	line, _ := bufio.NewReader(stdout).ReadString('\n')
	if strings.TrimSpace(line) != "ready" {
		h.stop()
		return nil, fmt.Errorf("socket holder: %s", strings.TrimSpace(line))
	}
	return h, nil
}

func (h *holder) stop() {
	h.stdin.Close()
	_ = h.cmd.Wait()
}

// HoldConnections connects n sockets (proto "tcp" or "udp") to
// 127.0.0.1:port from helper processes in the cgroup at cgroupPath and the
// network namespace named netns, and holds them until stop: more sockets
// than one process may open. A test binary that uses it calls
// MaybeRunReapHolder first thing in TestMain.
func HoldConnections(proto string, port int, cgroupPath, netns string, n int) (stop func(), err error) {
	var hs []*holder
	stop = func() {
		for _, h := range hs {
			h.stop()
		}
	}
	for held := 0; held < n; {
		chunk := min(n-held, holderChunk)
		h, err := startHolder(fmt.Sprintf("%s;%d;%s;/run/netns/%s=%d", proto, port, cgroupPath, netns, chunk))
		if err != nil {
			stop()
			return nil, err
		}
		hs = append(hs, h)
		held += chunk
	}
	return stop, nil
}
