package main

import (
	"errors"
	"fmt"
	"text/tabwriter"

	"github.com/spf13/cobra"

	"github.com/shunt-project/shunt/host"
	"github.com/shunt-project/shunt/policy"
)

func newPolicyShowCmd(e *env, g *globals) *cobra.Command {
	var asJSON bool
	c := &cobra.Command{
		Use:   "show [--json]",
		Short: "List the rules in force with what each decided",
		Long: `show lists each scope's rules, egress then ingress, in the order they were
given, with their counters since they were installed: connect() calls and
unconnected UDP sends they decided (ingress: connection requests and
datagrams received), and open connections an apply closed by them. A rule
that stays across changes keeps its counts.`,
		Args: noArgs,
		RunE: func(c *cobra.Command, _ []string) error {
			if err := host.CheckPrivileges(); err != nil {
				return err
			}
			rep := &policy.Report{Scopes: []policy.ScopeReport{}}
			p, err := policy.Open(g.policyDir)
			switch {
			case errors.Is(err, policy.ErrNotEnabled):
			case err != nil:
				return err
			default:
				defer p.Close()
				if rep, err = p.Show(); err != nil {
					return err
				}
			}
			if asJSON {
				return writeJSON(e.stdout, rep)
			}
			if len(rep.Scopes) == 0 {
				fmt.Fprintln(e.stdout, "no policy: every connection and send is allowed")
				return nil
			}
			w := tabwriter.NewWriter(e.stdout, 0, 4, 2, ' ', 0)
			for i, s := range rep.Scopes {
				if i > 0 {
					fmt.Fprintln(w)
				}
				name := s.Cgroup
				if name == "" {
					name = fmt.Sprintf("(removed cgroup %d)", s.CgroupID)
				}
				fmt.Fprintf(w, "scope %s\n", name)
				fmt.Fprintln(w, "  DIRECTION\tID\tACTION\tPEER\tPORT\tPROTO\tCONNECTS\tSENDS\tCLOSED")
				for _, d := range policy.Directions {
					rr := s.Of(d)
					for _, r := range rr.Rules {
						fmt.Fprintf(w, "  %s\t%d\t%s\t%s\t%s\t%s\t%d\t%d\t%d\n", d, r.ID, r.Action, r.From(), r.Ports, r.Proto, r.Counts.Connects, r.Counts.Sends, r.Counts.Closed)
					}
					c := rr.DefaultCounts
					fmt.Fprintf(w, "  %s\t%d\t%s\t(default)\t\t\t%d\t%d\t%d\n", d, rr.DefaultID, rr.Default, c.Connects, c.Sends, c.Closed)
				}
			}
			return w.Flush()
		},
	}
	c.Flags().BoolVar(&asJSON, "json", false, "print JSON")
	return c
}
