// Package bypasstest holds the test helpers that need a bypass install: a
// pin directory whose install is removed when the test ends, a guard
// running beside a test, a guard ring with no room left. internal/testenv
// stays a leaf every package's tests can use; this is where cleanup that
// knows bypass and the guard is registered.
package bypasstest

import (
	"context"
	"os"
	"path/filepath"
	"testing"
	"time"

	"github.com/cilium/ebpf"
	"github.com/cilium/ebpf/asm"

	"github.com/shunt-project/shunt/bypass"
	"github.com/shunt-project/shunt/guard"
	"github.com/shunt-project/shunt/host"
	"github.com/shunt-project/shunt/internal/runlock"
	"github.com/shunt-project/shunt/internal/testenv"
)

// MustPinDir is testenv.MustPinDir for a directory a bypass install may be
// made in: when the test ends that install is removed (drained first), its
// learned programs and its guard's lock and log go too.
func MustPinDir(t testing.TB) string {
	t.Helper()
	dir := testenv.MustPinDir(t)
	// Cleanups run last-registered first: this one before testenv's
	// removal of the directory.
	t.Cleanup(func() {
		if in, err := bypass.Open(dir); err == nil {
			ctx, cancel := context.WithTimeout(context.Background(), 5*time.Second)
			defer cancel()
			if err := in.Remove(ctx); err != nil {
				t.Errorf("remove install at %s: %v", dir, err)
			}
		}
		os.RemoveAll(bypass.LearnedDir(dir))
		// A guard (started by the CLI's enable) ends once the install is
		// gone; then its lock and log go too.
		for deadline := time.Now().Add(5 * time.Second); guard.Running(dir) && time.Now().Before(deadline); {
			time.Sleep(20 * time.Millisecond)
		}
		os.Remove(guard.LockPath(dir))
		os.Remove(guard.LogPath(dir))
		os.Remove(runlock.Path("install", dir))
	})
	return dir
}

// RunGuard runs the guard on in until the test ends, telling report what
// it says; the test fails if the guard ends with an error.
func RunGuard(t testing.TB, in *bypass.Install, report func(string)) {
	t.Helper()
	ctx, cancel := context.WithCancel(context.Background())
	done := make(chan error, 1)
	go func() { done <- guard.Run(ctx, in, report) }()
	t.Cleanup(func() {
		cancel()
		if err := <-done; err != nil {
			t.Errorf("guard: %v", err)
		}
	})
}

// FillGuardRing leaves no room in the guard's event ring of the install at
// pinDir, as a guard that never ran or fell behind would: throwaway
// programs reserve and discard records until none fits. A guard's reader
// skips discarded records, freeing the ring as it reads.
func FillGuardRing(t testing.TB, pinDir string) {
	t.Helper()
	ring, err := ebpf.LoadPinnedMap(filepath.Join(pinDir, "maps", "guard_events"), nil)
	if err != nil {
		t.Fatal(err)
	}
	defer ring.Close()
	// A ring holds at most its size less one byte of records, each with an
	// 8-byte header, rounded to 8: pages while they fit, then the smallest.
	for _, size := range []int32{4096 - 8, 8} {
		prog, err := ebpf.NewProgram(&ebpf.ProgramSpec{
			Type:    ebpf.SocketFilter,
			License: "GPL",
			Instructions: asm.Instructions{
				asm.LoadMapPtr(asm.R1, ring.FD()),
				asm.Mov.Imm(asm.R2, size),
				asm.Mov.Imm(asm.R3, 0),
				asm.FnRingbufReserve.Call(),
				asm.JEq.Imm(asm.R0, 0, "out"),
				asm.Mov.Reg(asm.R1, asm.R0),
				asm.Mov.Imm(asm.R2, 0),
				asm.FnRingbufDiscard.Call(),
				asm.Mov.Imm(asm.R0, 0).WithSymbol("out"),
				asm.Return(),
			},
		})
		if err != nil {
			t.Fatalf("load the ring filler: %v", err)
		}
		// A socket filter's test run needs an Ethernet header's worth of
		// data; each run reserves once, more runs than records fit.
		_, err = prog.Run(&ebpf.RunOptions{Data: make([]byte, 14), Repeat: ring.MaxEntries() / uint32(size+8)})
		prog.Close()
		if err != nil {
			t.Fatalf("run the ring filler: %v", err)
		}
	}
}

// MustEnabled makes an install with opts in a pin directory of its own
// (MustPinDir) and enables a new cgroup for it; the test needs root. The
// kernel log is watched for the whole test.
func MustEnabled(t testing.TB, opts bypass.Options) (*bypass.Install, host.Cgroup) {
	t.Helper()
	testenv.RequireRoot(t)
	testenv.WatchKernelLog(t)
	in, err := bypass.Create(MustPinDir(t), opts)
	if err != nil {
		t.Fatal(err)
	}
	t.Cleanup(func() { in.Close() })
	cg := testenv.MustCgroup(t)
	if _, err := in.Attach(cg); err != nil {
		t.Fatal(err)
	}
	return in, cg
}
