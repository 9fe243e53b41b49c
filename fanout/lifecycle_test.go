package fanout_test

import (
	"context"
	"path/filepath"
	"runtime"
	"strings"
	"testing"
	"time"

	"github.com/shunt-project/shunt/fanout"
	"github.com/shunt-project/shunt/internal/testenv"
)

// Run leaves nothing running when it returns on an error: before, the
// goroutine that waits for ctx outlived it and, cancelled later, wrote to
// the stop eventfd Close had closed.
func TestRunReturnsWithNothingLeft(t *testing.T) {
	testenv.RequireRoot(t)
	ns := testenv.MustNetNS(t)
	var f *fanout.Forwarder
	var err error
	ns.Do(t, func() {
		f, err = fanout.New(fanout.Config{Control: filepath.Join(t.TempDir(), "fanout.sock")})
	})
	if err != nil {
		t.Fatal(err)
	}
	defer f.Close()
	f.BreakEpoll()
	ctx, cancel := context.WithCancel(context.Background())
	defer cancel()
	if err := f.Run(ctx); err == nil {
		t.Fatal("Run returned nil on a closed epoll descriptor")
	}
	// The waker closes its done channel on its way out and may not have
	// returned yet (CI caught it runnable at its last line, once); one
	// left waiting for ctx would still be there after a second.
	buf := make([]byte, 1<<20)
	var stacks string
	for deadline := time.Now().Add(time.Second); ; time.Sleep(10 * time.Millisecond) {
		stacks = string(buf[:runtime.Stack(buf, true)])
		if !strings.Contains(stacks, "fanout.(*Forwarder).Run.func") {
			return
		}
		if time.Now().After(deadline) {
			break
		}
	}
	t.Fatalf("a goroutine of Run outlived it by a second:\n%s", stacks)
}
