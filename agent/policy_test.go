package agent_test

import (
	"fmt"
	"os"
	"path/filepath"
	"strings"
	"testing"
	"time"

	"github.com/shunt-project/shunt/agent"
	"github.com/shunt-project/shunt/bypass/bypasstest"
	"github.com/shunt-project/shunt/host"
	"github.com/shunt-project/shunt/internal/testenv"
	"github.com/shunt-project/shunt/policy"
)

// rulesInForce reads the policy at dir: scope path -> its rules, as text.
func rulesInForce(t *testing.T, dir string) map[string][]string {
	t.Helper()
	p, err := policy.Open(dir)
	if err != nil {
		return nil
	}
	defer p.Close()
	rep, err := p.Show()
	if err != nil {
		t.Fatal(err)
	}
	out := map[string][]string{}
	for _, s := range rep.Scopes {
		out[s.Cgroup] = []string{}
		for _, r := range s.Egress.Rules {
			out[s.Cgroup] = append(out[s.Cgroup], r.Rule.String())
		}
		for _, r := range s.Ingress.Rules {
			out[s.Cgroup] = append(out[s.Cgroup], "ingress "+r.Rule.String())
		}
	}
	return out
}

func waitFor(t *testing.T, what string, log *testenv.SyncBuffer, ok func() bool) {
	t.Helper()
	for deadline := time.Now().Add(10 * time.Second); !ok(); time.Sleep(20 * time.Millisecond) {
		if time.Now().After(deadline) {
			t.Fatalf("%s: not within 10 s; agent log:\n%s", what, log)
		}
	}
}

// TestAgentAppliesPolicyFile: the agent applies the configuration's policy
// file at start and when it changes, keeps the rules in force when the
// file goes bad, and applies a scope once its cgroup exists.
func TestAgentAppliesPolicyFile(t *testing.T) {
	testenv.RequireRoot(t)
	pin := bypasstest.MustPinDir(t)
	policyDir := bypasstest.MustPinDir(t)
	cg := testenv.MustCgroup(t)
	dir := t.TempDir()
	config, file := filepath.Join(dir, "config.yaml"), filepath.Join(dir, "policy.yaml")
	later, peer := filepath.Join(cg.Path, "later"), filepath.Join(cg.Path, "peer")
	writeConfig(t, file, fmt.Sprintf("scopes:\n  - cgroup: %s\n    egress: [{action: deny, cidr: 10.0.0.0/8}]\n    ingress: [{action: allow, peer_cgroup: %s}]\n  - cgroup: %s\n    default: deny\n", cg.Path, peer, later))
	writeConfig(t, config, "policy: {file: "+file+"}\n")
	log := runAgentWith(t, agent.Options{ConfigPath: config, PinDir: pin, IndexDir: filepath.Join(pin, "no-index"),
		PolicyDir: policyDir, Version: "test", Features: host.Probe()})

	waitFor(t, "the policy file applied", log, func() bool { return len(rulesInForce(t, policyDir)[cg.Path]) == 1 })
	if _, ok := rulesInForce(t, policyDir)[later]; ok {
		t.Errorf("a scope whose cgroup does not exist was applied")
	}
	waitFor(t, "the log saying the scope waits for its cgroup", log, func() bool {
		return strings.Contains(log.String(), "waiting for ") && strings.Contains(log.String(), ", "+later)
	})
	// A peer rule naming a cgroup that does not exist yet matches no socket:
	// left out until it does.
	waitFor(t, "the log saying the peer rule waits for its cgroup", log, func() bool { return strings.Contains(log.String(), "peer "+peer) })

	// The cgroups come; the next event (here the file written again) applies them.
	mkCgroup(t, cg.Path, "later")
	mkCgroup(t, cg.Path, "peer")
	b, _ := os.ReadFile(file)
	writeConfig(t, file, string(b))
	waitFor(t, "the scope applied once its cgroup exists", log, func() bool { _, ok := rulesInForce(t, policyDir)[later]; return ok })
	waitFor(t, "the peer rule applied once its cgroup exists", log, func() bool { return len(rulesInForce(t, policyDir)[cg.Path]) == 2 })

	writeConfig(t, file, fmt.Sprintf("scopes:\n  - cgroup: %s\n    egress: [{action: deny, cidr: 10.0.0.0/8}, {action: allow, cidr: 10.1.0.0/16}]\n", cg.Path))
	waitFor(t, "the changed file applied", log, func() bool {
		r := rulesInForce(t, policyDir)
		_, stale := r[later]
		return len(r[cg.Path]) == 2 && !stale
	})

	writeConfig(t, file, "scopes: [{cgroup: "+cg.Path+", egress: [{action: deny, cidr: 10.0.0.300/8}]}]\n")
	waitFor(t, "the bad file reported", log, func() bool { return strings.Contains(log.String(), "keeping the rules in force") })
	if got := rulesInForce(t, policyDir)[cg.Path]; len(got) != 2 {
		t.Errorf("rules after a bad file: %v, want the 2 in force", got)
	}
}

// TestAgentRefusesBadPolicyFileAtStart: one line naming the file, and no
// agent.
func TestAgentRefusesBadPolicyFileAtStart(t *testing.T) {
	dir := t.TempDir()
	config, file := filepath.Join(dir, "config.yaml"), filepath.Join(dir, "policy.yaml")
	writeConfig(t, file, "scopes: [{cgroup: /x, egress: [{action: deny, cidr: 10.0.0.0/8, port: 0}]}]\n")
	writeConfig(t, config, "policy: {file: "+file+"}\n")
	_, err := agent.New(agent.Options{ConfigPath: config})
	if err == nil || !strings.Contains(err.Error(), "policy file "+file) || strings.Contains(err.Error(), "\n") {
		t.Errorf("agent.New: %v, want one line naming %s", err, file)
	}
}
