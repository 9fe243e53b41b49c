package host

import (
	"fmt"
	"os"
	"path/filepath"
	"runtime"
	"strconv"

	"golang.org/x/sys/unix"
)

// NetnsNames maps network namespace cookies to names people know: "host"
// for the namespace of PID 1, "shunt" for the one shunt runs in if that is
// another (a container), and the names `ip netns` gives under /run/netns.
// Namespaces it cannot enter are left out.
func NetnsNames() map[uint64]string {
	names := map[uint64]string{}
	if c, ok := netnsCookie("/proc/1/ns/net"); ok {
		names[c] = "host"
	}
	if c, ok := netnsCookie("/proc/self/ns/net"); ok {
		if _, taken := names[c]; !taken {
			names[c] = "shunt"
		}
	}
	ents, _ := os.ReadDir("/run/netns")
	for _, e := range ents {
		if c, ok := netnsCookie(filepath.Join("/run/netns", e.Name())); ok {
			if _, taken := names[c]; !taken {
				names[c] = e.Name()
			}
		}
	}
	return names
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
	add("/proc/self/ns/net")
	if ents, err := os.ReadDir("/run/netns"); err == nil {
		for _, e := range ents {
			add(filepath.Join("/run/netns", e.Name()))
		}
	}
	if ents, err := os.ReadDir("/proc"); err == nil {
		for _, e := range ents {
			if _, err := strconv.Atoi(e.Name()); err == nil {
				add(filepath.Join("/proc", e.Name(), "ns/net"))
			}
		}
	}
	return out
}
