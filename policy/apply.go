package policy

import (
	"context"
	"errors"
	"fmt"
	"os"
	"path/filepath"
	"runtime"
	"slices"
	"time"

	"github.com/cilium/ebpf"
	"golang.org/x/sys/unix"

	"github.com/shunt-project/shunt/host"
)

// waitForReaders returns once every BPF program that started before it
// has finished: they run inside RCU read-side sections, and
// membarrier(MEMBARRIER_CMD_GLOBAL) waits for an RCU grace period (about
// 8-24 ms here). Where it does not (it refuses under nohz_full, and skips
// the wait with one CPU online), a pause a thousand times a program's run.
func waitForReaders() {
	const cmdGlobal = 1 // MEMBARRIER_CMD_GLOBAL
	_, _, errno := unix.Syscall(unix.SYS_MEMBARRIER, cmdGlobal, 0, 0)
	if errno != 0 || runtime.NumCPU() == 1 {
		time.Sleep(10 * time.Millisecond)
	}
}

// ApplyResult says what an apply did.
type ApplyResult struct {
	Scopes int           `json:"scopes"`
	Rules  int           `json:"rules"`
	Closed []Closed      `json:"closed"` // open connections the new rules deny
	Took   time.Duration `json:"took_ns"`
	Sweep  time.Duration `json:"sweep_ns"` // of Took, closing open connections
}

// idsAfter gives counter ids for a ruleset replacing inForce: a rule in
// force keeps its id, and its counts; a new one takes the lowest id free.
func idsAfter(inForce map[uint32]policyPolicyRuleInfo) func(ruleName) uint32 {
	keep := make(map[ruleName]uint32, len(inForce))
	used := make(map[uint32]bool, len(inForce))
	for id, info := range inForce {
		keep[info.name()] = id
		used[id] = true
	}
	next := uint32(1)
	return func(key ruleName) uint32 {
		if id, ok := keep[key]; ok {
			return id
		}
		for used[next] {
			next++
		}
		used[next] = true
		return next
	}
}

// Validate checks a ruleset as Apply would, cgroups included, without
// installing anything.
func Validate(rs Ruleset) error {
	_, err := resolve(rs)
	return err
}

// resolve finds each scope's cgroup. A cgroup that does not exist is the
// caller's mistake, named like any other field.
func resolve(rs Ruleset) ([]scopeRules, error) {
	if err := rs.Check(); err != nil {
		return nil, err
	}
	out := make([]scopeRules, 0, len(rs.Scopes))
	seen := map[uint64]int{}
	for i, s := range rs.Scopes {
		cg, err := host.ResolveCgroup(s.Cgroup)
		if err != nil {
			return nil, &InputError{Where: fmt.Sprintf("scope %d", i+1), Field: "cgroup", Err: err}
		}
		if j, dup := seen[cg.ID]; dup {
			return nil, &InputError{Where: fmt.Sprintf("scope %d (%s)", i+1, s.Cgroup), Field: "cgroup", Err: fmt.Errorf("the same cgroup as scope %d", j)}
		}
		seen[cg.ID] = i + 1
		s.Cgroup = cg.Path
		// Peer rules: the cgroup each names, resolved in a copy.
		s.Ingress = slices.Clone(s.Ingress)
		for j := range s.Ingress {
			r := &s.Ingress[j]
			if !r.IsPeer() {
				continue
			}
			where := fmt.Sprintf("scope %d (%s) ingress rule %d", i+1, s.Cgroup, j+1)
			peer, err := host.ResolveCgroup(r.Peer)
			if err != nil {
				return nil, &InputError{Where: where, Field: "peer_cgroup", Err: err}
			}
			if lv := peer.Level(); lv > maxPeerLevel {
				return nil, &InputError{Where: where, Field: "peer_cgroup", Err: fmt.Errorf("%s is %d levels deep: peer rules see %d", peer.Path, lv, maxPeerLevel)}
			}
			r.Peer, r.peer = peer.Path, peer.ID
		}
		out = append(out, scopeRules{Scope: s, id: cg.ID})
	}
	return out, nil
}

// Apply replaces the whole ruleset. The new one is written beside the one
// in force and takes over with a single map write, so every connect and
// send meets either the old rules or the new ones. Then the open
// connections the new rules deny are closed (Closed).
func (p *Policy) Apply(ctx context.Context, rs Ruleset) (*ApplyResult, error) {
	start := time.Now()
	// A program that read the slot number just before the last apply's
	// flip may still be reading the slot this apply rewrites: one grace
	// period from now, which passes while the new ruleset is compiled,
	// they are done.
	readersGone := make(chan struct{})
	go func() {
		waitForReaders()
		close(readersGone)
	}()
	scopes, err := resolve(rs)
	if err != nil {
		return nil, err
	}
	if err := p.canEnforce(scopes); err != nil {
		return nil, err
	}
	old, err := p.activeSlot()
	if err != nil {
		return nil, err
	}
	next := old ^ 1
	infos, err := p.allInfos()
	if err != nil {
		return nil, err
	}
	c, err := p.writeNext(next, scopes, infos[next], infos[old], readersGone)
	if err != nil {
		return nil, err
	}
	attached, err := p.attachedScopes()
	if err != nil {
		return nil, err
	}
	peers, err := p.attachNew(scopes, attached)
	if err != nil {
		return nil, err
	}
	if err := p.setState(policyPolicyStateKeyPOLICY_STATE_ACTIVE, uint32(next)); err != nil {
		return nil, fmt.Errorf("switch to the new ruleset: %w", err)
	}
	// A program that read the old slot number just before the flip may
	// still be looking at the old slot: the next apply waits before it
	// rewrites it.
	if err := p.detachRetired(scopes, attached, peers); err != nil {
		return nil, fmt.Errorf("the new ruleset is in force, but cleaning up the old one failed: %w", err)
	}
	return p.afterFlip(ctx, start, scopes, len(peers) > 0, infos[old], c)
}

