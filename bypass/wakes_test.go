package bypass_test

import (
	"bytes"
	"context"
	"errors"
	"os"
	"slices"
	"sync"
	"testing"
	"time"

	"github.com/shunt-project/shunt/bypass"
	"github.com/shunt-project/shunt/guard"
	"github.com/shunt-project/shunt/host"
	"github.com/shunt-project/shunt/internal/testenv"
)

// A reader the stall watch wakes is given its time to answer from when the
// guard delivered the wake-up, not from when the watch asked for it. A
// guard behind by more than the watch's 20 ms (in a stall scan on a host
// with many open files, waiting for a CPU; the race detector's runtime
// made the test's own guard so) made nginx, told 0, look as if it waited
// for something else: it read at once, but was left alone for a second,
// to the stall scan. Seen failing judged from the report: 1 MiB in
// 0.67-0.72 s, found by the scan (without one, stalled at 32-48 KiB);
// 127-147 ms judged from the delivery (wakes_delivered), on 6.18.
func TestWokenReaderIsGivenItsTimeFromTheWakeUp(t *testing.T) {
	testenv.RequireRoot(t)
	if host.Probe().FionreadCountsTCP {
		t.Skip("FIONREAD counts TCP's bytes here: no reader is told 0 for them, and the watch never wakes one")
	}
	for f, network := range []string{"tcp4", "tcp6"} {
		if !onDiagonal(0, f) {
			continue
		}
		t.Run(network, func(t *testing.T) {
			// The watch's wake-up: the FIONREAD watch would move the
			// reader before the watch looks.
			in, cg := mustInstallWith(t, bypass.Options{NoFIONREADWatch: true, Mechanisms: host.Mechanisms{KernelFIONREAD: true}})
			runTestGuard(t, in, 60*time.Millisecond)
			c, s := connPairOver(t, network, cg)
			took := readMiBToldZero(t, c, s)
			t.Logf("1 MiB in %v with each wake-up 60 ms late", took.Round(time.Millisecond))
			if took > 400*time.Millisecond {
				t.Errorf("the reader took %v: a wake-up it answered at once counted as unheeded", took)
			}
		})
	}
}

// The guard is told which descriptor a stalled reader read through, and
// wakes it without a walk of /proc/PID/fd (20 ms with 5,000 descriptors
// open, against 6 us: BenchmarkWake). Found by the watch (at the reader's
// read) and by the stall scan (FIONREAD asked before the first read, which
// the watch never sees). Seen failing when the programs loaded apart each
// wrote a map of their own (reader_fds not pinned): FD -1.
func TestWakeNamesTheReadersDescriptor(t *testing.T) {
	testenv.RequireRoot(t)
	if host.Probe().FionreadCountsTCP {
		t.Skip("FIONREAD counts TCP's bytes here: no reader is told 0 for them")
	}
	for _, tc := range []struct {
		name  string
		how   fionreadReader
		found bypass.StallFound
	}{
		{"watch", fionreadReader{}, bypass.FoundByWatch},
		{"scan", fionreadReader{askFirst: true}, bypass.FoundByScan},
		{"fionread", fionreadReader{askFirst: true}, bypass.FoundByFIONREAD},
	} {
		t.Run(tc.name, func(t *testing.T) {
			// The watch and the scan alone: the FIONREAD watch would
			// find both first.
			opts := bypass.Options{Mechanisms: host.Mechanisms{KernelFIONREAD: true}}
			if tc.found != bypass.FoundByFIONREAD {
				opts.NoFIONREADWatch = true
			}
			in, cg := mustInstallWith(t, opts)
			events := runTestGuard(t, in, 0)
			c, s := connPair(t, cg)
			fd := -1
			rawFD(t, c, func(f int) { fd = f })
			data := randomBytes(1<<20, 7)
			written := sendAll(t, s, data, false)
			got, err := fionreadRead(t, c, len(data), tc.how, 10*time.Second)
			written()
			if err != nil {
				t.Fatal(err)
			}
			if !bytes.Equal(got, data) {
				t.Fatalf("got %d bytes that differ from the %d sent", len(got), len(data))
			}
			rescued := 0
			for _, ev := range events() {
				if ev.Kind != bypass.Wake && ev.Kind != bypass.StallRescued {
					continue
				}
				if ev.FD != fd {
					t.Errorf("%v event of %s names descriptor %d, the reader read through %d", ev.Kind, ev.Local, ev.FD, fd)
				}
				if ev.Kind == bypass.StallRescued {
					rescued++
					if ev.Found != tc.found {
						t.Errorf("the stall was found by %v, want %v", ev.Found, tc.found)
					}
				}
			}
			if rescued == 0 {
				t.Fatal("no stall reported: nothing to check")
			}
		})
	}
}

// runTestGuard wakes the readers the install's programs ask it to wake,
// each lag after it was asked, one after another, as a guard behind would,
// and runs the stall scan; it resets nothing. It returns the events it
// handled so far.
func runTestGuard(t *testing.T, in *bypass.Install, lag time.Duration) func() []bypass.Event {
	t.Helper()
	rd, err := in.WatchEvents()
	if err != nil {
		t.Fatal(err)
	}
	scan, err := in.OpenStallScan()
	if err != nil {
		t.Fatal(err)
	}
	var mu sync.Mutex
	var seen []bypass.Event
	ctx, cancel := context.WithCancel(context.Background())
	done := make(chan error, 1)
	go func() {
		for ctx.Err() == nil {
			if _, err := scan.Run(); err != nil {
				done <- err
				return
			}
			ev, err := rd.Read(time.Now().Add(50 * time.Millisecond))
			if errors.Is(err, os.ErrDeadlineExceeded) {
				continue
			}
			if err != nil {
				done <- err
				return
			}
			if ev.Kind != bypass.Wake && ev.Kind != bypass.StallRescued {
				continue
			}
			mu.Lock()
			seen = append(seen, ev)
			mu.Unlock()
			time.Sleep(lag)
			if err := guard.WakeReader(in, ev); err != nil && !errors.Is(err, os.ErrNotExist) {
				done <- err
				return
			}
		}
		done <- nil
	}()
	t.Cleanup(func() {
		cancel()
		if err := <-done; err != nil {
			t.Errorf("test guard: %v", err)
		}
		rd.Close()
		scan.Close()
	})
	return func() []bypass.Event {
		mu.Lock()
		defer mu.Unlock()
		return slices.Clone(seen)
	}
}
