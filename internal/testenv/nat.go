package testenv

import (
	"net"
	"net/netip"
	"os/exec"
	"strings"
	"syscall"
	"testing"
	"unsafe"

	"golang.org/x/sys/unix"
)

// Nft loads an nftables ruleset into the namespace; the namespace's end
// removes it. nsenter, not ip netns exec: that one mounts a /sys of its
// own, with no cgroup hierarchy in it for nft to resolve cgroup paths in.
func (n *NetNS) Nft(t testing.TB, rules string) {
	t.Helper()
	cmd := exec.Command("nsenter", "--net=/run/netns/"+n.Name, "nft", "-f", "-")
	cmd.Stdin = strings.NewReader(rules)
	if out, err := cmd.CombinedOutput(); err != nil {
		t.Fatalf("nft in %s: %v: %s\n%s", n.Name, err, out, rules)
	}
}

// OriginalDst reads SO_ORIGINAL_DST (IP6T_SO_ORIGINAL_DST for IPv6) of an
// accepted connection: where its client dialled, as the conntrack of the
// connection's own namespace kept it before translation (what a sidecar
// reads). ENOENT where that namespace translated nothing.
func OriginalDst(c *net.TCPConn) (netip.AddrPort, error) {
	raw, err := c.SyscallConn()
	if err != nil {
		return netip.AddrPort{}, err
	}
	v4 := c.LocalAddr().(*net.TCPAddr).IP.To4() != nil
	level := unix.SOL_IPV6
	if v4 {
		level = unix.SOL_IP
	}
	const soOriginalDst = 80 // SO_ORIGINAL_DST, IP6T_SO_ORIGINAL_DST
	var sa [28]byte          // a sockaddr_in6, or a sockaddr_in at its start
	var errno syscall.Errno
	cerr := raw.Control(func(fd uintptr) {
		l := uint32(len(sa))
		_, _, errno = unix.Syscall6(unix.SYS_GETSOCKOPT, fd, uintptr(level), soOriginalDst,
			uintptr(unsafe.Pointer(&sa[0])), uintptr(unsafe.Pointer(&l)), 0)
	})
	if cerr != nil {
		return netip.AddrPort{}, cerr
	}
	if errno != 0 {
		return netip.AddrPort{}, errno
	}
	port := uint16(sa[2])<<8 | uint16(sa[3])
	if v4 {
		return netip.AddrPortFrom(netip.AddrFrom4([4]byte(sa[4:8])), port), nil
	}
	return netip.AddrPortFrom(netip.AddrFrom16([16]byte(sa[8:24])), port), nil
}
