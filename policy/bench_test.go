package policy_test

import (
	"io"
	"math/rand/v2"
	"net"
	"net/netip"
	"path/filepath"
	"strconv"
	"testing"
	"time"

	"github.com/cilium/ebpf"
	"github.com/cilium/ebpf/link"
	"golang.org/x/sys/unix"

	"github.com/shunt-project/shunt/host"
	"github.com/shunt-project/shunt/internal/testenv"
	"github.com/shunt-project/shunt/policy"
)

// benchRulesets are the modes the benchmarks compare: no scope, a scope
// with one rule, and one with 10,000 (/32s under 10.8.0.0/16 on other
// ports, so every lookup meets a full trie).
func benchRulesets(cg host.Cgroup) map[string]policy.Ruleset {
	one := policy.Ruleset{Scopes: []policy.Scope{{Cgroup: cg.Path, Egress: []policy.Rule{
		{Action: policy.Deny, CIDR: netip.MustParsePrefix("10.10.0.0/16")},
	}}}}
	many := policy.Ruleset{Scopes: []policy.Scope{{Cgroup: cg.Path}}}
	for i := range 10000 {
		many.Scopes[0].Egress = append(many.Scopes[0].Egress, policy.Rule{
			Action: policy.Deny, CIDR: netip.PrefixFrom(netip.AddrFrom4([4]byte{10, 8, byte(i >> 8), byte(i)}), 32),
			Ports: policy.Ports{Lo: 1000, Hi: 1000},
		})
	}
	// The benchmark's own destination is one of them, allowed on its port.
	many.Scopes[0].Egress[0] = policy.Rule{Action: policy.Allow, CIDR: netip.MustParsePrefix("10.8.0.1/32"), Ports: policy.Ports{Lo: 80, Hi: 80}}
	// A peer rule: the scope takes connections from its own cgroup only,
	// so each connection's SYN is written down by the peer program and
	// looked up by the ingress program.
	peer := policy.Ruleset{Scopes: []policy.Scope{{Cgroup: cg.Path, IngressDefault: policy.Deny, Ingress: []policy.Rule{
		{Action: policy.Allow, Peer: cg.Path},
	}}}}
	return map[string]policy.Ruleset{"none": {}, "1-rule": one, "10000-rules": many, "peer-rule": peer}
}

var benchModes = []string{"none", "1-rule", "10000-rules", "peer-rule"}

// benchEnv is a bypassed cgroup in a namespace where 10.8.0.0/16 is local,
// with an echo server on port 80, and a policy.
type benchEnv struct {
	p    *policy.Policy
	cg   host.Cgroup
	side testenv.Side
	sets map[string]policy.Ruleset
}

func mustBenchEnv(b *testing.B) *benchEnv {
	b.Helper()
	testenv.RequireRoot(b)
	p, err := policy.Create(testenv.MustPinDir(b), policy.Options{})
	if err != nil {
		b.Fatal(err)
	}
	b.Cleanup(func() { p.Remove() })
	cg := testenv.MustCgroup(b)
	mustBypass(b, cg)
	ns := testenv.MustNetNS(b)
	if err := ipIn(ns, "route", "add", "local", "10.8.0.0/16", "dev", "lo"); err != nil {
		b.Fatal(err)
	}
	side := testenv.Side{NS: ns, CG: cg}
	listeners(b, side, 80)
	return &benchEnv{p: p, cg: cg, side: side, sets: benchRulesets(cg)}
}

// costHooks are the scope's programs a connection runs.
var costHooks = []string{"connect4", "ingress", "egress", "sockops"}

