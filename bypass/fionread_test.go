package bypass_test

import (
	"context"
	"io"
	"net"
	"slices"
	"testing"

	"github.com/cilium/ebpf"
	"github.com/cilium/ebpf/asm"
	"github.com/cilium/ebpf/link"
	"golang.org/x/sys/unix"

	"github.com/shunt-project/shunt/bypass"
	"github.com/shunt-project/shunt/bypass/bypasstest"
	"github.com/shunt-project/shunt/host"
	"github.com/shunt-project/shunt/internal/testenv"
)

// What attaching a program to the ioctl system call's exit tracepoint costs,
// as the FIONREAD correction does: every system call of the host then takes
// the kernel's slow path (getppid, the cheapest), and each ioctl runs the
// program (FIONREAD of a TCP socket). A stand-in that returns at once is
// attached, so this runs where bpf_probe_write_user is refused too: the
// slow path is the same whatever the program. Run the modes interleaved:
//
//	go test -run '^$' -bench 'SyscallTracepoint' -count 7 ./bypass
func BenchmarkSyscallTracepoint(b *testing.B) {
	testenv.RequireRoot(b)
	if !host.TracefsMounted() {
		if err := host.EnsureTracefs(); err != nil {
			b.Skipf("no tracefs: %v", err)
		}
		b.Cleanup(func() { _ = unix.Unmount(host.TracefsRoot, 0) })
	}
	prog, err := ebpf.NewProgram(&ebpf.ProgramSpec{Type: ebpf.TracePoint, License: "GPL",
		Instructions: asm.Instructions{asm.Mov.Imm(asm.R0, 0), asm.Return()}})
	if err != nil {
		b.Fatal(err)
	}
	defer prog.Close()
	fd := unheldTCPSocket(b)
	calls := map[string]func(){
		"getppid":  func() { unix.Getppid() },
		"fionread": func() { _, _ = unix.IoctlGetInt(fd, unix.SIOCINQ) },
	}
	testenv.BenchDetachedAttached(b, []string{"getppid", "fionread"}, func(b *testing.B) io.Closer {
		l, err := link.Tracepoint("syscalls", "sys_exit_ioctl", prog, nil)
		if err != nil {
			b.Fatal(err)
		}
		return l
	}, func(_ *testing.B, call string) func() { return calls[call] })
}

// What the FIONREAD watch costs where it runs (FIONREAD leaves bytes out and
// cannot be corrected: lockdown): an install with it attached, against
// none. getppid pays the syscall tracepoint's slow path; FIONREAD of a TCP
// socket shunt does not hold runs the program to its psock test. Run the
// modes interleaved, as BenchmarkSyscallTracepoint.
func BenchmarkFIONREADWatch(b *testing.B) {
	testenv.RequireRoot(b)
	f := host.Probe()
	if !f.FionreadMisses() || f.WriteUser {
		b.Skip("the FIONREAD watch runs only where FIONREAD leaves bytes out and cannot be corrected")
	}
	pin := bypasstest.MustPinDir(b)
	fd := unheldTCPSocket(b)
	calls := map[string]func(){
		"getppid":  func() { unix.Getppid() },
		"fionread": func() { _, _ = unix.IoctlGetInt(fd, unix.SIOCINQ) },
	}
	testenv.BenchDetachedAttached(b, []string{"getppid", "fionread"}, func(b *testing.B) io.Closer {
		in, err := bypass.Create(pin, bypass.Options{})
		if err != nil {
			b.Fatal(err)
		}
		st, err := in.Stats()
		if err != nil {
			b.Fatal(err)
		}
		if !slices.ContainsFunc(st.Programs, func(p bypass.Program) bool { return p.Name == "fionread_told" }) {
			b.Fatal("the install has no FIONREAD watch")
		}
		return closerFunc(func() error {
			defer in.Close()
			return in.Remove(context.Background())
		})
	}, func(_ *testing.B, call string) func() { return calls[call] })
}

type closerFunc func() error

func (f closerFunc) Close() error { return f() }

// unheldTCPSocket is the descriptor of a loopback TCP connection's client
// end, closed when the benchmark ends.
func unheldTCPSocket(b *testing.B) int {
	ln, err := net.ListenTCP("tcp4", &net.TCPAddr{IP: net.IPv4(127, 0, 0, 1)})
	if err != nil {
		b.Fatal(err)
	}
	b.Cleanup(func() { ln.Close() })
	c, err := net.DialTCP("tcp4", nil, ln.Addr().(*net.TCPAddr))
	if err != nil {
		b.Fatal(err)
	}
	b.Cleanup(func() { c.Close() })
	f, err := c.File()
	if err != nil {
		b.Fatal(err)
	}
	b.Cleanup(func() { f.Close() })
	return int(f.Fd())
}
