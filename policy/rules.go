package policy

import (
	"fmt"
	"net/netip"
	"strconv"
	"strings"

	"go.yaml.in/yaml/v3"
)

// Capacities, as bpf/include/policy_keys.h sizes the maps.
const (
	MaxRules     = 16384 // rules of a ruleset, all scopes together
	MaxScopes    = 1024
	maxPerAddr   = 32 // rules one address can meet in a scope: its prefix's and the covering ones'
	maxPeerLevel = 16 // POLICY_PEER_LEVELS: how deep a peer cgroup may be
)

// Action is what a rule or a scope's default does to a connection or send.
type Action uint8

const (
	Allow Action = Action(policyPolicyActionPOLICY_ALLOW)
	Deny  Action = Action(policyPolicyActionPOLICY_DENY)
)

func (a Action) String() string {
	switch a {
	case Allow:
		return "allow"
	case Deny:
		return "deny"
	}
	return "action(" + strconv.Itoa(int(a)) + ")"
}

// ParseAction reads "allow" or "deny".
func ParseAction(s string) (Action, error) {
	switch s {
	case "allow":
		return Allow, nil
	case "deny":
		return Deny, nil
	}
	return 0, fmt.Errorf("%q is not an action: allow or deny", s)
}

func (a Action) MarshalText() ([]byte, error) { return []byte(a.String()), nil }

func (a *Action) UnmarshalText(b []byte) (err error) {
	*a, err = ParseAction(string(b))
	return err
}

// Proto is a rule's transport protocol; Any matches TCP and UDP.
type Proto uint8

const (
	Any Proto = 0
	TCP Proto = 6
	UDP Proto = 17
)

func (p Proto) String() string {
	switch p {
	case Any:
		return "any"
	case TCP:
		return "tcp"
	case UDP:
		return "udp"
	}
	return "proto(" + strconv.Itoa(int(p)) + ")"
}

// ParseProto reads "tcp", "udp", or "" / "any" for both.
func ParseProto(s string) (Proto, error) {
	switch s {
	case "", "any":
		return Any, nil
	case "tcp":
		return TCP, nil
	case "udp":
		return UDP, nil
	}
	return 0, fmt.Errorf("%q is not a protocol: tcp or udp (or leave it out for both)", s)
}

func (p Proto) MarshalText() ([]byte, error) { return []byte(p.String()), nil }

func (p *Proto) UnmarshalText(b []byte) (err error) {
	*p, err = ParseProto(string(b))
	return err
}

// Ports is an inclusive range of destination ports; the zero value (and
// 0-65535) means any port.
type Ports struct{ Lo, Hi uint16 }

// AnyPort matches every port.
var AnyPort = Ports{0, 65535}

func (p Ports) norm() Ports {
	if p == (Ports{}) {
		return AnyPort
	}
	return p
}

func (p Ports) String() string {
	switch p = p.norm(); {
	case p == AnyPort:
		return "any"
	case p.Lo == p.Hi:
		return strconv.Itoa(int(p.Lo))
	}
	return fmt.Sprintf("%d-%d", p.Lo, p.Hi)
}

// ParsePorts reads "N", "N-M", or "" / "any" for every port.
func ParsePorts(s string) (Ports, error) {
	if s == "" || s == "any" {
		return AnyPort, nil
	}
	lo, hi, isRange := strings.Cut(s, "-")
	if !isRange {
		hi = lo
	}
	l, err1 := strconv.ParseUint(lo, 10, 16)
	h, err2 := strconv.ParseUint(hi, 10, 16)
	if err1 != nil || err2 != nil || l == 0 {
		return Ports{}, fmt.Errorf("%q is not a port or range: give N or N-M with ports 1-65535", s)
	}
	if l > h {
		return Ports{}, fmt.Errorf("%q is an empty range: the first port must not be above the second", s)
	}
	return Ports{uint16(l), uint16(h)}, nil
}

func (p Ports) MarshalText() ([]byte, error) { return []byte(p.String()), nil }

func (p *Ports) UnmarshalText(b []byte) (err error) {
	*p, err = ParsePorts(string(b))
	return err
}

