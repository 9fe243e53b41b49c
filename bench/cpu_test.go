package bench

import (
	"runtime"
	"testing"

	"golang.org/x/sys/unix"
)

// A pinned thread goes back to Go with the CPUs it had, or a later fork from
// it (a tool, a subprocess) would inherit a one-CPU mask.
func TestPinThreadRestoresAffinity(t *testing.T) {
	runtime.LockOSThread() // keep this goroutine on one thread across pin/unpin
	defer runtime.UnlockOSThread()
	var before, during, after unix.CPUSet
	if err := unix.SchedGetaffinity(0, &before); err != nil {
		t.Fatal(err)
	}
	unpin, err := pinThread(0)
	if err != nil {
		t.Fatal(err)
	}
	if err := unix.SchedGetaffinity(0, &during); err != nil {
		t.Fatal(err)
	}
	if during.Count() != 1 || !during.IsSet(0) {
		t.Errorf("pinned thread runs on %d CPUs, want only CPU 0", during.Count())
	}
	unpin()
	if err := unix.SchedGetaffinity(0, &after); err != nil {
		t.Fatal(err)
	}
	if after != before {
		t.Errorf("unpin left the thread on %d CPUs, it had %d", after.Count(), before.Count())
	}
}

// any-cpu leaves the thread's CPUs as they were: the scheduler places it.
func TestPinThreadAnyLeavesAffinity(t *testing.T) {
	runtime.LockOSThread()
	defer runtime.UnlockOSThread()
	var before, during unix.CPUSet
	if err := unix.SchedGetaffinity(0, &before); err != nil {
		t.Fatal(err)
	}
	client, server := cpusFor(AnyCPU)
	if client != -1 || server != -1 {
		t.Fatalf("any-cpu gives CPUs %d and %d, want -1 (none)", client, server)
	}
	unpin, err := pinThread(client)
	if err != nil {
		t.Fatal(err)
	}
	defer unpin()
	if err := unix.SchedGetaffinity(0, &during); err != nil {
		t.Fatal(err)
	}
	if during != before {
		t.Errorf("any-cpu thread runs on %d CPUs, it had %d", during.Count(), before.Count())
	}
}
