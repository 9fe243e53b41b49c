package bench

import (
	"encoding/binary"
	"os/exec"
	"testing"
	"time"
)

// The /proc readers give a number only when they read one, and an error
// otherwise: a silent 0 would be a plausible wrong entry in a table.
func TestProcParsers(t *testing.T) {
	busy, err := parseProcStat("cpu  100 5 50 1000 20 3 2 0 0 0\ncpu0 1 2 3\n", 100)
	if err != nil || busy != 1600*time.Millisecond {
		t.Errorf("busy time %v %v, want 1.6 s (user+nice+system+irq+softirq+steal at 100 Hz)", busy, err)
	}
	if busy, _ = parseProcStat("cpu  100 5 50 1000 20 3 2 0\n", 250); busy != 640*time.Millisecond {
		t.Errorf("at 250 Hz: %v, want 640 ms", busy)
	}
	for _, bad := range []string{"", "intr 1 2 3\n", "cpu 1 2 x 4 5 6 7\n", "cpu 1 2\n"} {
		if _, err := parseProcStat(bad, 100); err == nil {
			t.Errorf("parseProcStat(%q) gave no error", bad)
		}
	}

	mem, err := parseSockstatMem("sockets: used 5\nTCP: inuse 3 orphan 0 tw 0 alloc 4 mem 17\nUDP: inuse 0 mem 2\n")
	if err != nil || mem != 17 {
		t.Errorf("TCP mem %d %v, want 17", mem, err)
	}
	for _, bad := range []string{"", "UDP: inuse 0 mem 2\n", "TCP: inuse 3 mem lots\n"} {
		if _, err := parseSockstatMem(bad); err == nil {
			t.Errorf("parseSockstatMem(%q) gave no error", bad)
		}
	}

	cpu, err := parsePidStatCPU("42 (my prog (x)) S 1 42 42 0 -1 4194304 100 0 0 0 30 12 0 0 20 0 1 0", 100)
	if err != nil || cpu != 420*time.Millisecond {
		t.Errorf("pid CPU %v %v, want 420 ms (utime 30 + stime 12)", cpu, err)
	}
	if _, err := parsePidStatCPU("42 (x) S 1 2", 100); err == nil {
		t.Error("a short stat line gave no error")
	}
	if _, err := procTreeCPU(1 << 30); err == nil {
		t.Error("a pid that does not exist gave no error")
	}

	aux := make([]byte, 48)
	binary.NativeEndian.PutUint64(aux[0:], 6) // AT_PAGESZ
	binary.NativeEndian.PutUint64(aux[8:], 4096)
	binary.NativeEndian.PutUint64(aux[16:], atClkTck)
	binary.NativeEndian.PutUint64(aux[24:], 250)
	if hz, err := parseAuxv(aux, atClkTck); err != nil || hz != 250 {
		t.Errorf("AT_CLKTCK %d %v, want 250", hz, err)
	}
	if _, err := parseAuxv(aux[:16], atClkTck); err == nil {
		t.Error("an auxv without AT_CLKTCK gave no error")
	}
	if hz, err := clockTicks(); err != nil || hz <= 0 {
		t.Errorf("this machine's clock tick: %d %v", hz, err)
	}
	if _, err := machineCPU(); err != nil {
		t.Errorf("this machine's CPU: %v", err)
	}
}

// distOf takes percentiles by rank; combine takes the median of each
// round's percentile, the largest max and the total count; stalled flags a
// message over StallLimit or a max over 100 times the median.
func TestDistributions(t *testing.T) {
	if d := distOf(nil); d != (Dist{}) {
		t.Errorf("no samples: %+v", d)
	}
	var s []time.Duration
	for i := 1000; i >= 1; i-- { // out of order on purpose
		s = append(s, time.Duration(i)*time.Microsecond)
	}
	d := distOf(s)
	want := Dist{Count: 1000, P50: 501 * time.Microsecond, P99: 991 * time.Microsecond, P999: 1000 * time.Microsecond, Max: 1000 * time.Microsecond}
	if d != want {
		t.Errorf("distOf 1..1000 us = %+v, want %+v", d, want)
	}
	if s[0] != 1000*time.Microsecond {
		t.Error("distOf sorted its caller's samples")
	}
	c := combine([]Dist{
		{Count: 10, P50: 1, P99: 10, P999: 20, Max: 30},
		{Count: 20, P50: 3, P99: 30, P999: 40, Max: 500},
		{Count: 30, P50: 2, P99: 20, P999: 60, Max: 40},
	})
	if want := (Dist{Count: 60, P50: 2, P99: 20, P999: 40, Max: 500}); c != want {
		t.Errorf("combine = %+v, want %+v", c, want)
	}
	for _, tc := range []struct {
		d    Dist
		want bool
	}{
		{Dist{P50: time.Millisecond, Max: 5 * time.Millisecond}, false},
		{Dist{P50: time.Millisecond, Max: 11 * time.Millisecond}, true},
		{Dist{P50: 10 * time.Microsecond, Max: 2 * time.Millisecond}, true},
		{Dist{P50: 10 * time.Microsecond, Max: 900 * time.Microsecond}, false},
	} {
		if got := stalled(tc.d); got != tc.want {
			t.Errorf("stalled(%+v) = %v, want %v", tc.d, got, tc.want)
		}
	}
}

// A proxy's children may exit while its tree is read (socat forks one per
// connection, waitListening's probe among them): a child that is gone or
// exiting as its stat is read is left out, not an error. A CI run failed
// so once (ESRCH from an exiting child's /proc/PID/stat).
func TestProcTreeCPUWhileChildrenExit(t *testing.T) {
	sh := exec.Command("sh", "-c", "while :; do /bin/true & /bin/true & wait; done")
	if err := sh.Start(); err != nil {
		t.Fatal(err)
	}
	defer func() {
		sh.Process.Kill()
		sh.Wait()
	}()
	for end := time.Now().Add(2 * time.Second); time.Now().Before(end); {
		if _, err := procTreeCPU(sh.Process.Pid); err != nil {
			t.Fatalf("while children come and go: %v", err)
		}
	}
}
