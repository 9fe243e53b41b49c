package bench

import (
	"encoding/binary"
	"fmt"
	"os"
	"runtime"
	"strconv"
	"strings"
	"sync"
	"time"

	"golang.org/x/sys/unix"
)

// pinThread locks the calling goroutine to its OS thread and that thread to
// one CPU (any for -1: locked alone). The returned unpin restores the
// thread's CPUs before unlocking it: a thread handed back to Go still pinned
// would run unrelated goroutines on that CPU, and pass the one-CPU mask on to
// any process forked from it.
func pinThread(cpu int) (unpin func(), err error) {
	runtime.LockOSThread()
	if cpu < 0 {
		return runtime.UnlockOSThread, nil
	}
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
// work runs in softirq and kworkers, not only in the measured threads. An
// error, never a plausible 0, when it cannot.
func machineCPU() (time.Duration, error) {
	b, err := os.ReadFile("/proc/stat")
	if err != nil {
		return 0, fmt.Errorf("machine CPU: %w", err)
	}
	hz, err := clockTicks()
	if err != nil {
		return 0, err
	}
	return parseProcStat(string(b), hz)
}

// parseProcStat sums the busy fields of the "cpu" line (all but idle and
// iowait), counted in ticks of 1/hz s.
func parseProcStat(text string, hz int64) (time.Duration, error) {
	line, _, _ := strings.Cut(text, "\n")
	f := strings.Fields(line) // cpu user nice system idle iowait irq softirq steal ...
	if len(f) < 8 || f[0] != "cpu" {
		return 0, fmt.Errorf("machine CPU: /proc/stat starts %q, not a cpu line", line)
	}
	var busy int64
	for i, v := range f[1:] {
		n, err := strconv.ParseInt(v, 10, 64)
		if err != nil {
			return 0, fmt.Errorf("machine CPU: field %d of /proc/stat's cpu line is %q", i+1, v)
		}
		if i == 3 || i == 4 { // idle, iowait
			continue
		}
		busy += n
	}
	return time.Duration(busy) * time.Second / time.Duration(hz), nil
}

// cpuClock measures machine CPU over an interval.
type cpuClock struct{ start time.Duration }

func startCPU() (cpuClock, error) {
	t, err := machineCPU()
	return cpuClock{t}, err
}

// elapsed is the machine CPU spent since start.
func (c cpuClock) elapsed() (time.Duration, error) {
	t, err := machineCPU()
	return t - c.start, err
}

// clockTicks is USER_HZ, the unit of /proc's CPU times, as the kernel
// tells every process in its auxiliary vector (AT_CLKTCK).
func clockTicks() (int64, error) {
	ticksOnce.Do(func() {
		b, err := os.ReadFile("/proc/self/auxv")
		if err != nil {
			ticksErr = fmt.Errorf("read the clock tick (auxv): %w", err)
			return
		}
		ticks, ticksErr = parseAuxv(b, atClkTck)
	})
	return ticks, ticksErr
}

var (
	ticksOnce sync.Once
	ticks     int64
	ticksErr  error
)

const atClkTck = 17 // AT_CLKTCK, include/uapi/linux/auxvec.h

// parseAuxv finds one entry of an auxiliary vector (native word pairs).
func parseAuxv(b []byte, key uint64) (int64, error) {
	for i := 0; i+16 <= len(b); i += 16 {
		k := binary.NativeEndian.Uint64(b[i:])
		if k == 0 {
			break
		}
		if k == key {
			if v := int64(binary.NativeEndian.Uint64(b[i+8:])); v > 0 {
				return v, nil
			}
		}
	}
	return 0, fmt.Errorf("the auxiliary vector has no entry %d", key)
}
