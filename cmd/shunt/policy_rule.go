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
	cgroup, direction, action, cidr, peer, port, proto string
}

func (f *ruleFlags) register(c *cobra.Command) {
	c.Flags().StringVar(&f.cgroup, "cgroup", "", "cgroup v2 directory of the scope (its sockets and its descendants')")
	c.Flags().StringVar(&f.direction, "direction", "egress", "egress (where the scope's sockets connect and send) or ingress (who connects and sends to them)")
	c.Flags().StringVar(&f.action, "action", "", "allow or deny")
	c.Flags().StringVar(&f.cidr, "cidr", "", "the peer's prefix (10.0.0.0/8, fd00::/8) or address: egress the destination, ingress the source")
	c.Flags().StringVar(&f.peer, "peer-cgroup", "", "ingress only, instead of --cidr: the cgroup v2 directory (a subtree) of the sockets connecting or sending")
	c.Flags().StringVar(&f.port, "port", "", "the port connected or sent to, N or N-M (default: any); ingress: the scope's own port")
	c.Flags().StringVar(&f.proto, "proto", "", "tcp or udp (default: both)")
}

// rule reads the flags; every mistake is a usage error naming the flag.
func (f *ruleFlags) rule() (cg host.Cgroup, d policy.Direction, r policy.Rule, err error) {
	bad := func(flag string, err error) error { return usageError{fmt.Errorf("--%s: %w", flag, err)} }
	if f.cgroup == "" {
		return cg, d, r, bad("cgroup", fmt.Errorf("missing: give the scope's cgroup v2 directory"))
	}
	if d, err = policy.ParseDirection(f.direction); err != nil {
		return cg, d, r, bad("direction", err)
	}
	if f.action == "" {
		return cg, d, r, bad("action", fmt.Errorf("missing: allow or deny"))
	}
	if r.Action, err = policy.ParseAction(f.action); err != nil {
		return cg, d, r, bad("action", err)
	}
	switch {
	case f.cidr != "" && f.peer != "":
		return cg, d, r, bad("peer-cgroup", fmt.Errorf("give --cidr or --peer-cgroup, not both"))
	case f.peer != "":
		if d != policy.Ingress {
			return cg, d, r, bad("peer-cgroup", fmt.Errorf("only ingress rules name a peer's cgroup: add it to the scope being connected to, with --direction ingress"))
		}
		peer, err := host.ResolveCgroup(f.peer)
		if err != nil {
			return cg, d, r, bad("peer-cgroup", err)
		}
		r.Peer = peer.Path
	case f.cidr == "":
		return cg, d, r, bad("cidr", fmt.Errorf("missing: give the peer's prefix (or, ingress, --peer-cgroup)"))
	default:
		if r.CIDR, err = policy.ParseCIDR(f.cidr); err != nil {
			return cg, d, r, bad("cidr", err)
		}
	}
	if r.Ports, err = policy.ParsePorts(f.port); err != nil {
		return cg, d, r, bad("port", err)
	}
	if r.Proto, err = policy.ParseProto(f.proto); err != nil {
		return cg, d, r, bad("proto", err)
	}
	if cg, err = host.ResolveCgroup(f.cgroup); err != nil {
		return cg, d, r, bad("cgroup", err)
	}
	return cg, d, r, nil
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
	rs.Scopes = append(rs.Scopes, policy.Scope{Cgroup: path, Default: policy.Allow, IngressDefault: policy.Allow})
	return &rs.Scopes[len(rs.Scopes)-1]
}

