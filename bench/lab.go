// Package bench measures shunt against its alternatives on this host:
// interleaved rounds, both ends pinned the same way in every mode, whole
// machine CPU, percentiles rather than averages.
package bench

import (
	"context"
	"errors"
	"fmt"
	"path/filepath"
	"time"

	"golang.org/x/sys/unix"

	"github.com/shunt-project/shunt/bench/bare"
	"github.com/shunt-project/shunt/bypass"
	"github.com/shunt-project/shunt/host"
	"github.com/shunt-project/shunt/internal/lab"
)

// Lab is the set-up the network modes run in: a client namespace and a server
// namespace joined by veth, one cgroup for both ends, and a private bypass
// install that is attached to the cgroup only for shunt's rounds.
type Lab struct {
	Client, Server *lab.NetNS
	Cgroup         host.Cgroup
	install        *bypass.Install
	// Installs with other options (altOptions), made for a mode's first
	// run; at most one is attached (attached names its mode).
	alt      map[string]*bypass.Install
	attached string
	cleanup  []func() error
}

// labOptions is o past the probation.
func labOptions(o bypass.Options) bypass.Options {
	o.NoProbation = true
	return o
}

// altOptions are the modes whose connections another install pairs.
var altOptions = map[string]bypass.Options{
	ModeTrust:  {TrustReaders: true},
	ModePaired: {PairBrief: true},
}

// NewLab builds the set-up; prefix names everything it makes.
func NewLab(prefix string) (l *Lab, err error) {
	if err := host.CheckPrivileges(); err != nil {
		return nil, err
	}
	if err := host.Probe().Err(); err != nil {
		return nil, err
	}
	l = &Lab{alt: map[string]*bypass.Install{}}
	defer func() {
		if err != nil {
			l.Close()
		}
	}()
	if l.Client, err = lab.NewNetNS(lab.Name(prefix)); err != nil {
		return nil, err
	}
	l.cleanup = append(l.cleanup, l.Client.Close)
	if l.Server, err = lab.NewNetNS(lab.Name(prefix)); err != nil {
		return nil, err
	}
	l.cleanup = append(l.cleanup, l.Server.Close)
	if err = lab.Veth(l.Client, l.Server); err != nil {
		return nil, err
	}
	cg, remove, err := lab.NewCgroup(lab.Name(prefix))
	if err != nil {
		return nil, err
	}
	l.Cgroup = cg
	l.cleanup = append(l.cleanup, remove)
	pin := filepath.Join(host.BPFFSRoot, lab.Name(prefix))
	if err = host.EnsureBPFFS(pin); err != nil {
		return nil, err
	}
	// The modes measure a program past its probation (its first 16 reads
	// by TCP), as a long-running host's are: client and server here are
	// this one process, and new-connection rounds would hand the probe on
	// at each close for the probation's first second.
	if l.install, err = bypass.Create(pin, labOptions(bypass.Options{})); err != nil {
		return nil, err
	}
	l.cleanup = append(l.cleanup, func() error {
		ctx, cancel := context.WithTimeout(context.Background(), 5*time.Second)
		defer cancel()
		if err := l.install.Remove(ctx); err != nil {
			return err
		}
		return bypass.RemoveLearned(pin, false)
	})
	return l, nil
}

// Bypass turns shunt on or off for connections made from now on.
func (l *Lab) Bypass(on bool) error {
	if err := l.useAlt(""); err != nil {
		return err
	}
	var err error
	if on {
		_, err = l.install.Attach(l.Cgroup)
	} else {
		_, err = l.install.Detach(l.Cgroup.ID)
	}
	return err
}

// bypassMode sets up shunt for a TCP mode's connections made from now on.
func (l *Lab) bypassMode(mode string) error {
	if _, ok := altOptions[mode]; ok {
		if _, err := l.install.Detach(l.Cgroup.ID); err != nil {
			return err
		}
		return l.useAlt(mode)
	}
	if err := l.Bypass(mode != ModeTCP); err != nil {
		return err
	}
	return bare.Use(l.install, mode == ModeBare)
}