// Rule is one rule of a scope: connections and sends to (egress) or from
// (ingress) CIDR, on Ports, over Proto, get Action. An ingress rule may
// name the sender's cgroup subtree (Peer) instead of an address.
type Rule struct {
	Action Action       `yaml:"action" json:"action"`
	CIDR   netip.Prefix `yaml:"cidr,omitempty" json:"cidr,omitzero"`
	Peer   string       `yaml:"peer_cgroup,omitempty" json:"peer_cgroup,omitempty"`
	Ports  Ports        `yaml:"port,omitempty" json:"port"`
	Proto  Proto        `yaml:"proto,omitempty" json:"proto"`

	peer uint64 // Peer's cgroup id, once resolved
}

func (r Rule) String() string {
	return fmt.Sprintf("%s %s port %s proto %s", r.Action, r.From(), r.Ports, r.Proto)
}

// From names what the rule matches the other end by: its prefix, or
// "cgroup PATH" for a peer rule.
func (r Rule) From() string {
	if r.Peer != "" {
		return "cgroup " + r.Peer
	}
	if r.peer != 0 {
		return fmt.Sprintf("cgroup id %d (removed)", r.peer)
	}
	return r.CIDR.String()
}

// IsPeer says the rule names the sender's cgroup, not an address.
func (r Rule) IsPeer() bool { return r.Peer != "" || r.peer != 0 }

// Direction says which way a rule looks.
type Direction uint8

const (
	// Egress rules judge where the scope's sockets connect and send: the
	// destination address and port.
	Egress Direction = Direction(policyPolicyDirPOLICY_EGRESS)
	// Ingress rules judge who connects and sends to the scope's sockets:
	// the source address, and the scope's port it is sent to.
	Ingress Direction = Direction(policyPolicyDirPOLICY_INGRESS)
)

// Directions lists both, egress first.
var Directions = []Direction{Egress, Ingress}

func (d Direction) String() string {
	if d == Ingress {
		return "ingress"
	}
	return "egress"
}

// ParseDirection reads "egress" or "ingress".
func ParseDirection(s string) (Direction, error) {
	switch s {
	case "egress":
		return Egress, nil
	case "ingress":
		return Ingress, nil
	}
	return 0, fmt.Errorf("%q is not a direction: egress or ingress", s)
}

// Scope is a cgroup subtree with its rules. Sockets of the cgroup and its
// descendants get the action of their first matching rule of the
// direction (see POLICY.md for the order), else its default.
type Scope struct {
	Cgroup         string `yaml:"cgroup" json:"cgroup"`
	Default        Action `yaml:"default,omitempty" json:"default"` // egress
	Egress         []Rule `yaml:"egress,omitempty" json:"egress"`
	IngressDefault Action `yaml:"ingress_default,omitempty" json:"ingress_default"`
	Ingress        []Rule `yaml:"ingress,omitempty" json:"ingress"`
}

// Rules returns the scope's rules of a direction.
func (s *Scope) Rules(d Direction) *[]Rule {
	if d == Ingress {
		return &s.Ingress
	}
	return &s.Egress
}

// DefaultOf returns the scope's default of a direction.
func (s *Scope) DefaultOf(d Direction) *Action {
	if d == Ingress {
		return &s.IngressDefault
	}
	return &s.Default
}

// Ruleset is a whole policy, what `shunt policy apply` installs at once.
type Ruleset struct {
	Scopes []Scope `yaml:"scopes" json:"scopes"`
}

// InputError is a mistake in a ruleset: it names the rule and the field.
type InputError struct {
	Where string // "scope 2 (/sys/fs/cgroup/app) egress rule 3"
	Field string
	Err   error
}

func (e *InputError) Error() string {
	msg := e.Err.Error()
	if e.Field != "" {
		msg = e.Field + ": " + msg
	}
	if e.Where != "" {
		msg = e.Where + ": " + msg
	}
	return msg
}

func (e *InputError) Unwrap() error { return e.Err }

// MaxRulesetSize bounds a ruleset file: a path to a device or an endless
// file is refused, not read into memory.
const MaxRulesetSize = 8 << 20