func newPolicyAddCmd(e *env, g *globals) *cobra.Command {
	var f ruleFlags
	c := &cobra.Command{
		Use:   "add --cgroup PATH [--direction egress|ingress] --action allow|deny --cidr CIDR|--peer-cgroup PATH [--port N[-M]] [--proto tcp|udp]",
		Short: "Add a rule to a scope (made if new, defaults allow)",
		Args:  noArgs,
		RunE: func(c *cobra.Command, _ []string) error {
			cg, d, r, err := f.rule()
			if err != nil {
				return err
			}
			res, err := changePolicy(c.Context(), e, g, func(rs *policy.Ruleset) error {
				rules := scopeOf(rs, cg.Path, true).Rules(d)
				*rules = append(*rules, r)
				return nil
			})
			if err != nil {
				return err
			}
			reportApplied(e, fmt.Sprintf("added %s rule %s to %s", d, r, cg.Path), res)
			return nil
		},
	}
	f.register(c)
	return c
}

func newPolicyDeleteCmd(e *env, g *globals) *cobra.Command {
	var f ruleFlags
	c := &cobra.Command{
		Use:   "delete --cgroup PATH [--direction egress|ingress] --action allow|deny --cidr CIDR|--peer-cgroup PATH [--port N[-M]] [--proto tcp|udp]",
		Short: "Delete the rule these flags name",
		Long: `delete removes the rule of the scope that has exactly these fields. A scope
left with no rules and both defaults allow is removed too.`,
		Args: noArgs,
		RunE: func(c *cobra.Command, _ []string) error {
			cg, d, r, err := f.rule()
			if err != nil {
				return err
			}
			res, err := changePolicy(c.Context(), e, g, func(rs *policy.Ruleset) error {
				s := scopeOf(rs, cg.Path, false)
				i := -1
				if s != nil {
					i = slices.IndexFunc(*s.Rules(d), func(x policy.Rule) bool { return x.String() == r.String() })
				}
				if i < 0 {
					return &policy.InputError{Where: "scope " + cg.Path, Err: fmt.Errorf("no %s rule %s ('shunt policy show' lists them)", d, r)}
				}
				*s.Rules(d) = slices.Delete(*s.Rules(d), i, i+1)
				dropIdleScopes(rs)
				return nil
			})
			if err != nil {
				return err
			}
			reportApplied(e, fmt.Sprintf("deleted %s rule %s from %s", d, r, cg.Path), res)
			return nil
		},
	}
	f.register(c)
	return c
}

// dropIdleScopes removes scopes that allow everything: they decide nothing.
func dropIdleScopes(rs *policy.Ruleset) {
	rs.Scopes = slices.DeleteFunc(rs.Scopes, func(s policy.Scope) bool {
		return len(s.Egress) == 0 && len(s.Ingress) == 0 && s.Default == policy.Allow && s.IngressDefault == policy.Allow
	})
}

func newPolicyDefaultCmd(e *env, g *globals) *cobra.Command {
	var cgroupPath, direction string
	c := &cobra.Command{
		Use:   "default --cgroup PATH [--direction egress|ingress] allow|deny",
		Short: "Set what a scope does with traffic no rule matches",
		Long: `default sets the action of a scope, in one direction, for connections and
sends that none of its rules match (a new scope's are allow). 'deny' makes
that direction an allow list: only what its rules allow gets out (egress)
or in (ingress).`,
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
			d, err := policy.ParseDirection(direction)
			if err != nil {
				return usageError{fmt.Errorf("--direction: %w", err)}
			}
			cg, err := host.ResolveCgroup(cgroupPath)
			if err != nil {
				return usageError{fmt.Errorf("--cgroup: %w", err)}
			}
			res, err := changePolicy(c.Context(), e, g, func(rs *policy.Ruleset) error {
				*scopeOf(rs, cg.Path, true).DefaultOf(d) = a
				dropIdleScopes(rs)
				return nil
			})
			if err != nil {
				return err
			}
			reportApplied(e, fmt.Sprintf("%s default of %s is %s", d, cg.Path, a), res)
			return nil
		},
	}
	c.Flags().StringVar(&cgroupPath, "cgroup", "", "cgroup v2 directory of the scope")
	c.Flags().StringVar(&direction, "direction", "egress", "egress or ingress")
	return c
}
