package host

import (
	"errors"
	"fmt"
	"os"

	"github.com/cilium/ebpf"
	"github.com/cilium/ebpf/asm"
	"golang.org/x/sys/unix"
)

// CanWriteUser says whether a tracepoint program may call
// bpf_probe_write_user: refused under lockdown (integrity and up), which
// these VMs' 6.18 forces. shunt needs it to correct FIONREAD.
func CanWriteUser() bool {
	p, err := ebpf.NewProgram(&ebpf.ProgramSpec{
		Type: ebpf.TracePoint, License: "GPL",
		Instructions: asm.Instructions{
			asm.Mov.Imm(asm.R1, 0),
			asm.StoreMem(asm.RFP, -8, asm.R1, asm.DWord),
			asm.Mov.Reg(asm.R2, asm.RFP),
			asm.Add.Imm(asm.R2, -8),
			asm.Mov.Imm(asm.R3, 4),
			asm.FnProbeWriteUser.Call(),
			asm.Mov.Imm(asm.R0, 0),
			asm.Return(),
		},
	})
	if err != nil {
		return false
	}
	p.Close()
	return true
}

// TracefsRoot is where tracefs is normally mounted.
const TracefsRoot = "/sys/kernel/tracing"

func isTracefs(path string) bool {
	var fs unix.Statfs_t
	return unix.Statfs(path, &fs) == nil && fs.Type == unix.TRACEFS_MAGIC
}

// TracefsMounted says whether tracefs is mounted where tracepoints are
// looked up (/sys/kernel/tracing, or the older /sys/kernel/debug/tracing).
func TracefsMounted() bool {
	return isTracefs(TracefsRoot) || isTracefs("/sys/kernel/debug/tracing")
}

// EnsureTracefs makes sure tracefs is mounted (tracepoints are found by
// name there), mounting it at /sys/kernel/tracing when neither that nor
// the older /sys/kernel/debug/tracing has it (systemd mounts it at boot;
// a bare init may not).
func EnsureTracefs() error {
	if TracefsMounted() {
		return nil
	}
	if _, err := os.Stat(TracefsRoot); err != nil {
		return fmt.Errorf("no tracefs: %s is missing: mount tracefs somewhere ('mount -t tracefs nodev /sys/kernel/debug/tracing')", TracefsRoot)
	}
	if err := unix.Mount("nodev", TracefsRoot, "tracefs", 0, ""); err != nil {
		if errors.Is(err, unix.EPERM) {
			return fmt.Errorf("cannot mount tracefs at %s: permission denied: run as root", TracefsRoot)
		}
		return fmt.Errorf("cannot mount tracefs at %s: %v: mount it with 'mount -t tracefs nodev %s'", TracefsRoot, err, TracefsRoot)
	}
	return nil
}
