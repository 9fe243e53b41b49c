package bypass_test

import (
	"context"
	"errors"
	"os"
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
// to the stall scan. Seen failing judged from the report: 1 MiB stalled
// at 32-48 KiB (this guard runs no scan); 127 ms judged from the delivery
// (wakes_delivered), on 6.18.
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
			in, cg := mustInstallWith(t, bypass.Options{Mechanisms: host.Mechanisms{KernelFIONREAD: true}})
			runLaggingGuard(t, in, 60*time.Millisecond)
			side := testenv.Side{NS: testenv.MustNetNS(t), CG: cg}
			addr := map[string]string{"tcp4": "127.0.0.1:0", "tcp6": "[::1]:0"}[network]
			c, s := testenv.ConnPair(t, network, side, addr, side, addr)
			took := readMiBToldZero(t, c, s)
			t.Logf("1 MiB in %v with each wake-up 60 ms late", took.Round(time.Millisecond))
			if took > time.Second {
				t.Errorf("the reader took %v: a wake-up it answered at once counted as unheeded", took)
			}
		})
	}
}

// runLaggingGuard wakes the readers the install's programs ask it to wake,
// each lag after it was asked, one after another, as a guard behind would;
// it runs no stall scan and resets nothing.
func runLaggingGuard(t *testing.T, in *bypass.Install, lag time.Duration) {
	t.Helper()
	rd, err := in.WatchEvents()
	if err != nil {
		t.Fatal(err)
	}
	ctx, cancel := context.WithCancel(context.Background())
	done := make(chan error, 1)
	go func() {
		for ctx.Err() == nil {
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
			t.Errorf("lagging guard: %v", err)
		}
		rd.Close()
	})
}
