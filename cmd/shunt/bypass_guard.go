package main

import (
	"context"
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
in the foreground. An install put in place of the one it guards (disable
--all, then enable) is guarded in turn; it ends when the install is
removed, or on Ctrl-C.`,
		Args: noArgs,
		RunE: func(c *cobra.Command, _ []string) error {
			if err := host.CheckPrivileges(); err != nil {
				return err
			}
			in, err := bypass.Open(g.pinDir)
			if err != nil {
				return err
			}
			if err := guard.Check(in); err != nil {
				in.Close()
				return err
			}
			release, err := guard.Lock(g.pinDir)
			if err != nil {
				in.Close()
				return err
			}
			defer release()
			return guardInstalls(c.Context(), e, g.pinDir, in)
		},
	}
}

// guardInstalls guards in, and each install that replaces it at pinDir,
// until none is left or ctx ends; the caller holds the guard's lock.
func guardInstalls(ctx context.Context, e *env, pinDir string, in *bypass.Install) error {
	say := func(line string) { fmt.Fprintf(e.stdout, "%s %s\n", time.Now().Format(time.RFC3339), line) }
	say("guarding " + pinDir)
	for {
		err := guard.Run(ctx, in, say)
		in.Close()
		if ctx.Err() != nil || err != nil {
			return err
		}
		// Removed, or replaced (disable --all, then enable). Decided under
		// the install lock: an enable that runs now finds this guard still
		// holding its lock and starts none, so this guard must see the
		// install that enable makes.
		releaseInstall, err := runlock.Lock("install", pinDir, installLockWait, nil)
		if err != nil {
			return fmt.Errorf("the install at %s changed; lock it to look: %w", pinDir, err)
		}
		in, err = bypass.Open(pinDir)
		if err == nil {
			releaseInstall()
			say("the install at " + pinDir + " was replaced: guarding the new one")
			continue
		}
		// Held until the guard's lock file is gone: an enable that waits
		// for it then finds no guard running and starts one.
		defer releaseInstall()
		if errors.Is(err, bypass.ErrNotInstalled) {
			say("the install at " + pinDir + " was removed: nothing left to guard")
			// Both lock files: taking the install lock to look made its
			// file again.
			return errors.Join(runlock.Remove("guard", pinDir), runlock.Remove("install", pinDir))
		}
		return err
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
