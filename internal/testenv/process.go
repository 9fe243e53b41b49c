package testenv

import (
	"os"
	"os/exec"
	"path/filepath"
	"sync"
	"syscall"
	"testing"
	"time"
)

// Process is a program a test started with Start.
type Process struct {
	Pid int
	// Stop ends it (SIGTERM to its process group, SIGKILL after 15 s) and
	// waits for it; Start's cleanup calls it too.
	Stop func()
}

// Start starts cmd in a process group of its own, its output in a file,
// and stops it when the test ends; if the test failed, the last 4 KiB of
// what it printed are logged under name.
func Start(t testing.TB, name string, cmd *exec.Cmd) *Process {
	t.Helper()
	out, err := os.Create(filepath.Join(t.TempDir(), name+".log"))
	if err != nil {
		t.Fatal(err)
	}
	cmd.Stdout, cmd.Stderr = out, out
	if cmd.SysProcAttr == nil {
		cmd.SysProcAttr = &syscall.SysProcAttr{}
	}
	cmd.SysProcAttr.Setpgid = true
	cmd.SysProcAttr.Pdeathsig = syscall.SIGKILL
	if err := cmd.Start(); err != nil {
		out.Close()
		t.Fatalf("start %s: %v", name, err)
	}
	exited := make(chan struct{})
	go func() { _ = cmd.Wait(); close(exited) }()
	var once sync.Once
	var early bool // it had exited before the test stopped it
	stop := func() {
		once.Do(func() {
			select {
			case <-exited:
				early = true
			default:
			}
			_ = syscall.Kill(-cmd.Process.Pid, syscall.SIGTERM)
			select {
			case <-exited:
			case <-time.After(15 * time.Second):
				_ = syscall.Kill(-cmd.Process.Pid, syscall.SIGKILL)
				<-exited
			}
			out.Close()
		})
	}
	t.Cleanup(func() {
		stop()
		if t.Failed() {
			b, _ := os.ReadFile(out.Name())
			if len(b) > 4096 {
				b = b[len(b)-4096:]
			}
			t.Logf("%s said (last 4 KiB):\n%s", name, b)
			if early {
				// A program that dies of a signal says nothing itself.
				t.Logf("%s had ended by itself: %v", name, cmd.ProcessState)
			}
		}
	})
	return &Process{Pid: cmd.Process.Pid, Stop: stop}
}
