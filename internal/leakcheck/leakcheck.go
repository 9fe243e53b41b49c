// Package leakcheck fails a test binary that leaves goroutines running or
// file descriptors open after its tests: a TestMain calls Main. Proxies,
// daemons and forwarders own sockets and goroutines whose lifetime ends at
// Close; a Close that forgets one shows here, not in production.
package leakcheck

import (
	"fmt"
	"os"
	"path/filepath"
	"runtime"
	"slices"
	"strings"
	"testing"
	"time"

	"go.uber.org/goleak"
)

// settle is how long goroutines and descriptors get to end after the last
// test: a Close may return before a reader it woke has run.
const settle = 5 * time.Second

// Main runs the tests and then checks for leaks; its result is the exit
// code. after releases what a package holds for the whole process by
// design (a process-wide object loaded on first use), before the check.
func Main(m *testing.M, after ...func()) int {
	// The runtime's poller (an epoll and an eventfd) opens at the first
	// pollable descriptor and stays: open it before counting.
	if r, w, err := os.Pipe(); err == nil {
		r.Close()
		w.Close()
	}
	before := openFDs()
	opts := []goleak.Option{goleak.IgnoreCurrent()}
	code := m.Run()
	for _, f := range after {
		f()
	}
	if code != 0 {
		return code // a failed test leaks what it left open: that is not news
	}
	// goleak retries for about a second; a test's helper may sleep
	// longer on its way out (a slow peer that holds its end a second).
	var err error
	for deadline := time.Now().Add(settle); ; time.Sleep(100 * time.Millisecond) {
		if err = goleak.Find(opts...); err == nil || time.Now().After(deadline) {
			break
		}
	}
	if err != nil {
		fmt.Fprintf(os.Stderr, "leakcheck: goroutines left running after the tests: %v\n", err)
		code = 1
	}
	var left []string
	for deadline := time.Now().Add(settle); ; time.Sleep(100 * time.Millisecond) {
		// Go keeps splice(2) pipes in a pool that a finalizer closes
		// once two collections dropped them (net's ReadFrom).
		runtime.GC()
		left = newFDs(before, openFDs())
		if len(left) == 0 || time.Now().After(deadline) {
			break
		}
	}
	if len(left) > 0 {
		fmt.Fprintf(os.Stderr, "leakcheck: %d descriptors left open after the tests:\n  %s\n", len(left), strings.Join(left, "\n  "))
		code = 1
	}
	return code
}

// openFDs maps each open descriptor to what it refers to.
func openFDs() map[string]string {
	out := map[string]string{}
	ents, err := os.ReadDir("/proc/self/fd")
	if err != nil {
		return out
	}
	for _, e := range ents {
		target, err := os.Readlink(filepath.Join("/proc/self/fd", e.Name()))
		if err != nil {
			continue // the directory's own descriptor, closed already
		}
		out[e.Name()] = target
	}
	return out
}

// newFDs lists the descriptors open now that were not before (or now name
// something else).
func newFDs(before, now map[string]string) []string {
	var out []string
	for fd, target := range now {
		if before[fd] != target {
			out = append(out, fd+" -> "+target)
		}
	}
	slices.Sort(out)
	return out
}
