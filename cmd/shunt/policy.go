package main

import (
	"context"
	"errors"
	"fmt"

	"github.com/spf13/cobra"

	"github.com/shunt-project/shunt/host"
	"github.com/shunt-project/shunt/policy"
)

func newPolicyCmd(e *env, g *globals) *cobra.Command {
	c := &cobra.Command{
		Use:   "policy",
		Short: "Egress rules at the socket layer, whichever path the bytes take",
		Long: `policy decides, for the sockets of a cgroup subtree (a scope), which
addresses, ports and protocols they may connect and send to. The decision is
taken in the kernel at connect() and at each unconnected UDP send, before a
packet exists, so it holds for connections shunt bypasses or splices, whose
bytes never meet netfilter. A denied connect() or send fails with EPERM.

Each change replaces the whole ruleset at once (every connect meets either
the old rules or the new ones) and then closes the open connections that
connected under a scope and that the new rules deny: their next call fails
with ECONNABORTED and a TCP peer gets a reset.

Precedence, scopes and the file format: docs/POLICY.md.`,
		Args: noArgs,
	}
	c.AddCommand(newPolicyAddCmd(e, g), newPolicyDeleteCmd(e, g), newPolicyDefaultCmd(e, g),
		newPolicyShowCmd(e, g), newPolicyApplyCmd(e, g), newPolicyClearCmd(e, g))
	return c
}

// policyInputError makes a ruleset mistake a usage error (exit 2).
func policyInputError(err error) error {
	var ie *policy.InputError
	if errors.As(err, &ie) {
		return usageError{err}
	}
	return err
}

// changePolicy applies what change makes of the ruleset in force, holding
// the install lock so two changes cannot lose one another's rules.
func changePolicy(ctx context.Context, e *env, g *globals, change func(*policy.Ruleset) error) (*policy.ApplyResult, error) {
	if err := host.CheckPrivileges(); err != nil {
		return nil, err
	}
	if err := host.EnsureBPFFS(g.policyDir); err != nil {
		return nil, err
	}
	release, err := lockInstall(e, g.policyDir)
	if err != nil {
		return nil, err
	}
	defer release()
	// The change is checked whole before anything is installed.
	rs := policy.Ruleset{}
	if cur, err := policy.Open(g.policyDir); err == nil {
		rep, err := cur.Show()
		cur.Close()
		if err != nil {
			return nil, err
		}
		rs = rep.Ruleset()
	} else if !errors.Is(err, policy.ErrNotEnabled) {
		return nil, err
	}
	if err := change(&rs); err != nil {
		return nil, policyInputError(err)
	}
	if err := policy.Validate(rs); err != nil {
		return nil, policyInputError(err)
	}
	p, err := policy.Create(g.policyDir, policy.Options{})
	if err != nil {
		return nil, err
	}
	defer p.Close()
	res, err := p.Apply(ctx, rs)
	return res, policyInputError(err)
}

// reportApplied prints one line for an apply and one per closed connection.
func reportApplied(e *env, what string, res *policy.ApplyResult) {
	fmt.Fprintf(e.stdout, "%s: %d rules in %d scopes in force (%v)", what, res.Rules, res.Scopes, res.Took.Round(100_000))
	if n := len(res.Closed); n > 0 {
		fmt.Fprintf(e.stdout, "; closed %d open connections they deny", n)
	}
	fmt.Fprintln(e.stdout)
	for _, c := range res.Closed {
		line := fmt.Sprintf("  closed %s %s -> %s (rule %d)", c.Proto, c.Local, c.Remote, c.Rule)
		if c.Error != "" {
			line = fmt.Sprintf("  not closed %s %s -> %s (rule %d): %s", c.Proto, c.Local, c.Remote, c.Rule, c.Error)
		}
		fmt.Fprintln(e.stdout, line)
	}
}