// Parse reads a ruleset file (docs/POLICY.md). Unknown fields are errors.
func Parse(b []byte) (Ruleset, error) {
	var rs Ruleset
	dec := yaml.NewDecoder(strings.NewReader(string(b)))
	dec.KnownFields(true)
	if err := dec.Decode(&rs); err != nil {
		if err.Error() == "EOF" {
			return Ruleset{}, nil // an empty file: no rules
		}
		return Ruleset{}, &InputError{Err: yamlError(err)}
	}
	// A second document would be ignored: a ruleset is one document.
	var more yaml.Node
	if err := dec.Decode(&more); err == nil {
		return Ruleset{}, &InputError{Err: fmt.Errorf("line %d: a second YAML document (after ---): a ruleset file holds one", more.Line)}
	} else if err.Error() != "EOF" {
		return Ruleset{}, &InputError{Err: yamlError(err)}
	}
	return rs, rs.Check()
}

// yamlError makes the decoder's message one line.
func yamlError(err error) error {
	msg := strings.TrimPrefix(err.Error(), "yaml: ")
	msg = strings.ReplaceAll(msg, "unmarshal errors:\n  ", "")
	msg = strings.ReplaceAll(msg, "\n  ", "; ")
	// A value the decoder quotes may hold newlines of its own.
	return fmt.Errorf("%s", strings.ReplaceAll(msg, "\n", `\n`))
}

// Check finds what the kernel could not hold or would take differently
// from what was written: defaults filled in, prefixes in canonical form.
func (rs *Ruleset) Check() error {
	seen := map[string]int{}
	total := 0
	for i := range rs.Scopes {
		s := &rs.Scopes[i]
		where := fmt.Sprintf("scope %d", i+1)
		if s.Cgroup == "" {
			return &InputError{Where: where, Field: "cgroup", Err: fmt.Errorf("missing: give a cgroup v2 directory")}
		}
		where += " (" + s.Cgroup + ")"
		if j, dup := seen[s.Cgroup]; dup {
			return &InputError{Where: where, Field: "cgroup", Err: fmt.Errorf("scope %d has the same cgroup: put their rules in one scope", j)}
		}
		seen[s.Cgroup] = i + 1
		for _, d := range Directions {
			if *s.DefaultOf(d) == 0 {
				*s.DefaultOf(d) = Allow
			}
			rules := *s.Rules(d)
			ruleSeen := make(map[Rule]int, len(rules))
			for j := range rules {
				r := &rules[j]
				rw := fmt.Sprintf("%s %s rule %d", where, d, j+1)
				if err := r.check(); err != nil {
					err.Where = rw
					return err
				}
				if r.IsPeer() && d != Ingress {
					return &InputError{Where: rw, Field: "peer_cgroup", Err: fmt.Errorf("only ingress rules name a peer's cgroup (who may connect to this scope); write the rule on the scope being connected to")}
				}
				if k, dup := ruleSeen[*r]; dup {
					return &InputError{Where: rw, Err: fmt.Errorf("same as rule %d", k)}
				}
				ruleSeen[*r] = j + 1
			}
			total += len(rules)
		}
	}
	if len(rs.Scopes) > MaxScopes {
		return &InputError{Where: "policy", Err: fmt.Errorf("%d scopes: at most %d", len(rs.Scopes), MaxScopes)}
	}
	if total > MaxRules {
		return &InputError{Where: "policy", Err: fmt.Errorf("%d rules: at most %d", total, MaxRules)}
	}
	return nil
}

func (r *Rule) check() *InputError {
	switch r.Action {
	case Allow, Deny:
	case 0:
		return &InputError{Field: "action", Err: fmt.Errorf("missing: allow or deny")}
	default:
		return &InputError{Field: "action", Err: fmt.Errorf("%v: allow or deny", r.Action)}
	}
	if r.IsPeer() {
		if r.CIDR.IsValid() {
			return &InputError{Field: "peer_cgroup", Err: fmt.Errorf("a rule names a cidr or a peer_cgroup, not both")}
		}
		r.Ports = r.Ports.norm()
		return nil
	}
	if !r.CIDR.IsValid() {
		return &InputError{Field: "cidr", Err: fmt.Errorf("missing: give an address prefix such as 10.0.0.0/8 or fd00::/8 (or, ingress, a peer_cgroup)")}
	}
	if r.CIDR.Addr().Is4In6() {
		return &InputError{Field: "cidr", Err: fmt.Errorf("%s is IPv4-mapped: write it as IPv4 (%s), which also covers IPv6 sockets reaching it", r.CIDR, mappedAsV4(r.CIDR))}
	}
	if r.CIDR.Addr().Zone() != "" {
		return &InputError{Field: "cidr", Err: fmt.Errorf("%s has a zone: rules take addresses without one", r.CIDR)}
	}
	if m := r.CIDR.Masked(); m != r.CIDR {
		return &InputError{Field: "cidr", Err: fmt.Errorf("%s has bits set past its prefix length: did you mean %s?", r.CIDR, m)}
	}
	r.Ports = r.Ports.norm()
	return nil
}

