package policy

import (
	"cmp"
	"errors"
	"fmt"
	"net/netip"
	"slices"

	"github.com/cilium/ebpf"

	"github.com/shunt-project/shunt/host"
)

// Counts are what a rule (or a scope's default) decided since it was
// installed, over every CPU.
type Counts struct {
	Connects uint64 `json:"connects"` // connect() calls
	Sends    uint64 `json:"sends"`    // unconnected UDP sends
	Closed   uint64 `json:"closed"`   // open connections closed by an apply
}

// RuleReport is a rule in force with its counts.
type RuleReport struct {
	Rule
	ID     uint32 `json:"id"`
	Counts Counts `json:"counts"`
}

// ScopeReport is a scope in force with its rules and counts.
type ScopeReport struct {
	Cgroup   string       `json:"cgroup"` // "" when the cgroup was removed
	CgroupID uint64       `json:"cgroup_id"`
	Default  Action       `json:"default"`
	Counts   Counts       `json:"default_counts"` // decided by the default
	Egress   []RuleReport `json:"egress"`
}

// Report is the ruleset in force.
type Report struct {
	Scopes []ScopeReport `json:"scopes"`
}

// key names the rule as ruleKey does, for matching across applies.
func (i policyPolicyRuleInfo) key() string {
	if i.Seq == ^uint32(0) {
		return ruleKey(i.Scope, nil)
	}
	r := i.rule()
	return ruleKey(i.Scope, &r)
}

func (i policyPolicyRuleInfo) rule() Rule {
	var a netip.Addr
	if i.Family == 4 {
		a = netip.AddrFrom4([4]byte(i.Addr[:4]))
	} else {
		a = netip.AddrFrom16(i.Addr)
	}
	return Rule{
		Action: Action(i.Action), CIDR: netip.PrefixFrom(a, int(i.Bits)),
		Ports: Ports{i.PortLo, i.PortHi}, Proto: Proto(i.Proto),
	}
}

// infos reads a slot's rules by counter id.
func (p *Policy) infos(slot uint8) (map[uint32]policyPolicyRuleInfo, error) {
	out := map[uint32]policyPolicyRuleInfo{}
	var k policyPolicyRuleKey
	var v policyPolicyRuleInfo
	it := p.maps.PolicyRuleInfos.Iterate()
	for it.Next(&k, &v) {
		if k.Slot == uint32(slot) {
			out[k.Rule] = v
		}
	}
	if err := it.Err(); err != nil {
		return nil, fmt.Errorf("read rules: %w", err)
	}
	return out, nil
}

func (p *Policy) counts(id uint32) (Counts, error) {
	var per []policyPolicyCounter
	if err := p.maps.PolicyCounters.Lookup(id, &per); err != nil {
		if errors.Is(err, ebpf.ErrKeyNotExist) {
			return Counts{}, nil
		}
		return Counts{}, fmt.Errorf("read counters: %w", err)
	}
	var c Counts
	for _, v := range per {
		c.Connects += v.Connects
		c.Sends += v.Sends
		c.Closed += v.Closed
	}
	return c, nil
}

// Show reads the ruleset in force with every rule's counts, scopes in
// cgroup path order and rules in the order they were given.
func (p *Policy) Show() (*Report, error) {
	slot, err := p.activeSlot()
	if err != nil {
		return nil, err
	}
	infos, err := p.infos(slot)
	if err != nil {
		return nil, err
	}
	scopes := map[uint64]*ScopeReport{}
	var ids []uint64
	scope := func(id uint64) *ScopeReport {
		if s, ok := scopes[id]; ok {
			return s
		}
		s := &ScopeReport{CgroupID: id, Egress: []RuleReport{}}
		scopes[id] = s
		ids = append(ids, id)
		return s
	}
	seqs := map[uint32]uint32{}
	for id, info := range infos {
		s := scope(info.Scope)
		c, err := p.counts(id)
		if err != nil {
			return nil, err
		}
		if info.Seq == ^uint32(0) {
			s.Default, s.Counts = Action(info.Action), c
			continue
		}
		seqs[id] = info.Seq
		s.Egress = append(s.Egress, RuleReport{Rule: info.rule(), ID: id, Counts: c})
	}
	paths := host.CgroupPathsByID(ids)
	rep := &Report{Scopes: []ScopeReport{}}
	for _, id := range ids {
		s := scopes[id]
		s.Cgroup = paths[id]
		slices.SortFunc(s.Egress, func(a, b RuleReport) int { return cmp.Compare(seqs[a.ID], seqs[b.ID]) })
		rep.Scopes = append(rep.Scopes, *s)
	}
	slices.SortFunc(rep.Scopes, func(a, b ScopeReport) int {
		return cmp.Or(cmp.Compare(a.Cgroup, b.Cgroup), cmp.Compare(a.CgroupID, b.CgroupID))
	})
	return rep, nil
}

// Ruleset is the ruleset in force, as a file would give it. Scopes whose
// cgroup was removed are left out: there is nothing left for them to hold.
func (r Report) Ruleset() Ruleset {
	rs := Ruleset{Scopes: []Scope{}}
	for _, s := range r.Scopes {
		if s.Cgroup == "" {
			continue
		}
		sc := Scope{Cgroup: s.Cgroup, Default: s.Default}
		for _, r := range s.Egress {
			sc.Egress = append(sc.Egress, r.Rule)
		}
		rs.Scopes = append(rs.Scopes, sc)
	}
	return rs
}
