package policy

import (
	"context"
	"errors"
	"fmt"
	"time"

	"github.com/cilium/ebpf"

	"github.com/shunt-project/shunt/host"
)

// flipGrace is how long the old ruleset stays readable after the flip.
const flipGrace = 10 * time.Millisecond

// ApplyResult says what an apply did.
type ApplyResult struct {
	Scopes int           `json:"scopes"`
	Rules  int           `json:"rules"`
	Closed []Closed      `json:"closed"` // open connections the new rules deny
	Took   time.Duration `json:"took_ns"`
	Sweep  time.Duration `json:"sweep_ns"` // of Took, closing open connections
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
	scopes, err := resolve(rs)
	if err != nil {
		return nil, err
	}
	old, err := p.activeSlot()
	if err != nil {
		return nil, err
	}
	next := old ^ 1

	// Counter ids: a rule already in force keeps its id, and its counts.
	oldInfos, err := p.infos(old)
	if err != nil {
		return nil, err
	}
	keep := map[string]uint32{}
	used := map[uint32]bool{}
	for id, info := range oldInfos {
		keep[info.key()] = id
		used[id] = true
	}
	nextID := uint32(1)
	id := func(key string) uint32 {
		if id, ok := keep[key]; ok {
			return id
		}
		for used[nextID] {
			nextID++
		}
		used[nextID] = true
		return nextID
	}
	c, err := compile(next, scopes, id)
	if err != nil {
		return nil, err
	}

	spec, err := loadPolicy()
	if err != nil {
		return nil, fmt.Errorf("load BPF spec: %w", err)
	}
	// What a crash left in the idle slot goes first.
	if err := p.clearSlot(next); err != nil {
		return nil, err
	}
	if err := c.write(p); err != nil {
		p.clearSlot(next)
		return nil, err
	}
	attached, err := p.attachedScopes()
	if err != nil {
		return nil, err
	}
	// New scopes' programs find no rules in the old slot and allow, as
	// before; they start deciding at the flip.
	for _, s := range scopes {
		if !attached[s.id] {
			if err := p.attach(spec, s); err != nil {
				p.clearSlot(next)
				return nil, err
			}
		}
	}
	if err := p.maps.PolicyActive.Update(uint32(0), uint32(next), ebpf.UpdateAny); err != nil {
		return nil, fmt.Errorf("switch to the new ruleset: %w", err)
	}
	// A program that read the old slot number just before the flip may
	// still be looking at the old slot: each runs for microseconds, so
	// waiting far longer than that before taking the old slot apart keeps
	// every decision wholly old or wholly new.
	time.Sleep(flipGrace)
	// Removed scopes find no rules in the new slot and allow from the flip.
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
	errs = append(errs, p.clearSlot(old))
	for oldID := range oldInfos {
		if !c.usesID(oldID) {
			if err := p.maps.PolicyCounters.Delete(oldID); err != nil && !errors.Is(err, ebpf.ErrKeyNotExist) {
				errs = append(errs, err)
			}
		}
	}
	if err := errors.Join(errs...); err != nil {
		return nil, fmt.Errorf("the new ruleset is in force, but cleaning up the old one failed: %w", err)
	}

	res := &ApplyResult{Scopes: len(scopes)}
	for _, s := range scopes {
		res.Rules += len(s.Egress)
	}
	sweepStart := time.Now()
	res.Closed, err = p.closeDenied(ctx)
	res.Sweep = time.Since(sweepStart)
	res.Took = time.Since(start)
	if err != nil {
		return res, fmt.Errorf("the new ruleset is in force, but closing the connections it denies failed: %w", err)
	}
	return res, nil
}

func (c *compiled) usesID(id uint32) bool {
	for _, x := range c.ids {
		if x == id {
			return true
		}
	}
	return false
}

// write puts a compiled ruleset into its (idle) slot: counters first, so no
// rule decides before it can count.
func (c *compiled) write(p *Policy) error {
	ncpu, err := ebpf.PossibleCPU()
	if err != nil {
		return err
	}
	zero := make([]policyPolicyCounter, ncpu)
	for _, id := range c.ids {
		err := p.maps.PolicyCounters.Update(id, zero, ebpf.UpdateNoExist)
		if err != nil && !errors.Is(err, ebpf.ErrKeyExist) {
			return fmt.Errorf("create rule counters: %w", err)
		}
	}
	for k, v := range c.infos {
		if err := p.maps.PolicyRuleInfos.Update(k, v, ebpf.UpdateAny); err != nil {
			return fmt.Errorf("write rules: %w", err)
		}
	}
	for k, v := range c.lists {
		if err := p.maps.PolicyRules.Update(k, v, ebpf.UpdateAny); err != nil {
			return fmt.Errorf("write rules: %w", err)
		}
	}
	for k, v := range c.scopes {
		if err := p.maps.PolicyScopes.Update(k, v, ebpf.UpdateAny); err != nil {
			return fmt.Errorf("write scopes: %w", err)
		}
	}
	return nil
}

// clearSlot deletes a slot's entries from every map.
func (p *Policy) clearSlot(slot uint8) error {
	var errs []error
	var sk policyPolicyScopeKey
	var sv policyPolicyScope
	var scopeKeys []policyPolicyScopeKey
	it := p.maps.PolicyScopes.Iterate()
	for it.Next(&sk, &sv) {
		if sk.Slot == uint32(slot) {
			scopeKeys = append(scopeKeys, sk)
		}
	}
	errs = append(errs, it.Err())
	// The trie's keys come from the rules: walking a trie costs a descent
	// per key.
	var ik policyPolicyRuleKey
	var iv policyPolicyRuleInfo
	var infoKeys []policyPolicyRuleKey
	ruleKeys := map[policyPolicyKey]bool{}
	it = p.maps.PolicyRuleInfos.Iterate()
	for it.Next(&ik, &iv) {
		if ik.Slot == uint32(slot) {
			infoKeys = append(infoKeys, ik)
			if iv.Seq != ^uint32(0) {
				ruleKeys[lpmKey(slot, iv.Scope, iv.rule().CIDR)] = true
			}
		}
	}
	errs = append(errs, it.Err())
	// Scopes first: a scope without its rules would decide by its default.
	for _, k := range scopeKeys {
		errs = append(errs, ignoreMissing(p.maps.PolicyScopes.Delete(k)))
	}
	for k := range ruleKeys {
		errs = append(errs, ignoreMissing(p.maps.PolicyRules.Delete(k)))
	}
	for _, k := range infoKeys {
		errs = append(errs, ignoreMissing(p.maps.PolicyRuleInfos.Delete(k)))
	}
	if err := errors.Join(errs...); err != nil {
		return fmt.Errorf("clear ruleset %d: %w", slot, err)
	}
	return nil
}

func ignoreMissing(err error) error {
	if errors.Is(err, ebpf.ErrKeyNotExist) {
		return nil
	}
	return err
}
