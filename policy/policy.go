// Package policy enforces rules at the socket layer: which addresses, ports
// and protocols the sockets of a cgroup subtree may connect and send to
// (egress, decided by cgroup sock_addr programs before a byte leaves), and
// who may connect and send to them (ingress, a connection's SYN and each
// UDP datagram, by cgroup_skb), whichever path the connection's bytes take
// afterwards (TCP, shunt's bypass or a splice). An apply replaces the whole
// ruleset at once and closes the open connections the new rules deny.
package policy

import (
	"errors"
	"fmt"
	"os"
	"path/filepath"
	"strconv"

	"github.com/cilium/ebpf"
	"github.com/cilium/ebpf/link"

	"github.com/shunt-project/shunt/host"
	"github.com/shunt-project/shunt/internal/pin"
)

// DefaultPinDir is where the policy lives in bpffs.
const DefaultPinDir = "/sys/fs/bpf/shunt-policy"

// ErrNotEnabled means no policy is pinned at the directory.
var ErrNotEnabled = errors.New("no policy is installed (add a rule, or run: shunt policy apply -f FILE)")

const (
	mapsDir  = "maps"
	progsDir = "progs" // the sweep's iterators: verified once, at install
	linksDir = "links" // links/<scope cgroup id>/<hook>
	peersDir = "peers" // peers/<cgroup id>: the peer egress link of a cgroup peer rules name
	// legacyDir marks an install made by a shunt before peer rules: its
	// scopes' and sweep's programs do not know them.
	legacyDir = "legacy"
)

// The hooks each scope gets, pinned as cgroup links.
var hooks = []struct {
	name   string
	attach ebpf.AttachType
	prog   func(*scopePrograms) *ebpf.Program
}{
	{"connect4", ebpf.AttachCGroupInet4Connect, func(p *scopePrograms) *ebpf.Program { return p.Connect4 }},
	{"connect6", ebpf.AttachCGroupInet6Connect, func(p *scopePrograms) *ebpf.Program { return p.Connect6 }},
	{"sendmsg4", ebpf.AttachCGroupUDP4Sendmsg, func(p *scopePrograms) *ebpf.Program { return p.Sendmsg4 }},
	{"sendmsg6", ebpf.AttachCGroupUDP6Sendmsg, func(p *scopePrograms) *ebpf.Program { return p.Sendmsg6 }},
	{"ingress", ebpf.AttachCGroupInetIngress, func(p *scopePrograms) *ebpf.Program { return p.Ingress }},
	{"egress", ebpf.AttachCGroupInetEgress, func(p *scopePrograms) *ebpf.Program { return p.Egress }},
	{"sockops", ebpf.AttachCGroupSockOps, func(p *scopePrograms) *ebpf.Program { return p.Sockops }},
}

// scopePrograms are the programs one scope attaches, loaded with its id.
type scopePrograms struct {
	Connect4 *ebpf.Program `ebpf:"shunt_policy_connect4"`
	Connect6 *ebpf.Program `ebpf:"shunt_policy_connect6"`
	Sendmsg4 *ebpf.Program `ebpf:"shunt_policy_sendmsg4"`
	Sendmsg6 *ebpf.Program `ebpf:"shunt_policy_sendmsg6"`
	Ingress  *ebpf.Program `ebpf:"shunt_policy_ingress"`
	Egress   *ebpf.Program `ebpf:"shunt_policy_egress"`
	Sockops  *ebpf.Program `ebpf:"shunt_policy_sockops"`
}

func (p *scopePrograms) Close() {
	for _, h := range hooks {
		if prog := h.prog(p); prog != nil {
			prog.Close()
		}
	}
}

// Policy is a policy pinned in bpffs.
type Policy struct {
	dir   string
	maps  policyMaps
	sweep sweepPrograms
}

// Dir returns the pin directory.
func (p *Policy) Dir() string { return p.dir }

func pinnedMaps(m *policyMaps) map[string]**ebpf.Map {
	return map[string]**ebpf.Map{
		"rules":        &m.PolicyRules,
		"scopes":       &m.PolicyScopes,
		"state":        &m.PolicyState,
		"counters":     &m.PolicyCounters,
		"conns":        &m.PolicyConns,
		"rule_infos":   &m.PolicyRuleInfos,
		"peer_rules":   &m.PolicyPeerRules,
		"senders":      &m.PolicySenders,
		"conn_senders": &m.PolicyConnSenders,
	}
}

// Options shape a new policy install.
type Options struct {
	// Mechanisms: the zero value uses the kernel's newest; tests set it
	// to run an older kernel's ways on this one (DiagDestroy: the sweep
	// finds, user space destroys through sock_diag).
	Mechanisms host.Mechanisms
}

// Create installs an empty policy (no scope: everything allowed) at dir, or
// opens the one there (whose options stay as they were).
func Create(dir string, opts Options) (*Policy, error) {
	if p, err := Open(dir); err == nil {
		return p, nil
	} else if !errors.Is(err, ErrNotEnabled) {
		return nil, err
	}
	err := pin.Install(dir, func(tmp string) error { return build(tmp, opts) })
	if err != nil {
		return nil, err
	}
	p, err := Open(dir)
	if errors.Is(err, ErrNotEnabled) {
		return nil, fmt.Errorf("%s exists and holds no shunt policy: remove it and try again", dir)
	}
	return p, err
}

