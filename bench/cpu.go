package bench

import (
	"fmt"
	"os"
	"runtime"
	"strconv"
	"strings"
	"time"

	"golang.org/x/sys/unix"
)

// pinThread locks the calling goroutine to its OS thread and that thread to
// one CPU. The returned unpin restores the thread's CPUs before unlocking it:
// a thread handed back to Go still pinned would run unrelated goroutines on
// that CPU, and pass the one-CPU mask on to any process forked from it.
func pinThread(cpu int) (unpin func(), err error) {
	runtime.LockOSThread()
	var old, set unix.CPUSet
	if err := unix.SchedGetaffinity(0, &old); err != nil {
		runtime.UnlockOSThread()
		return nil, fmt.Errorf("read CPU affinity: %w", err)
	}
	set.Set(cpu)
	if err := unix.SchedSetaffinity(0, &set); err != nil {
		runtime.UnlockOSThread()
		return nil, fmt.Errorf("pin to CPU %d: %w", cpu, err)
	}
	return func() {
		// If the mask cannot be restored, stay locked: Go then ends the
		// thread with its goroutine instead of reusing it.
		if unix.SchedSetaffinity(0, &old) == nil {
			runtime.UnlockOSThread()
		}
	}, nil
}

// machineCPU reads the whole machine's busy time from /proc/stat: redirect
// work runs in softirq and kworkers, not only in the measured threads.
func machineCPU() time.Duration {
	b, err := os.ReadFile("/proc/stat")
	if err != nil {
		return 0
	}
	line, _, _ := strings.Cut(string(b), "\n")
	f := strings.Fields(line) // cpu user nice system idle iowait irq softirq steal ...
	var busy int64
	for i, v := range f[1:] {
		if i == 3 || i == 4 { // idle, iowait
			continue
		}
		n, _ := strconv.ParseInt(v, 10, 64)
		busy += n
	}
	return time.Duration(busy) * time.Second / 100 // USER_HZ
}
