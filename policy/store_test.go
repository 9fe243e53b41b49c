package policy

import (
	"context"
	"math/rand/v2"
	"net/netip"
	"testing"

	"github.com/cilium/ebpf"

	"github.com/shunt-project/shunt/internal/testenv"
)

// slotContents reads what a slot holds in the trie and the scopes map.
func slotContents(t *testing.T, p *Policy, slot uint8) (map[policyPolicyKey]policyPolicyList, map[policyPolicyScopeKey]policyPolicyScope) {
	t.Helper()
	lists := map[policyPolicyKey]policyPolicyList{}
	var k policyPolicyKey
	var v policyPolicyList
	it := p.maps.PolicyRules.Iterate()
	for it.Next(&k, &v) {
		if k.Slot == slot {
			lists[k] = v
		}
	}
	if err := it.Err(); err != nil {
		t.Fatal(err)
	}
	scopes := map[policyPolicyScopeKey]policyPolicyScope{}
	var sk policyPolicyScopeKey
	var sv policyPolicyScope
	it = p.maps.PolicyScopes.Iterate()
	for it.Next(&sk, &sv) {
		if sk.Slot == uint32(slot) {
			scopes[sk] = sv
		}
	}
	if err := it.Err(); err != nil {
		t.Fatal(err)
	}
	return lists, scopes
}

// randomRuleset draws rules from a small pool, so that successive rulesets
// share some rules, prefixes and covering prefixes, and differ in others.
func randomRuleset(r *rand.Rand, cgroup string) Ruleset {
	s := Scope{Cgroup: cgroup, Default: Action(1 + r.IntN(2)), IngressDefault: Action(1 + r.IntN(2))}
	seen := map[Rule]bool{}
	for range r.IntN(40) {
		bits := []int{8, 16, 24, 32}[r.IntN(4)]
		a := netip.AddrFrom4([4]byte{10, byte(r.IntN(2)), byte(r.IntN(3)), byte(r.IntN(3))})
		rule := Rule{Action: Action(1 + r.IntN(2)), CIDR: netip.PrefixFrom(a, bits).Masked(), Ports: AnyPort}
		if r.IntN(2) == 0 {
			p := uint16(80 + r.IntN(3))
			rule.Ports = Ports{p, p}
		}
		if seen[rule] {
			continue
		}
		seen[rule] = true
		if r.IntN(3) == 0 {
			s.Ingress = append(s.Ingress, rule)
		} else {
			s.Egress = append(s.Egress, rule)
		}
	}
	return Ruleset{Scopes: []Scope{s}}
}

// interrupt leaves the idle slot as an apply of scopes stopped half way
// would: marked unclean, the rule infos written, the lists too if lists.
func interrupt(t *testing.T, p *Policy, scopes []scopeRules, id func(ruleName) uint32, lists bool) {
	t.Helper()
	active, _ := p.activeSlot()
	c, err := compile(active^1, scopes, id)
	if err != nil {
		t.Fatal(err)
	}
	if err := p.setState(policyPolicyStateKeyPOLICY_STATE_IDLE_CLEAN, 0); err != nil {
		t.Fatal(err)
	}
	for k, v := range c.infos {
		if err := p.maps.PolicyRuleInfos.Update(k, v, ebpf.UpdateAny); err != nil {
			t.Fatal(err)
		}
	}
	for k, v := range c.lists {
		if lists {
			if err := p.maps.PolicyRules.Update(k, v, ebpf.UpdateAny); err != nil {
				t.Fatal(err)
			}
		}
	}
}

// TestIdleSlotWritesMatchAFullWrite: after every apply of a sequence of
// rulesets (each written over the one before the one in force, only what
// differs), the slot in force holds exactly what compiling the ruleset
// gives; also after a write that was interrupted half way.
func TestIdleSlotWritesMatchAFullWrite(t *testing.T) {
	testenv.RequireRoot(t)
	p, err := Create(testenv.MustPinDir(t), Options{})
	if err != nil {
		t.Fatal(err)
	}
	t.Cleanup(func() { p.Remove() })
	cg := testenv.MustCgroup(t)
	r := rand.New(rand.NewPCG(1, 2))
	check := func(i int, rs Ruleset) {
		t.Helper()
		slot, err := p.activeSlot()
		if err != nil {
			t.Fatal(err)
		}
		scopes, err := resolve(rs)
		if err != nil {
			t.Fatal(err)
		}
		infos, err := p.allInfos()
		if err != nil {
			t.Fatal(err)
		}
		ids := map[ruleName]uint32{}
		for id, info := range infos[slot] {
			ids[info.name()] = id
		}
		want, err := compile(slot, scopes, func(n ruleName) uint32 { return ids[n] })
		if err != nil {
			t.Fatal(err)
		}
		lists, scopeVals := slotContents(t, p, slot)
		if len(lists) != len(want.lists) || len(scopeVals) != len(want.scopes) || len(infos[slot]) != len(want.infos) {
			t.Fatalf("apply %d: slot holds %d lists, %d scopes, %d infos; want %d, %d, %d",
				i, len(lists), len(scopeVals), len(infos[slot]), len(want.lists), len(want.scopes), len(want.infos))
		}
		for k, v := range want.lists {
			if lists[k] != v {
				t.Fatalf("apply %d: list %+v differs", i, k)
			}
		}
		for k, v := range want.scopes {
			if scopeVals[k] != v {
				t.Fatalf("apply %d: scope %+v differs", i, k)
			}
		}
	}
	for i := range 40 {
		rs := randomRuleset(r, cg.Path)
		switch i {
		case 20:
			// An apply interrupted after writing part of another ruleset
			// into the idle slot: entries of its own, each with its info.
			junk, err := resolve(randomRuleset(r, cg.Path))
			if err != nil {
				t.Fatal(err)
			}
			junkID := uint32(9000)
			interrupt(t, p, junk, func(ruleName) uint32 { junkID++; return junkID }, true)
		case 30:
			// An apply of rs interrupted after writing its rule infos,
			// before its lists: the infos say what the trie lacks.
			scopes, err := resolve(rs)
			if err != nil {
				t.Fatal(err)
			}
			active, _ := p.activeSlot()
			infos, err := p.allInfos()
			if err != nil {
				t.Fatal(err)
			}
			interrupt(t, p, scopes, idsAfter(infos[active]), false)
		}
		if _, err := p.Apply(context.Background(), rs); err != nil {
			t.Fatal(err)
		}
		check(i, rs)
	}
}
