// Package guard keeps applications from waiting for ever on shunt.
//
// A splice(2) reader reads only what TCP queued; bytes shunt redirected into
// the socket before its reader was seen splicing are invisible to it. The
// bypass programs catch such a reader, send its connection back to TCP and
// report it; on a kernel that offers no hook before the splice, the guard
// resets the connection so the application sees an error (ECONNABORTED, and
// a reset at the peer) within a second, instead of a silent stall.
//
// A reader may also wait for an event that never comes while bytes sit
// queued: told by FIONREAD that nothing is left (6.18 leaves out bytes that
// came by TCP into a socket in a sockhash; 6.1 the redirected ones), an
// edge-triggered reader like nginx waits for the next edge. The programs
// notice a reader that stops after such a read, and the stall scan any held
// socket whose reader reads nothing with bytes queued; either sends the
// connection back to TCP, and the guard wakes the reader once it has left
// (no BPF program can), so it reads everything.
package guard

import (
	"context"
	"errors"
	"fmt"
	"os"
	"strings"
	"time"

	"golang.org/x/sys/unix"

	"github.com/shunt-project/shunt/bypass"
	"github.com/shunt-project/shunt/internal/runlock"
	"github.com/shunt-project/shunt/reap"
)

// poll bounds how long the guard waits before it checks that it should go
// on (its context, and the install still being there).
const poll = 500 * time.Millisecond

// Check loads what Run loads and lets it go, so that a guard which could
// not run says so before it takes its lock: 'shunt bypass enable' counts a
// guard that holds the lock as started.
func Check(in *bypass.Install) error {
	rd, err := in.WatchEvents()
	if err != nil {
		return err
	}
	if err := rd.Close(); err != nil {
		return err
	}
	scan, err := in.OpenStallScan()
	if errors.Is(err, bypass.ErrNoStallScan) {
		return nil // Run reports it and guards without
	}
	if err != nil {
		return err
	}
	return scan.Close()
}

// Run resets every caught connection of the install, wakes every reader the
// programs or the stall scan found waiting with bytes queued, and reports
// each blocking read that got EAGAIN, until ctx ends or the install is
// removed or replaced by another (it returns nil then). report is told of
// each, in one line.
func Run(ctx context.Context, in *bypass.Install, report func(string)) error {
	rd, err := in.WatchEvents()
	if err != nil {
		return err
	}
	defer rd.Close()
	scan, err := in.OpenStallScan()
	switch {
	case errors.Is(err, bypass.ErrNoStallScan):
		report(err.Error())
	case err != nil:
		return err
	default:
		defer scan.Close()
	}
	// Removed, or removed and installed again (disable --all, then enable):
	// either way this install's maps are not the ones in use.
	fi0, err := os.Stat(in.Dir())
	if err != nil {
		return nil
	}
	ours := func() bool {
		fi, err := os.Stat(in.Dir())
		return err == nil && os.SameFile(fi0, fi)
	}
	next := time.Now()
	// Processes FIONREAD told too few, scanned once the events queued so
	// far are read: a burst of one process's connections costs one pass
	// over its files.
	told := map[int]bypass.Event{}
	for ctx.Err() == nil {
		deadline := time.Now().Add(poll)
		if scan != nil {
			if !time.Now().Before(next) {
				// Its finds come back as events once they have left.
				if _, err := scan.Run(); err != nil {
					if !ours() {
						return nil
					}
					return err
				}
				next = time.Now().Add(bypass.StallScanInterval)
			}
			deadline = next
		}
		if len(told) > 0 {
			deadline = time.Now()
		}
		ev, err := rd.Read(deadline)
		if errors.Is(err, os.ErrDeadlineExceeded) {
			if !ours() {
				return nil // removed or replaced: nothing left to guard here
			}
			scanTold(scan, told, report)
			continue
		}
		if err != nil {
			return fmt.Errorf("read events: %w", err)
		}
		switch ev.Kind {
		case bypass.SpliceCaught, bypass.SpliceTruncated, bypass.ZerocopyCaught:
			report(Reset(ev))
		case bypass.BlockingEAGAIN:
			report(fmt.Sprintf("pid %d (%s) got EAGAIN from a blocking read on %s (peer %s): a signal, stop or ptrace ended its wait in the connection's first read, which TCP would have restarted; the connection is on TCP from now on",
				ev.PID, ev.Command, ev.Local, ev.Remote))
		case bypass.PeekStuck:
			report(fmt.Sprintf("pid %d (%s) peeks at %s (peer %s) again and again, reading nothing, at %d redirected bytes with more behind them by TCP that no peek reaches: it came to peek after those were queued, and shunt cannot join the two queues for it; restart it or exclude its port (shunt bypass enable --exclude-ports)",
				ev.PID, ev.Command, ev.Local, ev.Remote, ev.Unread))
		case bypass.StallRescued, bypass.Wake:
			wake(in, ev, report)
		case bypass.ToldShort:
			if scan != nil {
				told[ev.PID] = ev
			}
		}
	}
	return nil
}

// scanTold runs the stall scan over each process FIONREAD told too few
// (one of its ToldShort events each) and forgets them; its finds come back
// as StallRescued events.
func scanTold(scan *bypass.StallScan, told map[int]bypass.Event, report func(string)) {
	for pid, ev := range told {
		if _, err := scan.RunIn(pid); err != nil {
			report(fmt.Sprintf("pid %d (%s) was told too few bytes by FIONREAD on %s (peer %s); scanning it failed, the stall scan's next pass finds it: %v",
				pid, ev.Command, ev.Local, ev.Remote, err))
		}
	}
	clear(told)
}

