package fanout_test

import (
	"context"
	"path/filepath"
	"runtime"
	"strings"
	"testing"

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
	buf := make([]byte, 1<<20)
	stacks := string(buf[:runtime.Stack(buf, true)])
	if strings.Contains(stacks, "fanout.(*Forwarder).Run.func") {
		t.Fatalf("a goroutine of Run outlived it:\n%s", stacks)
	}
}
