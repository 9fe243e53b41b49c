package main

import (
	"errors"
	"fmt"
	"os"
	"os/exec"
	"syscall"
	"time"

	"github.com/spf13/cobra"
	"golang.org/x/sys/unix"

	"github.com/shunt-project/shunt/bypass"
	"github.com/shunt-project/shunt/guard"
	"github.com/shunt-project/shunt/host"
	"github.com/shunt-project/shunt/internal/runlock"
)

func newBypassGuardCmd(e *env, g *globals) *cobra.Command {
	return &cobra.Command{
		Use:   "guard",
		Short: "Reset connections a splice(2) reader would wait on for ever",
		Long: `guard watches the install for readers caught splicing (splice(2), Go's
io.Copy between two connections, HAProxy's splice-auto) after bytes were
redirected to them, which splice cannot read. It resets each such
connection at once (the application sees ECONNABORTED, its peer a reset)
and prints one line naming the process and ports. shunt has already sent
the program's later connections to TCP by then.

'shunt bypass enable' starts a guard in the background unless one runs
(--no-guard to leave it to you, e.g. under systemd); this command runs one
in the foreground. It ends when the install is removed, or on Ctrl-C.`,
		Args: noArgs,
		RunE: func(c *cobra.Command, _ []string) error {
			if err := host.CheckPrivileges(); err != nil {
				return err
			}
			in, err := bypass.Open(g.pinDir)
			if err != nil {
				return err
			}
			defer in.Close()
			release, err := guard.Lock(g.pinDir)
			if err != nil {
				return err
			}
			defer release()
			fmt.Fprintf(e.stdout, "%s guarding %s\n", time.Now().Format(time.RFC3339), g.pinDir)
			err = guard.Run(c.Context(), in, func(line string) {
				fmt.Fprintf(e.stdout, "%s %s\n", time.Now().Format(time.RFC3339), line)
			})
			if c.Context().Err() != nil {
				return nil
			}
			if err == nil {
				// The install was removed: so is the guard's lock file.
				return runlock.Remove("guard", g.pinDir)
			}
			return err
		},
	}
}

// startGuard starts `shunt bypass guard` for the install in the background,
// in a session of its own, logging beside its lock file, unless one runs.
func startGuard(e *env, pinDir string) (string, error) {
	logPath := guard.LogPath(pinDir)
	if guard.Running(pinDir) {
		return logPath, nil
	}
	if err := runlock.EnsureDir(); err != nil {
		return "", err
	}
	log, err := os.OpenFile(logPath, os.O_CREATE|os.O_WRONLY|os.O_APPEND|unix.O_NOFOLLOW, 0o600)
	if err != nil {
		return "", err
	}
	defer log.Close()
	cmd := e.shunt("bypass", "guard", "--pin-dir", pinDir)
	cmd.Stdout, cmd.Stderr = log, log
	cmd.SysProcAttr = &syscall.SysProcAttr{Setsid: true}
	if err := cmd.Start(); err != nil {
		return "", fmt.Errorf("start the guard: %w", err)
	}
	// Reap it if it ends while this process still runs; it outlives us
	// otherwise, by design. Only this goroutine touches cmd after Start.
	exited := make(chan error, 1)
	go func() { exited <- cmd.Wait() }()
	// Wait until it holds its lock, so status reports it at once.
	deadline := time.After(guardStartTimeout)
	tick := time.NewTicker(10 * time.Millisecond)
	defer tick.Stop()
	for !guard.Running(pinDir) {
		select {
		case err := <-exited:
			if err == nil {
				err = errors.New("exited")
			}
			return "", fmt.Errorf("the guard did not start (%v; its log: %s); run 'shunt bypass guard' to see why", err, logPath)
		case <-deadline:
			// A guard that never took its lock is no guard: stop it, so
			// no second one is left running beside the next attempt.
			_ = cmd.Process.Kill()
			return "", fmt.Errorf("the guard did not start within %v (stopped it: %v; its log: %s); run 'shunt bypass guard' to see why", guardStartTimeout, <-exited, logPath)
		case <-tick.C:
		}
	}
	return logPath, nil
}

// guardStartTimeout bounds how long enable waits for the guard it started to
// take its lock.
const guardStartTimeout = 5 * time.Second

// selfCommand runs this binary with args.
func selfCommand(args ...string) *exec.Cmd {
	self, err := os.Executable()
	if err != nil {
		self = os.Args[0]
	}
	return exec.Command(self, args...)
}
