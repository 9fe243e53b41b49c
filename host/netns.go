package host

import (
	"fmt"
	"os"
	"path/filepath"
	"runtime"
	"strconv"
	"strings"

	"golang.org/x/sys/unix"
)

// The inodes of the kernel's initial network and PID namespaces
// (PROC_NET_INIT_INO, PROC_PID_INIT_INO in include/linux/proc_ns.h): the
// host's, whichever namespace shunt runs in.
const (
	initNetnsIno = 0xEFFFFFF9
	initPidnsIno = 0xEFFFFFFC
)

// isHostNetns says whether a namespace (by inode) is the host's: the
// initial one, or, on kernels that number it like any other, that of the
// host's PID 1 (a container's PID 1 is not the host's: its PID namespace
// is not the initial one).
func isHostNetns(ino uint64) bool {
	if ino == initNetnsIno {
		return true
	}
	var pidns, netns unix.Stat_t
	return unix.Stat("/proc/1/ns/pid", &pidns) == nil && pidns.Ino == initPidnsIno &&
		unix.Stat("/proc/1/ns/net", &netns) == nil && netns.Ino == ino
}

// NetnsNames maps network namespace cookies to names people know: "host"
// for the kernel's initial namespace, the names `ip netns` gives under
// /run/netns, and otherwise "pid N (comm)" after the first process found
// in it (a container's, say). Namespaces it cannot enter are left out.
func NetnsNames() map[uint64]string {
	names := map[uint64]string{}
	rank := map[uint64]int{}
	for _, ns := range AllNetns() {
		c, ok := netnsCookie(ns.Path)
		if !ok {
			continue
		}
		// A namespace reached by several paths gets its best name.
		name, r := netnsName(ns)
		if _, seen := names[c]; !seen || r < rank[c] {
			names[c], rank[c] = name, r
		}
	}
	return names
}

// netnsName names a namespace and ranks the name (lower is better).
func netnsName(ns Netns) (string, int) {
	if isHostNetns(ns.Ino) {
		return "host", 0
	}
	if dir, name := filepath.Split(ns.Path); dir == "/run/netns/" {
		return name, 1
	}
	// /proc/<pid>/ns/net, or /proc/self/ns/net
	pid := filepath.Base(filepath.Dir(filepath.Dir(ns.Path)))
	if pid == "self" {
		pid = strconv.Itoa(os.Getpid())
	}
	comm, _ := os.ReadFile(filepath.Join("/proc", pid, "comm"))
	return fmt.Sprintf("pid %s (%s)", pid, strings.TrimSpace(string(comm))), 2
}

// netnsCookie asks a fresh socket inside the namespace at path for its
// SO_NETNS_COOKIE.
func netnsCookie(path string) (uint64, bool) {
	var cookie uint64
	err := InNetns(path, func() error {
		var err error
		cookie, err = CurrentNetnsCookie()
		return err
	})
	return cookie, err == nil
}

// CurrentNetnsCookie is the cookie of the calling thread's network namespace.
func CurrentNetnsCookie() (uint64, error) {
	s, err := unix.Socket(unix.AF_INET, unix.SOCK_DGRAM|unix.SOCK_CLOEXEC, 0)
	if err != nil {
		return 0, err
	}
	defer unix.Close(s)
	return unix.GetsockoptUint64(s, unix.SOL_SOCKET, unix.SO_NETNS_COOKIE)
}

// InNetns runs fn on a locked thread inside the network namespace at path.
// Sockets fn creates belong to that namespace and stay usable after.
func InNetns(path string, fn func() error) error {
	fd, err := unix.Open(path, unix.O_RDONLY|unix.O_CLOEXEC, 0)
	if err != nil {
		return fmt.Errorf("open netns %s: %w", path, err)
	}
	defer unix.Close(fd)
	runtime.LockOSThread()
	orig, err := unix.Open("/proc/thread-self/ns/net", unix.O_RDONLY|unix.O_CLOEXEC, 0)
	if err != nil {
		runtime.UnlockOSThread()
		return fmt.Errorf("open own netns: %w", err)
	}
	defer unix.Close(orig)
	if err := unix.Setns(fd, unix.CLONE_NEWNET); err != nil {
		runtime.UnlockOSThread()
		return fmt.Errorf("enter netns %s: %w", path, err)
	}
	ferr := fn()
	if unix.Setns(orig, unix.CLONE_NEWNET) == nil {
		// Only a thread back in its own namespace returns to Go's pool.
		runtime.UnlockOSThread()
	}
	return ferr
}

// Netns is a network namespace reachable through a file.
type Netns struct {
	Path string
	Ino  uint64
}

// AllNetns lists each network namespace of the host once: those bound under
// /run/netns (`ip netns`), then those of running processes. Its cost grows
// with the number of processes, not sockets.
func AllNetns() []Netns {
	var out []Netns
	seen := map[uint64]bool{}
	add := func(path string) {
		var st unix.Stat_t
		if unix.Stat(path, &st) != nil || seen[st.Ino] {
			return
		}
		seen[st.Ino] = true
		out = append(out, Netns{Path: path, Ino: st.Ino})
	}
	if ents, err := os.ReadDir("/run/netns"); err == nil {
		for _, e := range ents {
			add(filepath.Join("/run/netns", e.Name()))
		}
	}
	add("/proc/self/ns/net")
	if ents, err := os.ReadDir("/proc"); err == nil {
		for _, e := range ents {
			if _, err := strconv.Atoi(e.Name()); err == nil {
				add(filepath.Join("/proc", e.Name(), "ns/net"))
			}
		}
	}
	return out
}