// writeNext compiles scopes into slot next, the idle one, and writes there
// what differs from what it holds (the ruleset before the one in force, or
// what a crash left), once readersGone says no program reads it any more.
// Counter ids: a rule already in force keeps its id, and its counts.
func (p *Policy) writeNext(next uint8, scopes []scopeRules, idleInfos, oldInfos map[uint32]policyPolicyRuleInfo, readersGone <-chan struct{}) (*compiled, error) {
	// What the idle slot holds is compiled back from its infos while the
	// new ruleset is compiled.
	var idle idleSlot
	idleRead := make(chan struct{})
	go func() {
		idle.prev, idle.exact, idle.err = p.idleContents(next, idleInfos)
		close(idleRead)
	}()
	c, err := compile(next, scopes, idsAfter(oldInfos))
	<-idleRead
	if err != nil {
		return nil, err
	}
	if idle.err != nil {
		return nil, idle.err
	}
	<-readersGone
	if err := p.writeIdle(next, c, idle, idleInfos, oldInfos); err != nil {
		return nil, err
	}
	return c, nil
}

// attachNew attaches the programs of scopes not attached yet (whose
// programs find no rules in the old slot and allow, as before: they start
// deciding at the flip), and the sender programs of the cgroups peer rules
// name, which write their senders down from before the rules are in force.
// Returns those cgroups.
func (p *Policy) attachNew(scopes []scopeRules, attached map[uint64]bool) (map[uint64]bool, error) {
	var spec *ebpf.CollectionSpec
	for _, s := range scopes {
		if complete, ok := attached[s.id]; ok && complete {
			continue
		}
		if spec == nil {
			var err error
			if spec, err = loadPolicy(); err != nil {
				return nil, fmt.Errorf("load BPF spec: %w", err)
			}
		}
		if err := p.attach(spec, s); err != nil {
			return nil, err
		}
	}
	return p.attachPeers(spec, scopes)
}

// detachRetired detaches, after the flip, the scopes not in force any more
// (they find no rules in the new slot and allow from the flip) and the
// sender programs of cgroups no peer rule names now.
func (p *Policy) detachRetired(scopes []scopeRules, attached, peers map[uint64]bool) error {
	inForce := map[uint64]bool{}
	for _, s := range scopes {
		inForce[s.id] = true
	}
	var errs []error
	for id := range attached {
		if !inForce[id] {
			errs = append(errs, p.detach(id))
		}
	}
	errs = append(errs, p.detachPeersBut(peers))
	return errors.Join(errs...)
}

// afterFlip closes the connections the new ruleset denies while the old
// rules' counters go, and says what the apply did.
func (p *Policy) afterFlip(ctx context.Context, start time.Time, scopes []scopeRules, peerRules bool, oldInfos map[uint32]policyPolicyRuleInfo, c *compiled) (*ApplyResult, error) {
	dropped := make(chan error, 1)
	go func() { dropped <- p.dropCounters(oldInfos, c) }()
	res := &ApplyResult{Scopes: len(scopes)}
	for _, s := range scopes {
		res.Rules += len(s.Egress) + len(s.Ingress)
	}
	sweepStart := time.Now()
	var err error
	res.Closed, err = p.closeDenied(ctx, peerRules)
	res.Sweep = time.Since(sweepStart)
	derr := <-dropped
	res.Took = time.Since(start)
	if err != nil {
		return res, fmt.Errorf("the new ruleset is in force, but closing the connections it denies failed: %w", err)
	}
	if derr != nil {
		return res, fmt.Errorf("the new ruleset is in force, but cleaning up the old one failed: %w", derr)
	}
	return res, nil
}

// canEnforce refuses peer rules on an install whose programs predate them:
// they would be written and never looked at.
func (p *Policy) canEnforce(scopes []scopeRules) error {
	if _, err := os.Stat(filepath.Join(p.dir, legacyDir)); err != nil {
		return nil
	}
	for _, s := range scopes {
		for _, r := range s.Ingress {
			if r.IsPeer() {
				return fmt.Errorf("the policy at %s was installed by an older shunt whose programs do not enforce peer rules: remove it with 'shunt policy clear' and apply again", p.dir)
			}
		}
	}
	return nil
}
