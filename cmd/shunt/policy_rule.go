package main

import (
	"fmt"
	"slices"

	"github.com/spf13/cobra"

	"github.com/shunt-project/shunt/host"
	"github.com/shunt-project/shunt/policy"
)

// ruleFlags are the flags that name one rule.
type ruleFlags struct {
	cgroup, direction, action, cidr, port, proto string
}

func (f *ruleFlags) register(c *cobra.Command) {
	c.Flags().StringVar(&f.cgroup, "cgroup", "", "cgroup v2 directory of the scope (its sockets and its descendants')")
	c.Flags().StringVar(&f.direction, "direction", "egress", "egress: connections and sends the scope's sockets make")
	c.Flags().StringVar(&f.action, "action", "", "allow or deny")
	c.Flags().StringVar(&f.cidr, "cidr", "", "destination prefix (10.0.0.0/8, fd00::/8) or address")
	c.Flags().StringVar(&f.port, "port", "", "destination port N or range N-M (default: any)")
	c.Flags().StringVar(&f.proto, "proto", "", "tcp or udp (default: both)")
}

// rule reads the flags; every mistake is a usage error naming the flag.
func (f *ruleFlags) rule() (host.Cgroup, policy.Rule, error) {
	bad := func(flag string, err error) error { return usageError{fmt.Errorf("--%s: %w", flag, err)} }
	if f.cgroup == "" {
		return host.Cgroup{}, policy.Rule{}, bad("cgroup", fmt.Errorf("missing: give the scope's cgroup v2 directory"))
	}
	if f.direction != "egress" {
		return host.Cgroup{}, policy.Rule{}, bad("direction", fmt.Errorf("%q: only egress rules exist so far (docs/POLICY.md, \"Not yet\")", f.direction))
	}
	var r policy.Rule
	var err error
	if f.action == "" {
		return host.Cgroup{}, r, bad("action", fmt.Errorf("missing: allow or deny"))
	}
	if r.Action, err = policy.ParseAction(f.action); err != nil {
		return host.Cgroup{}, r, bad("action", err)
	}
	if f.cidr == "" {
		return host.Cgroup{}, r, bad("cidr", fmt.Errorf("missing: give a destination prefix"))
	}
	if r.CIDR, err = policy.ParseCIDR(f.cidr); err != nil {
		return host.Cgroup{}, r, bad("cidr", err)
	}
	if r.Ports, err = policy.ParsePorts(f.port); err != nil {
		return host.Cgroup{}, r, bad("port", err)
	}
	if r.Proto, err = policy.ParseProto(f.proto); err != nil {
		return host.Cgroup{}, r, bad("proto", err)
	}
	cg, err := host.ResolveCgroup(f.cgroup)
	if err != nil {
		return host.Cgroup{}, r, bad("cgroup", err)
	}
	return cg, r, nil
}

// scopeOf returns the scope of cgroup path, adding one (default allow) if
// create is set; nil if there is none.
func scopeOf(rs *policy.Ruleset, path string, create bool) *policy.Scope {
	for i := range rs.Scopes {
		if rs.Scopes[i].Cgroup == path {
			return &rs.Scopes[i]
		}
	}
	if !create {
		return nil
	}
	rs.Scopes = append(rs.Scopes, policy.Scope{Cgroup: path, Default: policy.Allow})
	return &rs.Scopes[len(rs.Scopes)-1]
}

func newPolicyAddCmd(e *env, g *globals) *cobra.Command {
	var f ruleFlags
	c := &cobra.Command{
		Use:   "add --cgroup PATH --action allow|deny --cidr CIDR [--port N[-M]] [--proto tcp|udp]",
		Short: "Add an egress rule to a scope (made if new, default allow)",
		Args:  noArgs,
		RunE: func(c *cobra.Command, _ []string) error {
			cg, r, err := f.rule()
			if err != nil {
				return err
			}
			res, err := changePolicy(c.Context(), e, g, func(rs *policy.Ruleset) error {
				s := scopeOf(rs, cg.Path, true)
				s.Egress = append(s.Egress, r)
				return nil
			})
			if err != nil {
				return err
			}
			reportApplied(e, "added "+r.String()+" to "+cg.Path, res)
			return nil
		},
	}
	f.register(c)
	return c
}

func newPolicyDeleteCmd(e *env, g *globals) *cobra.Command {
	var f ruleFlags
	c := &cobra.Command{
		Use:   "delete --cgroup PATH --action allow|deny --cidr CIDR [--port N[-M]] [--proto tcp|udp]",
		Short: "Delete the egress rule these flags name",
		Long: `delete removes the rule of the scope that has exactly these fields. A scope
left with no rules and the default allow is removed too.`,
		Args: noArgs,
		RunE: func(c *cobra.Command, _ []string) error {
			cg, r, err := f.rule()
			if err != nil {
				return err
			}
			res, err := changePolicy(c.Context(), e, g, func(rs *policy.Ruleset) error {
				s := scopeOf(rs, cg.Path, false)
				i := -1
				if s != nil {
					i = slices.IndexFunc(s.Egress, func(x policy.Rule) bool { return x.String() == r.String() })
				}
				if i < 0 {
					return &policy.InputError{Where: "scope " + cg.Path, Err: fmt.Errorf("no rule %s ('shunt policy show' lists them)", r)}
				}
				s.Egress = slices.Delete(s.Egress, i, i+1)
				dropIdleScopes(rs)
				return nil
			})
			if err != nil {
				return err
			}
			reportApplied(e, "deleted "+r.String()+" from "+cg.Path, res)
			return nil
		},
	}
	f.register(c)
	return c
}

// dropIdleScopes removes scopes that allow everything: they decide nothing.
func dropIdleScopes(rs *policy.Ruleset) {
	rs.Scopes = slices.DeleteFunc(rs.Scopes, func(s policy.Scope) bool {
		return len(s.Egress) == 0 && s.Default == policy.Allow
	})
}

func newPolicyDefaultCmd(e *env, g *globals) *cobra.Command {
	var cgroupPath string
	c := &cobra.Command{
		Use:   "default --cgroup PATH allow|deny",
		Short: "Set what a scope does with traffic no rule matches",
		Long: `default sets the action of a scope for connections and sends that none of
its rules match (a new scope's is allow). 'deny' makes the scope an allow
list: only what its rules allow gets out.`,
		Args: func(c *cobra.Command, args []string) error {
			if len(args) != 1 {
				return usageError{fmt.Errorf("%s takes one argument, allow or deny (see '%s --help')", c.CommandPath(), c.CommandPath())}
			}
			return nil
		},
		RunE: func(c *cobra.Command, args []string) error {
			a, err := policy.ParseAction(args[0])
			if err != nil {
				return usageError{err}
			}
			if cgroupPath == "" {
				return usageError{fmt.Errorf("--cgroup: missing: give the scope's cgroup v2 directory")}
			}
			cg, err := host.ResolveCgroup(cgroupPath)
			if err != nil {
				return usageError{fmt.Errorf("--cgroup: %w", err)}
			}
			res, err := changePolicy(c.Context(), e, g, func(rs *policy.Ruleset) error {
				scopeOf(rs, cg.Path, true).Default = a
				dropIdleScopes(rs)
				return nil
			})
			if err != nil {
				return err
			}
			reportApplied(e, "default of "+cg.Path+" is "+a.String(), res)
			return nil
		},
	}
	c.Flags().StringVar(&cgroupPath, "cgroup", "", "cgroup v2 directory of the scope")
	return c
}
