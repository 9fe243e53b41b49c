package policy

import (
	"errors"
	"fmt"
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

// clearSlot deletes a slot's entries from every map; infos are the slot's
// rules (the trie's keys are derived from them: walking a trie costs a
// descent per key).
func (p *Policy) clearSlot(slot uint8, infos map[uint32]policyPolicyRuleInfo) error {
	var scopeKeys []policyPolicyScopeKey
	var sk policyPolicyScopeKey
	var sv policyPolicyScope
	it := p.maps.PolicyScopes.Iterate()
	for it.Next(&sk, &sv) {
		if sk.Slot == uint32(slot) {
			scopeKeys = append(scopeKeys, sk)
		}
	}
	if err := it.Err(); err != nil {
		return fmt.Errorf("clear ruleset %d: %w", slot, err)
	}
	infoKeys := make([]policyPolicyRuleKey, 0, len(infos))
	lpmKeys := map[policyPolicyKey]bool{}
	for id, info := range infos {
		infoKeys = append(infoKeys, policyPolicyRuleKey{Slot: uint32(slot), Rule: id})
		if !info.isDefault() {
			lpmKeys[lpmKey(slot, info.Scope, Direction(info.Dir), info.rule().CIDR)] = true
		}
	}
	// Scopes first: a scope without its rules would decide by its default.
	errs := []error{deleteAll(p.maps.PolicyScopes, scopeKeys)}
	for k := range lpmKeys {
		if err := p.maps.PolicyRules.Delete(k); err != nil && !errors.Is(err, ebpf.ErrKeyNotExist) {
			errs = append(errs, err)
		}
	}
	errs = append(errs, deleteAll(p.maps.PolicyRuleInfos, infoKeys))
	if err := errors.Join(errs...); err != nil {
		return fmt.Errorf("clear ruleset %d: %w", slot, err)
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

// write puts a compiled ruleset into its (idle) slot: counters first, so no
// rule decides before it can count; kept rules keep theirs.
func (c *compiled) write(p *Policy, old map[uint32]policyPolicyRuleInfo) error {
	var fresh []uint32
	for _, id := range c.ids {
		if _, kept := old[id]; !kept {
			fresh = append(fresh, id)
		}
	}
	if len(fresh) > 0 {
		ncpu, err := ebpf.PossibleCPU()
		if err != nil {
			return err
		}
		// A counter left by a crash is reset as a new one is made.
		if _, err := p.maps.PolicyCounters.BatchUpdate(fresh, make([]policyPolicyCounter, len(fresh)*ncpu), nil); err != nil {
			return fmt.Errorf("create rule counters: %w", err)
		}
	}
	ik := make([]policyPolicyRuleKey, 0, len(c.infos))
	iv := make([]policyPolicyRuleInfo, 0, len(c.infos))
	for k, v := range c.infos {
		ik, iv = append(ik, k), append(iv, v)
	}
	if err := updateAll(p.maps.PolicyRuleInfos, ik, iv, ebpf.UpdateAny); err != nil {
		return fmt.Errorf("write rules: %w", err)
	}
	// The trie takes no batches.
	for k, v := range c.lists {
		if err := p.maps.PolicyRules.Update(asBytes([]policyPolicyKey{k}), asBytes([]policyPolicyList{v}), ebpf.UpdateAny); err != nil {
			return fmt.Errorf("write rules: %w", err)
		}
	}
	sk := make([]policyPolicyScopeKey, 0, len(c.scopes))
	sv := make([]policyPolicyScope, 0, len(c.scopes))
	for k, v := range c.scopes {
		sk, sv = append(sk, k), append(sv, v)
	}
	if err := updateAll(p.maps.PolicyScopes, sk, sv, ebpf.UpdateAny); err != nil {
		return fmt.Errorf("write scopes: %w", err)
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