// use puts mode's ruleset in force and returns the scope's programs a
// connection runs, by hook (none without a scope).
func (e *benchEnv) use(b *testing.B, mode string) map[string]*ebpf.Program {
	b.Helper()
	if _, err := e.p.Apply(b.Context(), e.sets[mode]); err != nil {
		b.Fatal(err)
	}
	progs := map[string]*ebpf.Program{}
	if mode == "none" {
		return progs
	}
	pins := map[string]string{}
	for _, hook := range costHooks {
		pins[hook] = filepath.Join(e.p.Dir(), "links", strconv.FormatUint(e.cg.ID, 10), hook)
	}
	if peer := filepath.Join(e.p.Dir(), "peers", strconv.FormatUint(e.cg.ID, 10)); mode == "peer-rule" {
		pins["peer-egress"] = peer
	}
	for hook, pin := range pins {
		l, err := link.LoadPinnedLink(pin, nil)
		if err != nil {
			b.Fatal(err)
		}
		info, err := l.Info()
		l.Close()
		if err != nil {
			b.Fatal(err)
		}
		prog, err := ebpf.NewProgramFromID(info.Program)
		if err != nil {
			b.Fatal(err)
		}
		b.Cleanup(func() { prog.Close() })
		progs[hook] = prog
	}
	return progs
}

// hookCost reports, from bpf_stats, each program's run time per run and
// per op over what fn did.
func hookCost(b *testing.B, progs map[string]*ebpf.Program, fn func()) {
	b.Helper()
	if len(progs) == 0 {
		fn()
		return
	}
	stats, err := ebpf.EnableStats(unix.BPF_STATS_RUN_TIME)
	if err != nil {
		b.Fatal(err)
	}
	defer stats.Close()
	before := map[string]*ebpf.ProgramStats{}
	for hook, prog := range progs {
		if before[hook], err = prog.Stats(); err != nil {
			b.Fatal(err)
		}
	}
	fn()
	for hook, prog := range progs {
		s, err := prog.Stats()
		if err != nil {
			b.Fatal(err)
		}
		runs, took := s.RunCount-before[hook].RunCount, s.Runtime-before[hook].Runtime
		if runs > 0 {
			b.ReportMetric(float64(took)/float64(runs), hook+"-ns/run")
			b.ReportMetric(float64(took)/float64(b.N), hook+"-ns/op")
		}
	}
}

// BenchmarkConnect: a TCP connect and an abortive close from a scope, with
// no policy, one rule and 10,000. Run with -count to interleave the modes.
func BenchmarkConnect(b *testing.B) {
	e := mustBenchEnv(b)
	sa := &unix.SockaddrInet4{Addr: [4]byte{10, 8, 0, 1}, Port: 80}
	for _, mode := range benchModes {
		b.Run(mode, func(b *testing.B) {
			progs := e.use(b, mode)
			e.side.Make(b, func() {
				hookCost(b, progs, func() {
					b.ResetTimer()
					for range b.N {
						fd, err := unix.Socket(unix.AF_INET, unix.SOCK_STREAM|unix.SOCK_CLOEXEC, 0)
						if err != nil {
							b.Fatal(err)
						}
						if err := unix.Connect(fd, sa); err != nil {
							b.Fatal(err)
						}
						// RST, not FIN: no TIME_WAIT to run out of ports.
						unix.SetsockoptLinger(fd, unix.SOL_SOCKET, unix.SO_LINGER, &unix.Linger{Onoff: 1})
						unix.Close(fd)
					}
				})
			})
		})
	}
}

// BenchmarkBypassed: round trips of 64 bytes and one-way 16 KiB writes on a
// connection shunt bypasses, with no policy, one rule and 10,000: the
// policy decides at connect, so these must not move.
func BenchmarkBypassed(b *testing.B) {
	e := mustBenchEnv(b)
	for _, mode := range benchModes {
		e.use(b, mode)
		var c net.Conn
		var err error
		e.side.Make(b, func() { c, err = net.DialTimeout("tcp", "10.8.0.1:80", time.Second) })
		if err != nil {
			b.Fatal(err)
		}
		b.Run("rtt-64B/"+mode, func(b *testing.B) {
			msg := make([]byte, 64)
			for range b.N {
				if _, err := c.Write(msg); err != nil {
					b.Fatal(err)
				}
				if _, err := io.ReadFull(c, msg); err != nil {
					b.Fatal(err)
				}
			}
		})
		b.Run("echo-16KiB/"+mode, func(b *testing.B) {
			msg := make([]byte, 16<<10)
			b.SetBytes(int64(len(msg)))
			done := make(chan error, 1)
			go func() {
				_, err := io.CopyN(io.Discard, c, int64(b.N)*int64(len(msg)))
				done <- err
			}()
			for range b.N {
				if _, err := c.Write(msg); err != nil {
					b.Fatal(err)
				}
			}
			if err := <-done; err != nil {
				b.Fatal(err)
			}
		})
		c.Close()
	}
}

