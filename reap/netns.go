package reap

import (
	"fmt"
	"strconv"

	"github.com/shunt-project/shunt/host"
	"github.com/shunt-project/shunt/sockindex"
)

// reach opens a sock_diag socket inside the namespace with this cookie. The
// index has no handle on namespaces, only cookies and processes: it tries
// the processes that connected these sockets, then the one the index last saw
// in that namespace, and only then every namespace of the host.
func reach(ix *sockindex.Index, cookie uint64, socks []sockindex.Socket, scan **netnsScan) (*diagConn, error) {
	tried := map[int]bool{}
	try := func(pid int) *diagConn {
		if pid <= 0 || tried[pid] {
			return nil
		}
		tried[pid] = true
		d, _ := openIn("/proc/"+strconv.Itoa(pid)+"/ns/net", cookie)
		return d
	}
	for _, s := range socks {
		if d := try(s.Owner); d != nil {
			return d, nil
		}
	}
	if pid, ok := ix.NetnsOwner(cookie); ok {
		if d := try(pid); d != nil {
			return d, nil
		}
	}
	// A scan kept from an earlier reap may predate this namespace, or name
	// a path that now leads elsewhere: look again before giving up.
	for fresh := *scan == nil; ; fresh = true {
		if fresh {
			*scan = newNetnsScan()
		}
		if path, ok := (*scan).find(cookie); ok {
			if d, err := openIn(path, cookie); err == nil {
				return d, nil
			}
		}
		if fresh {
			return nil, fmt.Errorf("network namespace %d not found", cookie)
		}
	}
}

// openIn opens a sock_diag socket in the namespace at path if its cookie is
// the one wanted.
func openIn(path string, cookie uint64) (*diagConn, error) {
	var d *diagConn
	err := host.InNetns(path, func() error {
		var err error
		d, err = openDiag()
		return err
	})
	if err != nil {
		return nil, err
	}
	if got, err := d.netnsCookie(); err != nil || got != cookie {
		d.Close()
		return nil, fmt.Errorf("%s is another namespace", path)
	}
	return d, nil
}

// netnsScan maps the cookies of every namespace of the host to a path,
// computed once per reap and only if a namespace could not be reached
// through a process the index knows.
type netnsScan struct {
	paths map[uint64]string
}

func newNetnsScan() *netnsScan {
	s := &netnsScan{paths: map[uint64]string{}}
	for _, ns := range host.AllNetns() {
		_ = host.InNetns(ns.Path, func() error {
			c, err := host.CurrentNetnsCookie()
			if err == nil {
				s.paths[c] = ns.Path
			}
			return err
		})
	}
	return s
}

func (s *netnsScan) find(cookie uint64) (string, bool) {
	p, ok := s.paths[cookie]
	return p, ok
}
