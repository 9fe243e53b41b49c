package agent

import (
	"bytes"
	"context"
	"fmt"
	"os"
	"strings"
	"time"

	"github.com/shunt-project/shunt/host"
	"github.com/shunt-project/shunt/internal/readlimit"
	"github.com/shunt-project/shunt/internal/runlock"
	"github.com/shunt-project/shunt/policy"
)

// loadPolicy reads and checks the configuration's policy file. Its scopes'
// cgroups need not exist yet (pods come and go): those that do not are left
// out of what is applied until they do.
func loadPolicy(file string) (policy.Ruleset, error) {
	b, err := readlimit.File(context.Background(), file, policy.MaxRulesetSize)
	if err != nil {
		return policy.Ruleset{}, fmt.Errorf("policy file %s: %w", file, err)
	}
	rs, err := policy.Parse(b)
	if err != nil {
		return policy.Ruleset{}, fmt.Errorf("policy file %s: %w", file, err)
	}
	return rs, nil
}

// present keeps the scopes whose cgroup exists now, and the peer rules
// whose peer cgroup does, and names the others.
func present(rs policy.Ruleset) (policy.Ruleset, []string) {
	out := policy.Ruleset{Scopes: []policy.Scope{}}
	var missing []string
	for _, s := range rs.Scopes {
		if _, err := host.ResolveCgroup(s.Cgroup); err != nil {
			missing = append(missing, s.Cgroup)
			continue
		}
		// A peer rule naming a cgroup that does not exist matches no
		// socket: left out until the cgroup comes.
		var kept []policy.Rule
		for _, r := range s.Ingress {
			if r.IsPeer() {
				if _, err := host.ResolveCgroup(r.Peer); err != nil {
					missing = append(missing, "peer "+r.Peer)
					continue
				}
			}
			kept = append(kept, r)
		}
		s.Ingress = kept
		out.Scopes = append(out.Scopes, s)
	}
	return out, missing
}

// reconcilePolicy applies the policy file when it, or which of its scopes'
// cgroups exist, changed since the last apply. A file that does not parse
// is logged and the rules in force stay.
func (a *Agent) reconcilePolicy(ctx context.Context) {
	file := a.cfg.Policy.File
	if file == "" {
		return
	}
	rs, err := loadPolicy(file)
	if err != nil {
		a.stats.policyApplies("failed")
		if a.policyErr != err.Error() {
			a.logf("%v: keeping the rules in force", err)
			a.policyErr = err.Error()
		}
		return
	}
	a.policyErr = ""
	rs, missing := present(rs)
	text, err := rs.Marshal()
	if err != nil {
		a.logf("policy: %v", err)
		return
	}
	if _, err := os.Stat(a.opts.PolicyDir); err == nil && bytes.Equal(text, a.policyApplied) {
		return
	}
	release, err := runlock.Lock("install", a.opts.PolicyDir, 30*time.Second, nil)
	if err != nil {
		a.logf("policy: %v", err)
		return
	}
	defer release()
	res, err := applyPolicy(ctx, a.opts.PolicyDir, rs)
	if err != nil {
		a.stats.policyApplies("failed")
		a.logf("apply the policy file %s: %v", file, err)
		return
	}
	a.stats.policyApplies("ok")
	a.policyApplied = text
	line := fmt.Sprintf("policy applied: %d rules in %d scopes, %d open connections closed", res.Rules, res.Scopes, len(res.Closed))
	if len(missing) > 0 {
		line += fmt.Sprintf("; waiting for %s", strings.Join(missing, ", "))
	}
	a.logf("%s", line)
}

func applyPolicy(ctx context.Context, dir string, rs policy.Ruleset) (*policy.ApplyResult, error) {
	if err := policy.Validate(rs); err != nil {
		return nil, err
	}
	if err := host.EnsureBPFFS(dir); err != nil {
		return nil, err
	}
	p, err := policy.Create(dir, policy.Options{})
	if err != nil {
		return nil, err
	}
	defer p.Close()
	return p.Apply(ctx, rs)
}
