package host

import (
	"os"
	"path/filepath"
	"runtime"

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

// netnsCookie enters the namespace at path on a locked thread just long
// enough to ask a fresh socket for its SO_NETNS_COOKIE.
func netnsCookie(path string) (uint64, bool) {
	fd, err := unix.Open(path, unix.O_RDONLY|unix.O_CLOEXEC, 0)
	if err != nil {
		return 0, false
	}
	defer unix.Close(fd)
	runtime.LockOSThread()
	orig, err := unix.Open("/proc/thread-self/ns/net", unix.O_RDONLY|unix.O_CLOEXEC, 0)
	if err != nil {
		runtime.UnlockOSThread()
		return 0, false
	}
	defer unix.Close(orig)
	if err := unix.Setns(fd, unix.CLONE_NEWNET); err != nil {
		runtime.UnlockOSThread()
		return 0, false
	}
	cookie, ok := uint64(0), false
	if s, err := unix.Socket(unix.AF_INET, unix.SOCK_DGRAM|unix.SOCK_CLOEXEC, 0); err == nil {
		if c, err := unix.GetsockoptUint64(s, unix.SOL_SOCKET, unix.SO_NETNS_COOKIE); err == nil {
			cookie, ok = c, true
		}
		unix.Close(s)
	}
	if unix.Setns(orig, unix.CLONE_NEWNET) == nil {
		// Only a thread back in its own namespace returns to Go's pool.
		runtime.UnlockOSThread()
	}
	return cookie, ok
}
