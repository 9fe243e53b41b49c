package policy

import (
	"cmp"
	"errors"
	"fmt"
	"slices"
	"unsafe"

	"github.com/cilium/ebpf"
)

// The maps hold up to 2 x 17,408 rules: reading and writing them key by
// key would cost two system calls each, so whole slices go in batches
// (typed: cilium/ebpf counts a batch by its slice's length, and passes
// bpf2go's twins without copying).

// asBytes views a slice of bpf2go's twins (laid out as in C, padding
// spelled out) as the bytes the kernel reads.
func asBytes[T any](s []T) []byte {
	if len(s) == 0 {
		return nil
	}
	return unsafe.Slice((*byte)(unsafe.Pointer(&s[0])), len(s)*int(unsafe.Sizeof(s[0])))
}

const batchLen = 4096

// allInfos reads every slot's rules, by slot and counter id.
func (p *Policy) allInfos() (map[uint8]map[uint32]policyPolicyRuleInfo, error) {
	out := map[uint8]map[uint32]policyPolicyRuleInfo{0: {}, 1: {}}
	keys := make([]policyPolicyRuleKey, batchLen)
	vals := make([]policyPolicyRuleInfo, batchLen)
	var cursor ebpf.MapBatchCursor
	for {
		n, err := p.maps.PolicyRuleInfos.BatchLookup(&cursor, keys, vals, nil)
		for i := range n {
			out[uint8(keys[i].Slot&1)][keys[i].Rule] = vals[i]
		}
		if errors.Is(err, ebpf.ErrKeyNotExist) {
			return out, nil
		}
		if err != nil {
			return nil, fmt.Errorf("read rules: %w", err)
		}
	}
}

// idleSlot is what idleContents found.
type idleSlot struct {
	prev  *compiled
	exact bool
	err   error
}

// idleContents is what the idle slot holds, compiled again from its rule
// infos; with exact false (a write to it was interrupted) only its keys
// are known, and every entry is written again.
func (p *Policy) idleContents(slot uint8, infos map[uint32]policyPolicyRuleInfo) (prev *compiled, exact bool, err error) {
	var clean uint32
	if err := p.maps.PolicyState.Lookup(uint32(policyPolicyStateKeyPOLICY_STATE_IDLE_CLEAN), &clean); err != nil {
		return nil, false, fmt.Errorf("read the policy state: %w", err)
	}
	// Each scope's rules in the order given (seq), with their ids.
	type seqRule struct {
		seq uint32
		id  uint32
		r   Rule
	}
	byScope := map[uint64]*scopeRules{}
	rules := map[uint64]*[2][]seqRule{}
	var order []uint64
	for id, info := range infos {
		s := byScope[info.Scope]
		if s == nil {
			s = &scopeRules{id: info.Scope}
			byScope[info.Scope] = s
			rules[info.Scope] = &[2][]seqRule{}
			order = append(order, info.Scope)
		}
		d := Direction(info.Dir)
		if info.isDefault() {
			*s.DefaultOf(d) = Action(info.Action)
			s.defaultID[d] = id
			continue
		}
		rules[info.Scope][d] = append(rules[info.Scope][d], seqRule{info.Seq, id, info.rule()})
	}
	scopes := make([]scopeRules, 0, len(order))
	ids := make([][2][]uint32, 0, len(order))
	for _, sid := range order {
		s := byScope[sid]
		var sids [2][]uint32
		for _, d := range Directions {
			rs := rules[sid][d]
			slices.SortFunc(rs, func(a, b seqRule) int { return cmp.Compare(a.seq, b.seq) })
			for _, r := range rs {
				*s.Rules(d) = append(*s.Rules(d), r.r)
				sids[d] = append(sids[d], r.id)
			}
		}
		scopes = append(scopes, *s)
		ids = append(ids, sids)
	}
	prev, err = compileWithIDs(slot, scopes, ids)
	if err != nil {
		return nil, false, fmt.Errorf("read the idle ruleset: %w", err)
	}
	if clean == 1 {
		return prev, true, nil
	}
	// Scopes written before their rules' infos are not in the infos.
	var sk policyPolicyScopeKey
	var sv policyPolicyScope
	it := p.maps.PolicyScopes.Iterate()
	for it.Next(&sk, &sv) {
		if sk.Slot == uint32(slot) {
			prev.scopes[sk] = policyPolicyScope{}
		}
	}
	return prev, false, it.Err()
}

