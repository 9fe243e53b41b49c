package testenv

import (
	"io"
	"runtime"
	"testing"
)

// BenchDetachedAttached runs each call as two sub-benchmarks, call/detached
// and call/attached, the second with what attach returns in place (closed
// after it): what a program attached to a hook costs the calls that pass
// it. setup makes a call's function, outside the timer; the thread is
// locked, so each run stays on one task.
func BenchDetachedAttached(b *testing.B, calls []string, attach func(b *testing.B) io.Closer, setup func(b *testing.B, call string) func()) {
	for _, call := range calls {
		for _, attached := range []bool{false, true} {
			name := call + "/detached"
			if attached {
				name = call + "/attached"
			}
			b.Run(name, func(b *testing.B) {
				if attached {
					defer attach(b).Close()
				}
				runtime.LockOSThread()
				defer runtime.UnlockOSThread()
				fn := setup(b, call)
				b.ResetTimer()
				for range b.N {
					fn()
				}
			})
		}
	}
}
