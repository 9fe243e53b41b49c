package policy

import (
	"cmp"
	"encoding/binary"
	"fmt"
	"net/netip"
	"slices"
)

// scopeRules is a scope with its cgroup resolved.
type scopeRules struct {
	Scope
	id        uint64
	defaultID [2]uint32 // set when compiling a slot back from its infos
}

// compiled is a ruleset as map entries for one slot.
type compiled struct {
	lists  map[policyPolicyKey]policyPolicyList
	peers  map[policyPolicyPeerKey]policyPolicyList // peer rules' lists
	scopes map[policyPolicyScopeKey]policyPolicyScope
	infos  map[policyPolicyRuleKey]policyPolicyRuleInfo
	ids    []uint32 // every counter the slot uses
}

// precedes orders the rules of one prefix: the first that matches decides.
// A narrower port range first, then a named protocol before any, then deny
// before allow, then the order written.
func precedes(a, b Rule) int {
	if c := cmp.Compare(int(a.Ports.Hi)-int(a.Ports.Lo), int(b.Ports.Hi)-int(b.Ports.Lo)); c != 0 {
		return c
	}
	if (a.Proto == Any) != (b.Proto == Any) {
		if a.Proto != Any {
			return -1
		}
		return 1
	}
	if a.Action != b.Action {
		if a.Action == Deny {
			return -1
		}
		return 1
	}
	return 0
}

// ruleName names a rule (or, with no rule, a scope's default) across
// applies, so a rule that stays keeps its counter.
type ruleName struct {
	scope    uint64
	dir      Direction
	isDflt   bool
	action   Action
	cidr     netip.Prefix
	ports    Ports
	protocol Proto
	peer     uint64
}

func nameOf(scope uint64, d Direction, r *Rule) ruleName {
	if r == nil {
		return ruleName{scope: scope, dir: d, isDflt: true}
	}
	return ruleName{scope: scope, dir: d, action: r.Action, cidr: r.CIDR, ports: r.Ports.norm(), protocol: r.Proto, peer: r.peer}
}

func family(p netip.Prefix) uint8 {
	if p.Addr().Is4() {
		return 4
	}
	return 6
}

func lpmKey(slot uint8, scope uint64, d Direction, p netip.Prefix) policyPolicyKey {
	k := policyPolicyKey{Prefixlen: uint32(policyKeyFixedBits + p.Bits()), Slot: slot, Family: family(p), Dir: uint8(d), Scope: scope}
	a := p.Addr().AsSlice()
	copy(k.Addr[:], a)
	return k
}

// policyKeyFixedBits is POLICY_KEY_FIXED_BITS: slot, family, dir, pad and
// scope.
const policyKeyFixedBits = (1 + 1 + 2 + 8) * 8

// compile lays out scopes for slot. id gives each rule's counter id.
func compile(slot uint8, scopes []scopeRules, id func(ruleName) uint32) (*compiled, error) {
	return compileBy(slot, scopes, func(si int, d Direction, j int, r *Rule) uint32 {
		return id(nameOf(scopes[si].id, d, r))
	})
}

// compileWithIDs compiles scopes whose ids are known: ids[scope][dir][rule],
// and each scope's defaultID.
func compileWithIDs(slot uint8, scopes []scopeRules, ids [][2][]uint32) (*compiled, error) {
	return compileBy(slot, scopes, func(si int, d Direction, j int, r *Rule) uint32 {
		if r == nil {
			return scopes[si].defaultID[d]
		}
		return ids[si][d][j]
	})
}

// compileBy lays out scopes; id gives the counter id of scope si's rule j
// in direction d (r nil: the default).
func compileBy(slot uint8, scopes []scopeRules, id func(si int, d Direction, j int, r *Rule) uint32) (*compiled, error) {
	n := 0
	for _, s := range scopes {
		n += len(s.Egress) + len(s.Ingress) + 2
	}
	c := &compiled{
		lists:  make(map[policyPolicyKey]policyPolicyList, n),
		peers:  map[policyPolicyPeerKey]policyPolicyList{},
		scopes: make(map[policyPolicyScopeKey]policyPolicyScope, len(scopes)),
		infos:  make(map[policyPolicyRuleKey]policyPolicyRuleInfo, n),
		ids:    make([]uint32, 0, n),
	}
	for si, s := range scopes {
		var sv policyPolicyScope
		for _, d := range Directions {
			did := id(si, d, -1, nil)
			c.ids = append(c.ids, did)
			sv.DefaultRule[d], sv.DefaultAction[d] = did, uint8(*s.DefaultOf(d))
			c.infos[policyPolicyRuleKey{Slot: uint32(slot), Rule: did}] = policyPolicyRuleInfo{
				Scope: s.id, Action: uint8(*s.DefaultOf(d)), Seq: ^uint32(0), Dir: uint8(d),
			}
			hasPeer, err := c.addRules(slot, si, s, d, func(j int, r *Rule) uint32 { return id(si, d, j, r) })
			if err != nil {
				return nil, err
			}
			if hasPeer {
				sv.HasPeerRules[d] = 1
			}
		}
		c.scopes[policyPolicyScopeKey{Scope: s.id, Slot: uint32(slot)}] = sv
	}
	return c, nil
}

