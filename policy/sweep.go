package policy

import (
	"context"
	"fmt"
	"net/netip"
	"syscall"

	"github.com/cilium/ebpf"
	"github.com/cilium/ebpf/link"

	"github.com/shunt-project/shunt/host"
	"github.com/shunt-project/shunt/internal/bpfiter"
	"github.com/shunt-project/shunt/reap"
	"github.com/shunt-project/shunt/sockindex"
)

// Closed is an open connection an apply closed because the new rules deny
// it.
type Closed struct {
	Proto  string `json:"proto"`
	Local  string `json:"local"`
	Remote string `json:"remote"`
	Cookie uint64 `json:"cookie"`
	Rule   uint32 `json:"rule"`            // the counter id of the rule that denied it
	Error  string `json:"error,omitempty"` // set when it could not be closed
}

type sweepPrograms struct {
	TCP     *ebpf.Program `ebpf:"shunt_policy_sweep_tcp"`
	UDP     *ebpf.Program `ebpf:"shunt_policy_sweep_udp"`
	Collect *ebpf.Program `ebpf:"shunt_policy_collect_tcp"`
}

func (s *sweepPrograms) pinned() map[string]**ebpf.Program {
	return map[string]**ebpf.Program{"sweep_tcp": &s.TCP, "sweep_udp": &s.UDP, "collect_tcp": &s.Collect}
}

func (s *sweepPrograms) Close() {
	for _, p := range s.pinned() {
		if *p != nil {
			(*p).Close()
		}
	}
}

// sweep runs the sweep iterators in every network namespace: each closes
// the connections that connected under a scope and that the rules in force
// now deny. Connections are destroyed (the application's next call fails
// with ECONNABORTED, a TCP peer gets a reset): a denied connection whose
// bytes bypass TCP would otherwise go on moving them.
// With peer rules in force it first writes down every connection's
// cgroups in every namespace (an accepted connection's peer may live in
// another), and forgets them after.
func (p *Policy) closeDenied(ctx context.Context, peerRules bool) ([]Closed, error) {
	if peerRules {
		defer p.forgetConnSenders()
		if err := p.collectSenders(ctx); err != nil {
			return nil, err
		}
	}
	var findsOnly uint32
	if err := p.maps.PolicyState.Lookup(uint32(policyPolicyStateKeyPOLICY_STATE_FINDS_ONLY), &findsOnly); err != nil {
		return nil, fmt.Errorf("read the policy state: %w", err)
	}
	byDiag := findsOnly == 1
	var iters []*link.Iter
	for _, prog := range []*ebpf.Program{p.sweep.TCP, p.sweep.UDP} {
		it, err := link.AttachIter(link.IterOptions{Program: prog})
		if err != nil {
			return nil, fmt.Errorf("attach the sweep: %w", err)
		}
		defer it.Close()
		iters = append(iters, it)
	}

	closed := []Closed{}
	for _, ns := range host.AllNetns() {
		if err := ctx.Err(); err != nil {
			return closed, err
		}
		var found []policyPolicySwept
		var sweepErr error
		// Iterators see the namespace of the thread that reads them.
		err := host.InNetns(ns.Path, func() error {
			for _, it := range iters {
				out, err := bpfiter.Read(it)
				found = append(found, bpfiter.Records[policyPolicySwept](out)...)
				if err != nil {
					sweepErr = err
					return nil
				}
			}
			if byDiag && len(found) > 0 {
				sweepErr = closeByDiag(p, found)
			}
			return nil
		})
		if err != nil {
			continue // the namespace went away
		}
		for _, f := range found {
			c := Closed{
				Proto:  sockindex.Proto(f.R.Proto).String(),
				Local:  netip.AddrPortFrom(netip.AddrFrom16(f.R.Local).Unmap(), f.R.LocalPort).String(),
				Remote: netip.AddrPortFrom(netip.AddrFrom16(f.R.Remote).Unmap(), f.R.RemotePort).String(),
				Cookie: f.R.Cookie, Rule: f.Rule,
			}
			if f.R.Err != 0 {
				c.Error = syscall.Errno(-f.R.Err).Error()
			}
			closed = append(closed, c)
		}
		if sweepErr != nil {
			return closed, fmt.Errorf("in %s: %w", ns.Path, sweepErr)
		}
	}
	return closed, nil
}

// closeByDiag closes what the iterators found through sock_diag, and counts
// each closed connection on its rule as the kfunc path does in BPF.
func closeByDiag(p *Policy, found []policyPolicySwept) error {
	socks := make([]sockindex.Socket, len(found))
	for i, f := range found {
		socks[i] = reap.FoundSocket(f.R.Proto, f.R.Family, f.R.Local, f.R.LocalPort, f.R.Remote, f.R.RemotePort, f.R.Cookie, f.R.NetnsCookie)
	}
	res, err := reap.DestroyHere(socks)
	if err != nil {
		return err
	}
	destroyed := map[uint64]bool{}
	for _, s := range res.Sockets {
		destroyed[s.Cookie] = s.Destroyed
	}
	for i := range found {
		f := &found[i]
		if !destroyed[f.R.Cookie] { // closed by its application meanwhile
			f.R.Err = -int32(syscall.ENOENT)
			continue
		}
		p.countClosed(f.Rule)
	}
	return nil
}

// countClosed adds one closed connection to a rule's counter on CPU 0.
func (p *Policy) countClosed(rule uint32) {
	var per []policyPolicyCounter
	if err := p.maps.PolicyCounters.Lookup(rule, &per); err != nil || len(per) == 0 {
		return
	}
	per[0].Closed++
	_ = p.maps.PolicyCounters.Update(rule, per, ebpf.UpdateExist)
}

// collectSenders runs the collector in every network namespace.
func (p *Policy) collectSenders(ctx context.Context) error {
	it, err := link.AttachIter(link.IterOptions{Program: p.sweep.Collect})
	if err != nil {
		return fmt.Errorf("attach the collector: %w", err)
	}
	defer it.Close()
	for _, ns := range host.AllNetns() {
		if err := ctx.Err(); err != nil {
			return err
		}
		var readErr error
		err := host.InNetns(ns.Path, func() error {
			_, readErr = bpfiter.Read(it)
			return nil
		})
		if err != nil {
			continue // the namespace went away
		}
		if readErr != nil {
			return fmt.Errorf("collect connections in %s: %w", ns.Path, readErr)
		}
	}
	return nil
}

// forgetConnSenders empties what collectSenders wrote.
func (p *Policy) forgetConnSenders() {
	var keys []policyPolicyFlow
	var k policyPolicyFlow
	var v policyPolicySender
	it := p.maps.PolicyConnSenders.Iterate()
	for it.Next(&k, &v) {
		keys = append(keys, k)
	}
	_ = deleteAll(p.maps.PolicyConnSenders, keys)
}