// useAlt attaches the install of an altOptions mode to the lab's cgroup, or
// with mode "" detaches the one attached; the lab's own install must be
// detached before one attaches.
func (l *Lab) useAlt(mode string) error {
	if mode == l.attached {
		return nil
	}
	if l.attached != "" {
		if _, err := l.alt[l.attached].Detach(l.Cgroup.ID); err != nil {
			return err
		}
		l.attached = ""
	}
	if mode == "" {
		return nil
	}
	in := l.alt[mode]
	if in == nil {
		pin := l.install.Dir() + "-" + mode
		var err error
		if in, err = bypass.Create(pin, labOptions(altOptions[mode])); err != nil {
			return err
		}
		l.alt[mode] = in
		l.cleanup = append(l.cleanup, func() error {
			ctx, cancel := context.WithTimeout(context.Background(), 5*time.Second)
			defer cancel()
			if err := in.Remove(ctx); err != nil {
				return err
			}
			return bypass.RemoveLearned(pin, false)
		})
	}
	if _, err := in.Attach(l.Cgroup); err != nil {
		return err
	}
	l.attached = mode
	return nil
}

// installFor is the install a shunt mode's connections are paired by.
func (l *Lab) installFor(mode string) *bypass.Install {
	if in, ok := l.alt[mode]; ok {
		return in
	}
	return l.install
}

// Flows lists the lab's bypassed connections.
func (l *Lab) Flows() ([]bypass.Flow, error) { return l.install.Flows() }

// Close removes everything the lab made, newest first.
func (l *Lab) Close() error {
	var errs []error
	for i := len(l.cleanup) - 1; i >= 0; i-- {
		if err := l.cleanup[i](); err != nil {
			errs = append(errs, err)
		}
	}
	l.cleanup = nil
	if len(errs) > 0 {
		return fmt.Errorf("clean up lab: %w", errors.Join(errs...))
	}
	return nil
}

// tally is what a mode's install has counted so far; zero for modes
// without one.
type tally struct {
	// sentBack counts connections sent back to TCP by a rule that judges
	// TCP faster for them: small writes streamed with Nagle's algorithm on,
	// or a reader that stayed behind its writer.
	sentBack uint64
	// redirected counts bytes its sockets sent by redirect.
	redirected uint64
	// throttled counts the times flow control moved a direction's sends
	// to TCP (its reader's redirected bytes past the bound).
	throttled uint64
}

func (l *Lab) tally(mode string) (tally, error) {
	if mode != ModeShunt && mode != ModeTrust {
		return tally{}, nil
	}
	in := l.installFor(mode)
	c, err := in.Counters()
	if err != nil {
		return tally{}, err
	}
	t, err := in.Totals()
	if err != nil {
		return tally{}, err
	}
	return tally{sentBack: c.SmallWrites + c.BehindReader, redirected: t.RedirectedBytes, throttled: c.Throttled}, nil
}

// requireBypassed fails unless the client socket fd is a bypassed flow that
// redirected sends and never fell back to TCP; for other modes it does
// nothing.
func (l *Lab) requireBypassed(mode string, fd int) error {
	f, err := l.requireHeld(mode, fd)
	if err != nil || f == nil {
		return err
	}
	if f.Client.TxMsgs == 0 {
		return fmt.Errorf("connection was paired but no send was redirected (reader %s)", f.Server.Reader)
	}
	return nil
}

// requireHeld fails unless the client socket fd is a paired flow that never
// fell back to TCP, and returns it; for other modes it does nothing. Its
// sends may all have taken TCP, as a user's would behind a reader slower
// than its writer that never caught up with the stream's first TCP bytes.
func (l *Lab) requireHeld(mode string, fd int) (*bypass.Flow, error) {
	if mode != ModeShunt && mode != ModeTrust {
		return nil, nil
	}
	cookie, err := unix.GetsockoptUint64(fd, unix.SOL_SOCKET, unix.SO_COOKIE)
	if err != nil {
		return nil, err
	}
	flows, err := l.installFor(mode).Flows()
	if err != nil {
		return nil, err
	}
	for _, f := range flows {
		if f.Client != nil && f.Client.Cookie == cookie {
			if !f.Client.Redirecting || f.Server == nil || !f.Server.Redirecting {
				return nil, fmt.Errorf("connection fell back to TCP during the run")
			}
			return &f, nil
		}
	}
	return nil, fmt.Errorf("connection was not bypassed")
}
