package bench

import (
	"context"
	"errors"
	"path/filepath"
	"time"

	"github.com/shunt-project/shunt/bypass"
	"github.com/shunt-project/shunt/host"
	"github.com/shunt-project/shunt/internal/lab"
)

// shortcutSetup is what the shunt-shortcut proxy runs in: a cgroup a bypass
// install of its own is enabled for, and an upstream made in it (an accepted
// socket belongs to its listener's cgroup). The install trusts readers: the
// benchmark's peers read with blocking calls, which bypass otherwise sends
// back to TCP.
type shortcutSetup struct {
	cg      host.Cgroup
	pin     string
	up      *upstream
	cleanup []func() error
}

func newShortcutSetup(ns *lab.NetNS) (s *shortcutSetup, err error) {
	s = &shortcutSetup{}
	defer func() {
		if err != nil {
			err = errors.Join(err, s.close())
		}
	}()
	name := lab.Name("shunt-bench-shortcut-")
	cg, remove, err := lab.NewCgroup(name)
	if err != nil {
		return nil, err
	}
	s.cg = cg
	s.cleanup = append(s.cleanup, remove)
	s.pin = filepath.Join(host.BPFFSRoot, name)
	if err := host.EnsureBPFFS(s.pin); err != nil {
		return nil, err
	}
	in, err := bypass.Create(s.pin, bypass.Options{TrustReaders: true})
	if err != nil {
		return nil, err
	}
	s.cleanup = append(s.cleanup, func() error {
		ctx, cancel := context.WithTimeout(context.Background(), 5*time.Second)
		defer cancel()
		return errors.Join(in.Remove(ctx), bypass.RemoveLearned(s.pin, false))
	})
	if _, err := in.Attach(cg); err != nil {
		return nil, err
	}
	err = s.run(func() error {
		var err error
		s.up, err = startUpstream(ns)
		return err
	})
	if err != nil {
		return nil, err
	}
	s.cleanup = append(s.cleanup, func() error { s.up.close(); return nil })
	return s, nil
}

// run runs fn with this process in the cgroup: the proxy fn starts and the
// client's sockets belong to it.
func (s *shortcutSetup) run(fn func() error) error { return lab.InCgroup(s.cg, fn) }

// close undoes newShortcutSetup, last step first.
func (s *shortcutSetup) close() error {
	var errs []error
	for i := len(s.cleanup) - 1; i >= 0; i-- {
		errs = append(errs, s.cleanup[i]())
	}
	s.cleanup = nil
	return errors.Join(errs...)
}