// build makes the maps and the sweep's programs and pins them in dir.
func build(dir string, opts Options) error {
	for _, d := range []string{mapsDir, progsDir, linksDir, peersDir} {
		if err := os.Mkdir(filepath.Join(dir, d), 0o700); err != nil {
			return err
		}
	}
	// Before 6.5 the sweep can only find; user space closes through
	// sock_diag what it found (and reads which from the state map).
	findsOnly := !opts.Mechanisms.SockDestroy()
	p := &Policy{dir: dir}
	if err := p.pinNew(findsOnly, nil, func(string) bool { return true }); err != nil {
		return err
	}
	state, err := ebpf.LoadPinnedMap(filepath.Join(dir, mapsDir, "state"), nil)
	if err != nil {
		return err
	}
	defer state.Close()
	v := uint32(0)
	if findsOnly {
		v = 1
	}
	if err := state.Update(uint32(policyPolicyStateKeyPOLICY_STATE_FINDS_ONLY), v, ebpf.UpdateAny); err != nil {
		return fmt.Errorf("write the policy state: %w", err)
	}
	return nil
}

// pinNew loads the maps (those in repl reused) and the sweep's programs,
// and pins those whose path under the policy's dir want names.
func (p *Policy) pinNew(findsOnly bool, repl map[string]*ebpf.Map, want func(rel string) bool) error {
	spec, err := loadPolicy()
	if err != nil {
		return fmt.Errorf("load BPF spec: %w", err)
	}
	var cfg policyPolicyConfig
	if findsOnly {
		cfg.SweepFindsOnly = 1
	}
	if err := spec.Variables["pcfg"].Set(cfg); err != nil {
		return fmt.Errorf("configure BPF: %w", err)
	}
	var objs struct {
		policyMaps
		sweepPrograms
	}
	if err := spec.LoadAndAssign(&objs, &ebpf.CollectionOptions{MapReplacements: repl}); err != nil {
		return host.Explain(fmt.Errorf("load BPF objects: %w", err), "the policy", host.MinKernel)
	}
	defer objs.policyMaps.Close()
	defer objs.sweepPrograms.Close()
	for name, m := range pinnedMaps(&objs.policyMaps) {
		if rel := filepath.Join(mapsDir, name); want(rel) {
			if err := (*m).Pin(filepath.Join(p.dir, rel)); err != nil {
				return fmt.Errorf("pin map %s: %w", name, err)
			}
		}
	}
	for name, prog := range objs.sweepPrograms.pinned() {
		if rel := filepath.Join(progsDir, name); want(rel) {
			if err := (*prog).Pin(filepath.Join(p.dir, rel)); err != nil {
				return fmt.Errorf("pin program %s: %w", name, err)
			}
		}
	}
	return nil
}

// Open opens the policy pinned at dir.
func Open(dir string) (*Policy, error) {
	if _, err := os.Stat(filepath.Join(dir, linksDir)); err != nil {
		if errors.Is(err, os.ErrNotExist) {
			return nil, ErrNotEnabled
		}
		return nil, fmt.Errorf("open %s: %w", dir, err)
	}
	p := &Policy{dir: dir}
	if err := p.addMissing(); err != nil {
		return nil, err
	}
	for name, dst := range pinnedMaps(&p.maps) {
		m, err := ebpf.LoadPinnedMap(filepath.Join(dir, mapsDir, name), nil)
		if err != nil {
			p.Close()
			return nil, fmt.Errorf("open pinned map %s: %w", name, err)
		}
		*dst = m
	}
	for name, dst := range p.sweep.pinned() {
		prog, err := ebpf.LoadPinnedProgram(filepath.Join(dir, progsDir, name), nil)
		if err != nil {
			p.Close()
			return nil, fmt.Errorf("open pinned program %s: %w", name, err)
		}
		*dst = prog
	}
	return p, nil
}

// addMissing pins the maps and programs a policy installed by an older
// shunt lacks (those of peer rules), made as build makes them, beside the
// ones it has, and marks the install legacy: the programs it runs predate
// peer rules, so Apply refuses those until the policy is installed anew.
func (p *Policy) addMissing() error {
	missing := false
	for name := range pinnedMaps(&policyMaps{}) {
		if _, err := os.Stat(filepath.Join(p.dir, mapsDir, name)); err != nil {
			missing = true
		}
	}
	for name := range (&sweepPrograms{}).pinned() {
		if _, err := os.Stat(filepath.Join(p.dir, progsDir, name)); err != nil {
			missing = true
		}
	}
	if !missing {
		return nil
	}
	if err := os.Mkdir(filepath.Join(p.dir, legacyDir), 0o700); err != nil && !errors.Is(err, os.ErrExist) {
		return err
	}
	var have policyMaps
	defer have.Close()
	for name, dst := range pinnedMaps(&have) {
		if m, err := ebpf.LoadPinnedMap(filepath.Join(p.dir, mapsDir, name), nil); err == nil {
			*dst = m
		}
	}
	repl := mapReplacements(&have)
	var findsOnly uint32
	if have.PolicyState != nil {
		_ = have.PolicyState.Lookup(uint32(policyPolicyStateKeyPOLICY_STATE_FINDS_ONLY), &findsOnly)
	}
	return p.pinNew(findsOnly == 1, repl, func(name string) bool {
		_, err := os.Stat(filepath.Join(p.dir, name))
		return err != nil
	})
}

