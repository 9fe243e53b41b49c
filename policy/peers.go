package policy

import (
	"errors"
	"fmt"
	"os"
	"path/filepath"
	"strconv"

	"github.com/cilium/ebpf"
	"github.com/cilium/ebpf/link"

	"github.com/shunt-project/shunt/host"
)

// peerPrograms is the program each cgroup that peer rules name gets: it
// writes down the sender's cgroups of what its sockets send, for the
// receiving scope's ingress program. One copy serves every such cgroup.
type peerPrograms struct {
	Egress *ebpf.Program `ebpf:"shunt_policy_peer_egress"`
}

// attachPeers attaches the peer program to every cgroup the scopes' peer
// rules name that lacks it (pinned as peers/<cgroup id>), and returns
// those cgroups' ids. spec may be nil.
func (p *Policy) attachPeers(spec *ebpf.CollectionSpec, scopes []scopeRules) (map[uint64]bool, error) {
	named := map[uint64]string{}
	for _, s := range scopes {
		for _, r := range s.Ingress {
			if r.IsPeer() {
				named[r.peer] = r.Peer
			}
		}
	}
	if len(named) == 0 {
		return nil, nil
	}
	dir := filepath.Join(p.dir, peersDir)
	if err := os.MkdirAll(dir, 0o700); err != nil {
		return nil, err
	}
	var prog *ebpf.Program
	defer func() {
		if prog != nil {
			prog.Close()
		}
	}()
	ids := map[uint64]bool{}
	for id, path := range named {
		ids[id] = true
		pinPath := filepath.Join(dir, strconv.FormatUint(id, 10))
		if _, err := os.Stat(pinPath); err == nil {
			continue
		}
		if prog == nil {
			var err error
			if spec == nil {
				if spec, err = loadPolicy(); err != nil {
					return nil, fmt.Errorf("load BPF spec: %w", err)
				}
			}
			var progs peerPrograms
			if err := spec.LoadAndAssign(&progs, &ebpf.CollectionOptions{MapReplacements: p.replacements()}); err != nil {
				return nil, host.Explain(fmt.Errorf("load the peer program: %w", err), "the policy", host.MinKernel)
			}
			prog = progs.Egress
		}
		l, err := link.AttachCgroup(link.CgroupOptions{Path: path, Attach: ebpf.AttachCGroupInetEgress, Program: prog})
		if err != nil {
			return nil, fmt.Errorf("attach the peer program to %s: %w", path, err)
		}
		err = l.Pin(pinPath)
		l.Close()
		if err != nil {
			return nil, fmt.Errorf("pin the peer link of %s: %w", path, err)
		}
	}
	return ids, nil
}

// detachPeersBut detaches the peer program from the cgroups not in keep.
func (p *Policy) detachPeersBut(keep map[uint64]bool) error {
	ents, err := os.ReadDir(filepath.Join(p.dir, peersDir))
	if errors.Is(err, os.ErrNotExist) {
		return nil
	}
	if err != nil {
		return err
	}
	var errs []error
	for _, e := range ents {
		if id, err := strconv.ParseUint(e.Name(), 10, 64); err == nil && keep[id] {
			continue
		}
		errs = append(errs, os.Remove(filepath.Join(p.dir, peersDir, e.Name())))
	}
	return errors.Join(errs...)
}
