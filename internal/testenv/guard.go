package testenv

import (
	"context"
	"testing"

	"github.com/shunt-project/shunt/bypass"
	"github.com/shunt-project/shunt/guard"
)

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