// writeIdle makes the idle slot hold c: it deletes what c lacks and writes
// what differs, marked unclean meanwhile so a crash leads the next apply to
// write everything. Rule infos go first and leave last, so every trie entry
// has its info (the next apply finds the trie's keys through them).
func (p *Policy) writeIdle(slot uint8, c *compiled, held idleSlot, idle, inForce map[uint32]policyPolicyRuleInfo) error {
	prev, exact := held.prev, held.exact
	if err := p.setState(policyPolicyStateKeyPOLICY_STATE_IDLE_CLEAN, 0); err != nil {
		return err
	}
	// Trie entries the new ruleset lacks go while the counters and infos
	// are written (other maps, other locks): a system call each.
	deleted := make(chan error, 1)
	go func() {
		for k := range prev.lists {
			if _, keep := c.lists[k]; !keep {
				if err := p.maps.PolicyRules.Delete(k); err != nil && !errors.Is(err, ebpf.ErrKeyNotExist) {
					deleted <- fmt.Errorf("delete rules: %w", err)
					return
				}
			}
		}
		deleted <- nil
	}()
	if err := c.writeCounters(p, inForce); err != nil {
		return errors.Join(err, <-deleted)
	}
	var ik []policyPolicyRuleKey
	var iv []policyPolicyRuleInfo
	// Infos are compared with what the map holds, not with prev: a slot
	// a crash left may hold two of one rule or default.
	for k, v := range c.infos {
		if old, ok := idle[k.Rule]; !ok || old != v {
			ik, iv = append(ik, k), append(iv, v)
		}
	}
	err := updateAll(p.maps.PolicyRuleInfos, ik, iv, ebpf.UpdateAny)
	if derr := <-deleted; derr != nil {
		return derr
	}
	if err != nil {
		return fmt.Errorf("write rules: %w", err)
	}
	// The trie takes no batches: a system call per entry, while the other
	// maps are brought in line beside it. The infos of rules that go may
	// leave now: their trie entries are gone.
	others := make(chan error, 1)
	go func() { others <- p.writeIdleOthers(slot, c, prev, exact, idle) }()
	var err2 error
	for k, v := range c.lists {
		if old, ok := prev.lists[k]; exact && ok && old == v {
			continue
		}
		if err := p.maps.PolicyRules.Update(asBytes([]policyPolicyKey{k}), asBytes([]policyPolicyList{v}), ebpf.UpdateAny); err != nil {
			err2 = fmt.Errorf("write rules: %w", err)
			break
		}
	}
	if err := errors.Join(err2, <-others); err != nil {
		return err
	}
	return p.setState(policyPolicyStateKeyPOLICY_STATE_IDLE_CLEAN, 1)
}