func mappedAsV4(p netip.Prefix) string {
	bits := p.Bits() - 96
	if bits < 0 {
		return "an IPv4 prefix"
	}
	return netip.PrefixFrom(p.Addr().Unmap(), bits).Masked().String()
}

// ParseCIDR reads a prefix, or a bare address as a /32 or /128.
func ParseCIDR(s string) (netip.Prefix, error) {
	if p, err := netip.ParsePrefix(s); err == nil {
		return p, nil
	}
	if a, err := netip.ParseAddr(s); err == nil {
		if a.Zone() != "" {
			// The prefix would drop it and cover every interface.
			return netip.Prefix{}, fmt.Errorf("%q names an interface (%%%s): rules match addresses on every interface; give the address alone", s, a.Zone())
		}
		return netip.PrefixFrom(a, a.BitLen()), nil
	}
	return netip.Prefix{}, fmt.Errorf("%q is not an address prefix: give one such as 10.0.0.0/8, fd00::/8 or 192.0.2.1", s)
}

// UnmarshalYAML reads a rule's fields straight from the node (a file may
// hold 10,000 rules; reflection per rule would dominate an apply), lets
// cidr be a bare address, and refuses unknown fields (Node.Decode would
// not inherit the decoder's KnownFields).
func (r *Rule) UnmarshalYAML(n *yaml.Node) error {
	if n.Kind != yaml.MappingNode {
		return fmt.Errorf("line %d: a rule is a mapping (action, cidr or peer_cgroup, port, proto)", n.Line)
	}
	*r = Rule{}
	for i := 0; i+1 < len(n.Content); i += 2 {
		k, v := n.Content[i], n.Content[i+1]
		if v.Kind != yaml.ScalarNode {
			return fmt.Errorf("line %d: %s: give a single value", v.Line, k.Value)
		}
		var err error
		switch k.Value {
		case "action":
			r.Action, err = ParseAction(v.Value)
		case "cidr":
			r.CIDR, err = ParseCIDR(v.Value)
		case "peer_cgroup":
			if r.Peer = v.Value; r.Peer == "" {
				err = fmt.Errorf("empty: give a cgroup v2 directory")
			}
		case "port":
			r.Ports, err = ParsePorts(v.Value)
		case "proto":
			r.Proto, err = ParseProto(v.Value)
		default:
			return fmt.Errorf("line %d: field %s not found in a rule (action, cidr, peer_cgroup, port, proto)", k.Line, k.Value)
		}
		if err != nil {
			return fmt.Errorf("line %d: %s: %w", v.Line, k.Value, err)
		}
	}
	return nil
}

// MarshalYAML writes a rule as UnmarshalYAML reads it (yaml.v3 would take
// a netip.Prefix, all unexported fields, for empty and leave it out).
func (r Rule) MarshalYAML() (any, error) {
	type fields struct {
		Action Action `yaml:"action"`
		CIDR   string `yaml:"cidr,omitempty"`
		Peer   string `yaml:"peer_cgroup,omitempty"`
		Ports  Ports  `yaml:"port,omitempty"`
		Proto  Proto  `yaml:"proto,omitempty"`
	}
	f := fields{Action: r.Action, Peer: r.Peer, Ports: r.Ports, Proto: r.Proto}
	if r.CIDR.IsValid() {
		f.CIDR = r.CIDR.String()
	}
	return f, nil
}

// Marshal writes a ruleset in the file format Parse reads.
func (rs Ruleset) Marshal() ([]byte, error) { return yaml.Marshal(rs) }