// manyRules is a ruleset of n /32 deny rules in one scope, drawn from seed.
func manyRules(cg string, n int, seed uint64) policy.Ruleset {
	r := rand.New(rand.NewPCG(seed, seed))
	s := policy.Scope{Cgroup: cg}
	seen := map[netip.Addr]bool{}
	for len(s.Egress) < n {
		a := netip.AddrFrom4([4]byte{10, byte(r.IntN(256)), byte(r.IntN(256)), byte(r.IntN(256))})
		if seen[a] {
			continue
		}
		seen[a] = true
		p := uint16(1 + r.IntN(65535))
		s.Egress = append(s.Egress, policy.Rule{Action: policy.Deny, CIDR: netip.PrefixFrom(a, 32), Ports: policy.Ports{Lo: p, Hi: p}, Proto: policy.TCP})
	}
	return policy.Ruleset{Scopes: []policy.Scope{s}}
}

// BenchmarkApply: replacing a ruleset of 10,000 rules by another, for the
// cases an apply meets: one rule changed (the slot being written holds the
// ruleset before the one in force: an agent re-applying, a rule added),
// every rule new, and the first apply of a fresh install. And parsing the
// file of 10,000 rules.
func BenchmarkApply(b *testing.B) {
	testenv.RequireRoot(b)
	cg := testenv.MustCgroup(b)
	mustCreate := func(b *testing.B) *policy.Policy {
		p, err := policy.Create(testenv.MustPinDir(b), policy.Options{})
		if err != nil {
			b.Fatal(err)
		}
		b.Cleanup(func() { p.Remove() })
		return p
	}
	apply := func(b *testing.B, p *policy.Policy, rs policy.Ruleset) {
		if _, err := p.Apply(b.Context(), rs); err != nil {
			b.Fatal(err)
		}
	}
	b.Run("10000-rules/one-changed", func(b *testing.B) {
		p := mustCreate(b)
		a := manyRules(cg.Path, 10000, 1)
		c := manyRules(cg.Path, 10000, 1)
		c.Scopes[0].Egress[0].Action = policy.Allow
		apply(b, p, a)
		apply(b, p, c)
		b.ResetTimer()
		for i := range b.N {
			apply(b, p, []policy.Ruleset{a, c}[i%2])
		}
	})
	b.Run("10000-rules/all-new", func(b *testing.B) {
		p := mustCreate(b)
		sets := make([]policy.Ruleset, b.N+2)
		for i := range sets {
			sets[i] = manyRules(cg.Path, 10000, uint64(100+i))
		}
		apply(b, p, sets[0])
		apply(b, p, sets[1])
		b.ResetTimer()
		for i := range b.N {
			apply(b, p, sets[i+2])
		}
	})
	b.Run("10000-rules/fresh-install", func(b *testing.B) {
		rs := manyRules(cg.Path, 10000, 1)
		for range b.N {
			b.StopTimer()
			p := mustCreate(b)
			b.StartTimer()
			apply(b, p, rs)
			b.StopTimer()
			p.Remove()
			b.StartTimer()
		}
	})
	b.Run("10000-rules/parse-file", func(b *testing.B) {
		text, err := manyRules(cg.Path, 10000, 1).Marshal()
		if err != nil {
			b.Fatal(err)
		}
		b.ResetTimer()
		for range b.N {
			if _, err := policy.Parse(text); err != nil {
				b.Fatal(err)
			}
		}
	})
}