// writeIdleOthers brings the idle slot's peer rules and scopes in line
// with c, and deletes the infos of rules c lacks.
func (p *Policy) writeIdleOthers(slot uint8, c, prev *compiled, exact bool, idle map[uint32]policyPolicyRuleInfo) error {
	stalePeers, pk, pv := changes(prev.peers, c.peers, exact)
	if err := deleteAll(p.maps.PolicyPeerRules, stalePeers); err != nil {
		return fmt.Errorf("delete peer rules: %w", err)
	}
	if err := updateAll(p.maps.PolicyPeerRules, pk, pv, ebpf.UpdateAny); err != nil {
		return fmt.Errorf("write peer rules: %w", err)
	}
	staleScopes, sk, sv := changes(prev.scopes, c.scopes, exact)
	if err := deleteAll(p.maps.PolicyScopes, staleScopes); err != nil {
		return fmt.Errorf("delete scopes: %w", err)
	}
	if err := updateAll(p.maps.PolicyScopes, sk, sv, ebpf.UpdateAny); err != nil {
		return fmt.Errorf("write scopes: %w", err)
	}
	var staleInfos []policyPolicyRuleKey
	for id := range idle {
		k := policyPolicyRuleKey{Slot: uint32(slot), Rule: id}
		if _, keep := c.infos[k]; !keep {
			staleInfos = append(staleInfos, k)
		}
	}
	if err := deleteAll(p.maps.PolicyRuleInfos, staleInfos); err != nil {
		return fmt.Errorf("delete rules: %w", err)
	}
	return nil
}

// changes lists the keys of prev that next lacks, and the entries of next
// that prev does not hold (all of them unless exact).
func changes[K, V comparable](prev, next map[K]V, exact bool) (stale, keys []K, vals []V) {
	for k := range prev {
		if _, keep := next[k]; !keep {
			stale = append(stale, k)
		}
	}
	for k, v := range next {
		if old, ok := prev[k]; !exact || !ok || old != v {
			keys, vals = append(keys, k), append(vals, v)
		}
	}
	return stale, keys, vals
}

func (p *Policy) setState(k policyPolicyStateKey, v uint32) error {
	if err := p.maps.PolicyState.Update(uint32(k), v, ebpf.UpdateAny); err != nil {
		return fmt.Errorf("write the policy state: %w", err)
	}
	return nil
}

// deleteAll deletes keys in batches. A batch stops at a missing key, so
// what follows it is deleted one by one.
func deleteAll[K any](m *ebpf.Map, keys []K) error {
	for len(keys) > 0 {
		chunk := keys[:min(len(keys), batchLen)]
		n, err := m.BatchDelete(chunk, nil)
		if err != nil && !errors.Is(err, ebpf.ErrKeyNotExist) {
			return err
		}
		if err != nil { // skip the missing key
			n++
		}
		keys = keys[min(n, len(keys)):]
	}
	return nil
}

// updateAll writes keys and values in batches.
func updateAll[K, V any](m *ebpf.Map, keys []K, vals []V, flags ebpf.MapUpdateFlags) error {
	for i := 0; i < len(keys); i += batchLen {
		j := min(i+batchLen, len(keys))
		if _, err := m.BatchUpdate(keys[i:j], vals[i:j], &ebpf.BatchOptions{ElemFlags: uint64(flags)}); err != nil {
			return err
		}
	}
	return nil
}

// writeCounters makes the counters of rules not in force yet, at zero (a
// counter a crash left is reset); rules in force keep theirs.
func (c *compiled) writeCounters(p *Policy, inForce map[uint32]policyPolicyRuleInfo) error {
	var fresh []uint32
	for _, id := range c.ids {
		if _, kept := inForce[id]; !kept {
			fresh = append(fresh, id)
		}
	}
	if len(fresh) == 0 {
		return nil
	}
	ncpu, err := ebpf.PossibleCPU()
	if err != nil {
		return err
	}
	if _, err := p.maps.PolicyCounters.BatchUpdate(fresh, make([]policyPolicyCounter, len(fresh)*ncpu), nil); err != nil {
		return fmt.Errorf("create rule counters: %w", err)
	}
	return nil
}

// dropCounters deletes the counters of old rules the new ruleset lacks.
func (p *Policy) dropCounters(old map[uint32]policyPolicyRuleInfo, c *compiled) error {
	inUse := make(map[uint32]bool, len(c.ids))
	for _, id := range c.ids {
		inUse[id] = true
	}
	var gone []uint32
	for id := range old {
		if !inUse[id] {
			gone = append(gone, id)
		}
	}
	return deleteAll(p.maps.PolicyCounters, gone)
}