// Close releases this process's handles; the pinned policy stays in force.
func (p *Policy) Close() error {
	p.sweep.Close()
	return p.maps.Close()
}

// Remove detaches every scope's programs and removes the policy: from then
// on nothing is denied.
func (p *Policy) Remove() error {
	p.Close()
	if err := os.RemoveAll(p.dir); err != nil {
		return fmt.Errorf("remove %s: %w", p.dir, err)
	}
	return nil
}

func (p *Policy) activeSlot() (uint8, error) {
	var s uint32
	if err := p.maps.PolicyState.Lookup(uint32(policyPolicyStateKeyPOLICY_STATE_ACTIVE), &s); err != nil {
		return 0, fmt.Errorf("read the active ruleset: %w", err)
	}
	return uint8(s & 1), nil
}

// attachedScopes lists the cgroup ids that have programs attached, each
// with whether it has every hook (a scope attached by an older shunt may
// lack some).
func (p *Policy) attachedScopes() (map[uint64]bool, error) {
	ents, err := os.ReadDir(filepath.Join(p.dir, linksDir))
	if err != nil {
		return nil, err
	}
	ids := map[uint64]bool{}
	for _, e := range ents {
		id, err := strconv.ParseUint(e.Name(), 10, 64)
		if err != nil {
			continue
		}
		ids[id] = true
		for _, h := range hooks {
			if _, err := os.Stat(filepath.Join(p.dir, linksDir, e.Name(), h.name)); err != nil {
				ids[id] = false
			}
		}
	}
	return ids, nil
}

// attach loads a scope's programs with its id and attaches them to its
// cgroup, pinned under links/<id>. A scope that has no ingress rules gets
// the ingress program too: an apply may give it some without attaching. Built beside its final name, so a crash
// leaves either every hook of the scope or none.
func (p *Policy) attach(spec *ebpf.CollectionSpec, s scopeRules) error {
	spec = spec.Copy()
	if err := spec.Variables["pcfg"].Set(policyPolicyConfig{Scope: s.id}); err != nil {
		return fmt.Errorf("configure BPF: %w", err)
	}
	var progs scopePrograms
	opts := &ebpf.CollectionOptions{MapReplacements: p.replacements()}
	if err := spec.LoadAndAssign(&progs, opts); err != nil {
		return host.Explain(fmt.Errorf("load policy programs: %w", err), "the policy", host.MinKernel)
	}
	defer progs.Close()
	dir := filepath.Join(p.dir, linksDir, strconv.FormatUint(s.id, 10))
	attachIn := func(dir string, only func(name string) bool) error {
		for _, h := range hooks {
			if !only(h.name) {
				continue
			}
			l, err := link.AttachCgroup(link.CgroupOptions{Path: s.Cgroup, Attach: h.attach, Program: h.prog(&progs)})
			if err != nil {
				return fmt.Errorf("attach %s to %s: %w", h.name, s.Cgroup, err)
			}
			err = l.Pin(filepath.Join(dir, h.name))
			l.Close()
			if err != nil {
				return fmt.Errorf("pin %s link: %w", h.name, err)
			}
		}
		return nil
	}
	if _, err := os.Stat(dir); err == nil {
		// A scope attached by an older shunt: add the hooks it lacks.
		return attachIn(dir, func(name string) bool {
			_, err := os.Stat(filepath.Join(dir, name))
			return err != nil
		})
	}
	return pin.Install(dir, func(tmp string) error {
		return attachIn(tmp, func(string) bool { return true })
	})
}

// detach removes a scope's programs.
func (p *Policy) detach(id uint64) error {
	return os.RemoveAll(filepath.Join(p.dir, linksDir, strconv.FormatUint(id, 10)))
}

func (p *Policy) replacements() map[string]*ebpf.Map { return mapReplacements(&p.maps) }

// mapReplacements names m's maps as the programs do, leaving out those
// not open.
func mapReplacements(m *policyMaps) map[string]*ebpf.Map {
	all := map[string]*ebpf.Map{
		"policy_rules":        m.PolicyRules,
		"policy_scopes":       m.PolicyScopes,
		"policy_state":        m.PolicyState,
		"policy_counters":     m.PolicyCounters,
		"policy_conns":        m.PolicyConns,
		"policy_rule_infos":   m.PolicyRuleInfos,
		"policy_peer_rules":   m.PolicyPeerRules,
		"policy_senders":      m.PolicySenders,
		"policy_conn_senders": m.PolicyConnSenders,
	}
	for k, v := range all {
		if v == nil {
			delete(all, k)
		}
	}
	return all
}
