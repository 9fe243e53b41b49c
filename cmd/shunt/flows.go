package main

import (
	"errors"
	"fmt"
	"text/tabwriter"
	"time"

	"github.com/spf13/cobra"

	"github.com/shunt-project/shunt/bypass"
	"github.com/shunt-project/shunt/host"
)

func newFlowsCmd(e *env, g *globals) *cobra.Command {
	var asJSON bool
	c := &cobra.Command{
		Use:   "flows [--json]",
		Short: "List the connections bypassed now",
		Long: `flows lists every bypassed connection: both endpoints, their network
namespace and cgroup, and the bytes and sends redirected each way, as counted
by shunt's BPF programs. The JSON fields are described in docs/CLI.md.`,
		Args: noArgs,
		RunE: func(c *cobra.Command, _ []string) error {
			if err := host.CheckPrivileges(); err != nil {
				return err
			}
			flows := []bypass.Flow{}
			in, err := bypass.Open(g.pinDir)
			switch {
			case errors.Is(err, bypass.ErrNotInstalled):
			case err != nil:
				return err
			default:
				defer in.Close()
				if flows, err = in.Flows(); err != nil {
					return err
				}
			}
			if asJSON {
				return writeJSON(e.stdout, flows)
			}
			printFlows(e, flows, errors.Is(err, bypass.ErrNotInstalled))
			return nil
		},
	}
	c.Flags().BoolVar(&asJSON, "json", false, "print JSON")
	return c
}

func printFlows(e *env, flows []bypass.Flow, notInstalled bool) {
	if notInstalled {
		fmt.Fprintln(e.stdout, "bypass is not enabled")
		return
	}
	if len(flows) == 0 {
		fmt.Fprintln(e.stdout, "no bypassed connections")
		return
	}
	w := tabwriter.NewWriter(e.stdout, 0, 4, 2, ' ', 0)
	defer w.Flush()
	fmt.Fprintln(w, "CLIENT\tSERVER\tNETNS (C/S)\tCGROUP (C/S)\tC->S BYTES/SENDS\tS->C BYTES/SENDS\tAGE")
	for _, f := range flows {
		fmt.Fprintf(w, "%s\t%s\t%s\t%s\t%s\t%s\t%s\n",
			addr(f.Client), addr(f.Server),
			side(f.Client, f.Server, func(p *bypass.Endpoint) string {
				if p.NetnsName != "" {
					return p.NetnsName
				}
				return fmt.Sprint(p.Netns)
			}),
			side(f.Client, f.Server, func(p *bypass.Endpoint) string { return p.Cgroup }),
			traffic(f.Client, f.Server), traffic(f.Server, f.Client),
			time.Since(f.Since).Round(time.Second))
	}
}

func addr(p *bypass.Endpoint) string {
	if p == nil {
		return "(closed)"
	}
	return p.Addr.String()
}

func side(c, s *bypass.Endpoint, f func(*bypass.Endpoint) string) string {
	get := func(p *bypass.Endpoint) string {
		if p == nil {
			return "-"
		}
		return f(p)
	}
	a, b := get(c), get(s)
	if a == b {
		return a
	}
	return a + " / " + b
}

// traffic describes the sends of p to peer, and why they take TCP if they do.
func traffic(p, peer *bypass.Endpoint) string {
	if p == nil {
		return "-"
	}
	s := fmt.Sprintf("%d/%d", p.TxBytes, p.TxMsgs)
	if p.TCPMsgs > 0 {
		s += fmt.Sprintf(" +%d sends via TCP", p.TCPMsgs)
	}
	switch {
	case !p.Redirecting:
		s += " (TCP only)"
	case peer != nil && peer.Reader == bypass.ReaderTCP:
		s += " (TCP only: the reader blocks or uses MSG_WAITALL)"
	case p.Throttled:
		s += " (throttled)"
	case peer != nil && peer.Reader == bypass.ReaderUnseen:
		s += " (TCP until the reader calls recv)"
	}
	return s
}
