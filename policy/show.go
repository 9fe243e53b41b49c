package policy

import (
	"cmp"
	"encoding/binary"
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

// RulesReport is one direction of a scope: its default and rules, with
// their counts.
type RulesReport struct {
	Default       Action       `json:"default"`
	DefaultID     uint32       `json:"default_id"` // the default's counter id
	DefaultCounts Counts       `json:"default_counts"`
	Rules         []RuleReport `json:"rules"`
}

// ScopeReport is a scope in force.
type ScopeReport struct {
	Cgroup   string      `json:"cgroup"` // "" when the cgroup was removed
	CgroupID uint64      `json:"cgroup_id"`
	Egress   RulesReport `json:"egress"`
	Ingress  RulesReport `json:"ingress"`
}

// Of returns one direction of the scope.
func (s *ScopeReport) Of(d Direction) *RulesReport {
	if d == Ingress {
		return &s.Ingress
	}
	return &s.Egress
}

// Report is the ruleset in force.
type Report struct {
	Scopes []ScopeReport `json:"scopes"`
}

// name names the rule as nameOf does, for matching across applies.
func (i policyPolicyRuleInfo) name() ruleName {
	if i.isDefault() {
		return nameOf(i.Scope, Direction(i.Dir), nil)
	}
	r := i.rule()
	return nameOf(i.Scope, Direction(i.Dir), &r)
}

// isDefault: the entry is a scope's default, not a rule.
func (i policyPolicyRuleInfo) isDefault() bool { return i.Seq == ^uint32(0) }

func (i policyPolicyRuleInfo) rule() Rule {
	if i.Family == 0 { // a peer rule; Show fills in the path
		return Rule{Action: Action(i.Action), Ports: Ports{i.PortLo, i.PortHi}, Proto: Proto(i.Proto), peer: i.peerID()}
	}
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

// peerID is a peer rule's cgroup id.
func (i policyPolicyRuleInfo) peerID() uint64 { return binary.LittleEndian.Uint64(i.Addr[:8]) }

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
	all, err := p.allInfos()
	if err != nil {
		return nil, err
	}
	infos := all[slot]
	scopes := map[uint64]*ScopeReport{}
	var ids []uint64
	scope := func(id uint64) *ScopeReport {
		if s, ok := scopes[id]; ok {
			return s
		}
		s := &ScopeReport{CgroupID: id, Egress: RulesReport{Rules: []RuleReport{}}, Ingress: RulesReport{Rules: []RuleReport{}}}
		scopes[id] = s
		ids = append(ids, id)
		return s
	}
	seqs := map[uint32]uint32{}
	for id, info := range infos {
		rr := scope(info.Scope).Of(Direction(info.Dir))
		c, err := p.counts(id)
		if err != nil {
			return nil, err
		}
		if info.isDefault() {
			rr.Default, rr.DefaultID, rr.DefaultCounts = Action(info.Action), id, c
			continue
		}
		seqs[id] = info.Seq
		rr.Rules = append(rr.Rules, RuleReport{Rule: info.rule(), ID: id, Counts: c})
	}
	lookup := slices.Clone(ids)
	for _, info := range infos {
		if !info.isDefault() && info.Family == 0 {
			lookup = append(lookup, info.peerID())
		}
	}
	paths := host.CgroupPathsByID(lookup)
	rep := &Report{Scopes: []ScopeReport{}}
	for _, id := range ids {
		s := scopes[id]
		s.Cgroup = paths[id]
		for i := range s.Ingress.Rules {
			if r := &s.Ingress.Rules[i].Rule; r.peer != 0 {
				r.Peer = paths[r.peer] // "" when the cgroup was removed
			}
		}
		for _, d := range Directions {
			slices.SortFunc(s.Of(d).Rules, func(a, b RuleReport) int { return cmp.Compare(seqs[a.ID], seqs[b.ID]) })
		}
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
		sc := Scope{Cgroup: s.Cgroup}
		for _, d := range Directions {
			*sc.DefaultOf(d) = s.Of(d).Default
			for _, r := range s.Of(d).Rules {
				if r.IsPeer() && r.Peer == "" {
					continue // its cgroup was removed: nobody can match it again
				}
				*sc.Rules(d) = append(*sc.Rules(d), r.Rule)
			}
		}
		rs.Scopes = append(rs.Scopes, sc)
	}
	return rs
}
