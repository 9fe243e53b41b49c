package bypass

import (
	"io"
	"testing"

	"github.com/cilium/ebpf"
	"github.com/cilium/ebpf/link"
	"golang.org/x/sys/unix"

	"github.com/shunt-project/shunt/host"
	"github.com/shunt-project/shunt/internal/testenv"
)

// What the send watch (tp_btf/sock_send_length) costs every send of the
// host, shunt's sockets or not: a send on an AF_UNIX pair (and the read
// that empties it), and one that fails with EAGAIN on a full pair, with the
// program detached and attached. docs/BENCHMARKS.md quotes it:
//
//	go test -run '^$' -bench BenchmarkSendWatch -count 5 ./bypass
func BenchmarkSendWatch(b *testing.B) {
	testenv.RequireRoot(b)
	if !host.Probe().SendTracepoint {
		b.Skip("no sock_send_length tracepoint (kernels before 6.3)")
	}
	spec, err := loadBypass()
	if err != nil {
		b.Fatal(err)
	}
	var objs struct {
		Sends *ebpf.Program `ebpf:"shunt_sends"`
	}
	if err := spec.LoadAndAssign(&objs, nil); err != nil {
		b.Fatal(err)
	}
	defer objs.Sends.Close()
	pair := func(b *testing.B) [2]int {
		fds, err := unix.Socketpair(unix.AF_UNIX, unix.SOCK_DGRAM|unix.SOCK_NONBLOCK, 0)
		if err != nil {
			b.Fatal(err)
		}
		b.Cleanup(func() { unix.Close(fds[0]); unix.Close(fds[1]) })
		return fds
	}
	one := []byte{1}
	buf := make([]byte, 16)
	calls := map[string]func(b *testing.B) func(){
		"send": func(b *testing.B) func() {
			fds := pair(b)
			return func() { _, _ = unix.Write(fds[0], one); _, _ = unix.Read(fds[1], buf) }
		},
		"send_eagain": func(b *testing.B) func() {
			fds := pair(b)
			for {
				if _, err := unix.Write(fds[0], one); err != nil {
					break
				}
			}
			return func() { _, _ = unix.Write(fds[0], one) }
		},
	}
	testenv.BenchDetachedAttached(b, []string{"send", "send_eagain"}, func(b *testing.B) io.Closer {
		l, err := link.AttachTracing(link.TracingOptions{Program: objs.Sends})
		if err != nil {
			b.Fatal(err)
		}
		return l
	}, func(b *testing.B, call string) func() { return calls[call](b) })
}