// ruled is a rule with its counter id.
type ruled struct {
	Rule
	id uint32
}

// add appends rs to l in order; past maxPerAddr it is the user's
// mistake, said of what (a prefix or a peer cgroup).
func (l *policyPolicyList) add(rs []ruled, si int, s scopeRules, d Direction, what string) error {
	for _, r := range rs {
		if l.N == maxPerAddr {
			return &InputError{
				Where: fmt.Sprintf("scope %d (%s)", si+1, s.Cgroup), Field: d.String(),
				Err: fmt.Errorf("more than %d rules apply to %s", maxPerAddr, what),
			}
		}
		l.E[l.N] = policyPolicyEntry{PortLo: r.Ports.Lo, PortHi: r.Ports.Hi, Proto: uint8(r.Proto), Action: uint8(r.Action), Rule: r.id}
		l.N++
	}
	return nil
}

// addRules lays out one direction of a scope: each prefix's list, and each
// peer cgroup's. It says whether there were peer rules.
func (c *compiled) addRules(slot uint8, si int, s scopeRules, d Direction, id func(j int, r *Rule) uint32) (bool, error) {
	// Each prefix's (and peer cgroup's) rules, in precedence order, with
	// their ids.
	byPrefix := map[netip.Prefix][]ruled{}
	byPeer := map[uint64][]ruled{}
	for j, r := range *s.Rules(d) {
		rid := id(j, &r)
		c.ids = append(c.ids, rid)
		info := policyPolicyRuleInfo{
			Scope: s.id, PortLo: r.Ports.Lo, PortHi: r.Ports.Hi,
			Proto: uint8(r.Proto), Action: uint8(r.Action), Seq: uint32(j), Dir: uint8(d),
		}
		if r.IsPeer() {
			byPeer[r.peer] = append(byPeer[r.peer], ruled{r, rid})
			binary.LittleEndian.PutUint64(info.Addr[:8], r.peer) // family 0
		} else {
			byPrefix[r.CIDR] = append(byPrefix[r.CIDR], ruled{r, rid})
			info.Bits, info.Family = uint8(r.CIDR.Bits()), family(r.CIDR)
			copy(info.Addr[:], r.CIDR.Addr().AsSlice())
		}
		c.infos[policyPolicyRuleKey{Slot: uint32(slot), Rule: rid}] = info
	}
	for peer, rs := range byPeer {
		slices.SortStableFunc(rs, func(a, b ruled) int { return precedes(a.Rule, b.Rule) })
		var l policyPolicyList
		if err := l.add(rs, si, s, d, "peer cgroup "+rs[0].Peer); err != nil {
			return false, err
		}
		c.peers[policyPolicyPeerKey{Scope: s.id, Peer: peer, Slot: slot, Dir: uint8(d)}] = l
	}
	// The prefix lengths in use, longest first, per family: a prefix's
	// covering prefixes are looked for at those lengths only.
	lens := map[uint8][]int{}
	seenLen := map[[2]int]bool{}
	for p := range byPrefix {
		slices.SortStableFunc(byPrefix[p], func(a, b ruled) int { return precedes(a.Rule, b.Rule) })
		f := family(p)
		if k := [2]int{int(f), p.Bits()}; !seenLen[k] {
			seenLen[k] = true
			lens[f] = append(lens[f], p.Bits())
		}
	}
	for f := range lens {
		slices.SortFunc(lens[f], func(a, b int) int { return b - a })
	}
	// A lookup returns the longest prefix only, so each prefix's list goes
	// on with the rules of every prefix covering it, longest first.
	for p, own := range byPrefix {
		var l policyPolicyList
		what := p.String() + " and the prefixes covering it"
		if err := l.add(own, si, s, d, what); err != nil {
			return false, err
		}
		for _, bits := range lens[family(p)] {
			if bits >= p.Bits() {
				continue
			}
			if err := l.add(byPrefix[netip.PrefixFrom(p.Addr(), bits).Masked()], si, s, d, what); err != nil {
				return false, err
			}
		}
		c.lists[lpmKey(slot, s.id, d, p)] = l
	}
	return len(byPeer) > 0, nil
}
