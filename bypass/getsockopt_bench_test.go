package bypass

import (
	"io"
	"testing"

	"github.com/cilium/ebpf"
	"github.com/cilium/ebpf/link"
	"golang.org/x/sys/unix"

	"github.com/shunt-project/shunt/internal/testenv"
)

// BenchmarkGetsockoptHook: what the getsockopt program on enabled cgroups
// costs a getsockopt of their sockets that is not TCP_ZEROCOPY_RECEIVE:
// TCP_INFO (a 232-byte answer) and SO_ERROR on a connected TCP socket of
// the cgroup, with the program detached and attached. With it attached the
// kernel copies the answer in and out of its buffer and takes the socket
// lock to run the program; the program itself returns at its first test.
// Run with -count to interleave the modes.
func BenchmarkGetsockoptHook(b *testing.B) {
	testenv.RequireRoot(b)
	spec, err := loadBypass()
	if err != nil {
		b.Fatal(err)
	}
	var objs struct {
		Getsockopt *ebpf.Program `ebpf:"shunt_getsockopt"`
	}
	if err := spec.LoadAndAssign(&objs, nil); err != nil {
		b.Fatal(err)
	}
	defer objs.Getsockopt.Close()
	side := testenv.Side{NS: testenv.MustNetNS(b), CG: testenv.MustCgroup(b)}
	c, _ := testenv.ConnPair(b, "tcp4", side, "127.0.0.1:0", side, "127.0.0.1:0")
	raw, err := c.SyscallConn()
	if err != nil {
		b.Fatal(err)
	}
	var fd int
	raw.Control(func(f uintptr) { fd = int(f) })
	calls := map[string]func(){
		"TCP_INFO": func() { _, _ = unix.GetsockoptTCPInfo(fd, unix.SOL_TCP, unix.TCP_INFO) },
		"SO_ERROR": func() { _, _ = unix.GetsockoptInt(fd, unix.SOL_SOCKET, unix.SO_ERROR) },
	}
	testenv.BenchDetachedAttached(b, []string{"TCP_INFO", "SO_ERROR"}, func(b *testing.B) io.Closer {
		l, err := link.AttachCgroup(link.CgroupOptions{Path: side.CG.Path, Attach: ebpf.AttachCGroupGetsockopt, Program: objs.Getsockopt})
		if err != nil {
			b.Fatal(err)
		}
		return l
	}, func(b *testing.B, call string) func() { return calls[call] })
}
