package main

import (
	"context"
	"errors"
	"fmt"
	"os"

	"github.com/spf13/cobra"

	"github.com/shunt-project/shunt/host"
	"github.com/shunt-project/shunt/internal/readlimit"
	"github.com/shunt-project/shunt/policy"
)

func newPolicyApplyCmd(e *env, g *globals) *cobra.Command {
	var (
		file   string
		asJSON bool
	)
	c := &cobra.Command{
		Use:   "apply -f FILE",
		Short: "Replace the whole ruleset with a file's, at once",
		Long: `apply reads a ruleset (YAML, docs/POLICY.md; '-' reads standard input),
checks all of it, and only then replaces the rules in force: a mistake
anywhere applies nothing. Scopes not in the file lose their rules. The
switch is one map write: every connect and send meets either the old rules
or the new ones. Open connections the new rules deny are then closed.`,
		Args: noArgs,
		RunE: func(c *cobra.Command, _ []string) error {
			if file == "" {
				return usageError{fmt.Errorf("-f: missing: give the ruleset file ('-' for standard input)")}
			}
			var b []byte
			var err error
			if file == "-" {
				b, err = readlimit.All(c.Context(), os.Stdin, policy.MaxRulesetSize)
			} else {
				b, err = readlimit.File(c.Context(), file, policy.MaxRulesetSize)
			}
			if errors.Is(err, context.Canceled) {
				return err // interrupted while it waited for input
			}
			if err != nil {
				return usageError{fmt.Errorf("-f %s: %w", file, err)}
			}
			rs, err := policy.Parse(b)
			if err != nil {
				return policyInputError(fmt.Errorf("%s: %w", file, err))
			}
			res, err := changePolicy(c.Context(), e, g, func(cur *policy.Ruleset) error {
				*cur = rs
				return nil
			})
			if err != nil {
				return err
			}
			if asJSON {
				return writeJSON(e.stdout, res)
			}
			reportApplied(e, "applied "+file, res)
			return nil
		},
	}
	c.Flags().StringVarP(&file, "file", "f", "", "ruleset file, '-' for standard input")
	c.Flags().BoolVar(&asJSON, "json", false, "print what was applied and closed as JSON")
	return c
}

func newPolicyClearCmd(e *env, g *globals) *cobra.Command {
	var cgroupPath string
	c := &cobra.Command{
		Use:   "clear [--cgroup PATH]",
		Short: "Remove one scope's rules, or the whole policy",
		Long: `clear with --cgroup removes that scope and its rules. Without it, it
removes the whole policy: every scope's programs are detached and its maps
go, and nothing is denied any more.`,
		Args: noArgs,
		RunE: func(c *cobra.Command, _ []string) error {
			if cgroupPath != "" {
				cg, err := host.ResolveCgroup(cgroupPath)
				if err != nil {
					return usageError{fmt.Errorf("--cgroup: %w", err)}
				}
				res, err := changePolicy(c.Context(), e, g, func(rs *policy.Ruleset) error {
					if scopeOf(rs, cg.Path, false) == nil {
						return &policy.InputError{Where: "scope " + cg.Path, Err: fmt.Errorf("not in the policy ('shunt policy show' lists the scopes)")}
					}
					rs.Scopes = deleteScope(rs.Scopes, cg.Path)
					return nil
				})
				if err != nil {
					return err
				}
				reportApplied(e, "cleared "+cg.Path, res)
				return nil
			}
			if err := host.CheckPrivileges(); err != nil {
				return err
			}
			release, err := lockInstall(e, g.policyDir)
			if err != nil {
				return err
			}
			defer release()
			p, err := policy.Open(g.policyDir)
			if errors.Is(err, policy.ErrNotEnabled) {
				fmt.Fprintln(e.stdout, "no policy installed")
				return nil
			}
			if err != nil {
				// An install this shunt cannot read (another version's, or
				// half removed) still goes: its links go with its pins.
				fmt.Fprintf(e.stderr, "shunt: %v: removing %s anyway\n", err, g.policyDir)
				if err := os.RemoveAll(g.policyDir); err != nil {
					return fmt.Errorf("remove %s: %w", g.policyDir, err)
				}
			} else if err := p.Remove(); err != nil {
				return err
			}
			fmt.Fprintln(e.stdout, "policy removed: nothing is denied")
			return nil
		},
	}
	c.Flags().StringVar(&cgroupPath, "cgroup", "", "remove only this scope")
	return c
}

func deleteScope(scopes []policy.Scope, path string) []policy.Scope {
	out := scopes[:0]
	for _, s := range scopes {
		if s.Cgroup != path {
			out = append(out, s)
		}
	}
	return out
}