// wake wakes the reader an event names, and says so for each connection
// rescued (a Wake is routine: only its failure is reported).
func wake(in *bypass.Install, ev bypass.Event, report func(string)) {
	err := WakeReader(in, ev)
	if errors.Is(err, os.ErrNotExist) {
		err = nil // closed: nobody waits
	}
	what := stallLine(ev)
	switch {
	case ev.Kind == bypass.StallRescued && err == nil:
		report(what + ": the connection goes back to TCP and the reader was woken")
	case ev.Kind == bypass.StallRescued:
		report(what + fmt.Sprintf(": the connection goes back to TCP; waking the reader failed: %v", err))
	case err != nil:
		report(fmt.Sprintf("pid %d (%s): waking the reader of %s (peer %s) failed: %v", ev.PID, ev.Command, ev.Local, ev.Remote, err))
	}
}

// WakeReader wakes the reader a StallRescued or Wake event names and tells
// the install when: a reader the stall watch woke is given its time to
// answer from then.
func WakeReader(in *bypass.Install, ev bypass.Event) error {
	if err := Wake(ev.PID, ev.FD, ev.Inode, ev.Cookie); err != nil {
		return err
	}
	return in.WakeDelivered(ev.Cookie)
}

// stallLine says who waited on what, and how the stall was found.
func stallLine(ev bypass.Event) string {
	if ev.Found == bypass.FoundByFIONREAD {
		return fmt.Sprintf("pid %d (%s) asked FIONREAD on %s (peer %s), whose answer left out %d queued bytes (not correctable on this kernel)", ev.PID, ev.Command, ev.Local, ev.Remote, ev.Unread)
	}
	what := fmt.Sprintf("pid %d (%s) waited on %s (peer %s) with %d bytes queued that FIONREAD or a short read did not show", ev.PID, ev.Command, ev.Local, ev.Remote, ev.Unread)
	if ev.Unread == 0 {
		// Only the peer's end was left unread.
		what = fmt.Sprintf("pid %d (%s) waited on %s (peer %s) with the peer's end (FIN) unread", ev.PID, ev.Command, ev.Local, ev.Remote)
	}
	switch ev.Found {
	case bypass.FoundByWatch:
		what += fmt.Sprintf(", asleep in %s since its last read", syscallName(ev.AsleepIn))
	case bypass.FoundByScan:
		what += ", nothing read for the stall scan's 0.5 s"
	}
	return what
}

// syscallName names the waits the stall watch looks for (x86-64).
func syscallName(nr int) string {
	switch nr {
	case unix.SYS_EPOLL_WAIT:
		return "epoll_wait"
	case unix.SYS_EPOLL_PWAIT:
		return "epoll_pwait"
	case unix.SYS_EPOLL_PWAIT2:
		return "epoll_pwait2"
	case unix.SYS_POLL:
		return "poll"
	case unix.SYS_PPOLL:
		return "ppoll"
	case unix.SYS_SELECT:
		return "select"
	case unix.SYS_PSELECT6:
		return "pselect6"
	case unix.SYS_IO_URING_ENTER:
		return "io_uring_enter"
	}
	return fmt.Sprintf("system call %d", nr)
}

// Reset aborts a caught connection's reading socket (a splicer's, or a
// zerocopy reader's) and says what it did.
func Reset(c bypass.Event) string {
	what := fmt.Sprintf("pid %d (%s) spliced from %s (peer %s) with %d redirected bytes it cannot read", c.PID, c.Command, c.Local, c.Remote, c.Unread)
	if c.Kind == bypass.ZerocopyCaught {
		what = fmt.Sprintf("pid %d (%s) reads %s (peer %s) by TCP_ZEROCOPY_RECEIVE with %d redirected bytes queued that it cannot map", c.PID, c.Command, c.Local, c.Remote, c.Unread)
	}
	if c.Kind == bypass.SpliceTruncated {
		what += ", after its peer's end of stream: the splice returned end of stream before them (the stream it read was cut short)"
	}
	err := reap.DestroyTCP(reap.TCPSocket{Netns: c.Netns, PID: c.PID, Local: c.Local, Remote: c.Remote, Cookie: c.Cookie})
	if errors.Is(err, os.ErrNotExist) {
		return what + ": closed already"
	}
	if err != nil {
		return what + fmt.Sprintf(": could not reset the connection: %v", err)
	}
	if c.Kind == bypass.ZerocopyCaught {
		return what + ": connection reset"
	}
	return what + ": connection reset; its later connections stay on TCP"
}

// LockPath is the guard's lock file for the install at pinDir: a guard
// holds it while it runs, so a second one stands down and status can tell
// that one runs.
func LockPath(pinDir string) string { return runlock.Path("guard", pinDir) }

// LogPath is where a guard started by `shunt bypass enable` for the
// install at pinDir writes.
func LogPath(pinDir string) string {
	return strings.TrimSuffix(LockPath(pinDir), ".lock") + ".log"
}

// ErrRunning means another guard watches the install already.
var ErrRunning = errors.New("a guard already watches this install")

// Lock claims the guard's place for the install at pinDir until release.
func Lock(pinDir string) (release func(), err error) {
	release, err = runlock.Lock("guard", pinDir, 0, nil)
	if errors.Is(err, runlock.ErrHeld) {
		return nil, ErrRunning
	}
	return release, err
}

// Running says whether a guard watches the install at pinDir.
func Running(pinDir string) bool { return runlock.Held("guard", pinDir) }
