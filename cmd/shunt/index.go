package main

import (
	"errors"
	"fmt"
	"net/netip"
	"strconv"
	"strings"
	"text/tabwriter"
	"time"

	"github.com/spf13/cobra"

	"github.com/shunt-project/shunt/host"
	"github.com/shunt-project/shunt/sockindex"
)

func newIndexCmd(e *env, g *globals) *cobra.Command {
	c := &cobra.Command{
		Use:   "index",
		Short: "Keep an index of connected sockets by backend, for reap",
		Long: `index keeps, in BPF maps, every socket on this host that connected to
somewhere (TCP connect, connected UDP), by the backend it is connected to
(address, port, protocol), with its network namespace and socket cookie.
'shunt reap' uses it to destroy the sockets of one backend in time that does
not grow with the number of sockets on the host.`,
		Args: noArgs,
	}
	c.AddCommand(newIndexEnableCmd(e, g), newIndexDisableCmd(e, g), newIndexListCmd(e, g))
	return c
}

func newIndexEnableCmd(e *env, g *globals) *cobra.Command {
	var cgroupPath string
	c := &cobra.Command{
		Use:   "enable [--cgroup PATH]",
		Short: "Start indexing sockets (default: every socket of the host)",
		Long: `enable attaches the index programs to a cgroup v2 directory (default: the
root, i.e. every socket of the host, in every network namespace) and pins
them under --index-dir, so the index keeps itself up to date after this
command exits. Sockets that were connected before are added by a one-time
sweep of every network namespace. Enabling twice is harmless.`,
		Args: noArgs,
		RunE: func(c *cobra.Command, _ []string) error {
			if err := host.CheckPrivileges(); err != nil {
				return err
			}
			cg, err := cgroupArg(cgroupPath)
			if err != nil {
				return err
			}
			if err := host.EnsureBPFFS(g.indexDir); err != nil {
				return err
			}
			if ix, err := sockindex.Open(g.indexDir); err == nil {
				ix.Close()
				fmt.Fprintf(e.stdout, "index already enabled (%s)\n", g.indexDir)
				return nil
			}
			start := time.Now()
			ix, seeded, err := sockindex.Create(g.indexDir, cg)
			if err != nil {
				return err
			}
			defer ix.Close()
			fmt.Fprintf(e.stdout, "index enabled for cgroup %s: %d existing sockets added in %v\n", cg.Path, seeded, time.Since(start).Round(time.Millisecond))
			return nil
		},
	}
	c.Flags().StringVar(&cgroupPath, "cgroup", "", "cgroup v2 directory whose sockets are indexed (default: the root of the cgroup v2 hierarchy)")
	return c
}

func newIndexDisableCmd(e *env, g *globals) *cobra.Command {
	return &cobra.Command{
		Use:   "disable",
		Short: "Stop indexing and remove the index",
		Args:  noArgs,
		RunE: func(c *cobra.Command, _ []string) error {
			if err := host.CheckPrivileges(); err != nil {
				return err
			}
			ix, err := sockindex.Open(g.indexDir)
			if errors.Is(err, sockindex.ErrNotEnabled) {
				fmt.Fprintln(e.stdout, "index is not enabled")
				return nil
			}
			if err != nil {
				return err
			}
			if err := ix.Remove(); err != nil {
				return err
			}
			fmt.Fprintln(e.stdout, "index disabled")
			return nil
		},
	}
}

type indexedSocket struct {
	Proto       string `json:"proto"`
	Local       string `json:"local"` // "" for a connected UDP socket that never sent
	Backend     string `json:"backend"`
	Cookie      uint64 `json:"cookie"`
	NetnsCookie uint64 `json:"netns_cookie"`
	Netns       string `json:"netns,omitempty"`
	Owner       int    `json:"owner_pid,omitempty"`
	Since       string `json:"since"`
	Seeded      bool   `json:"seeded"`
}

func newIndexListCmd(e *env, g *globals) *cobra.Command {
	var (
		backend string
		proto   string
		asJSON  bool
	)
	c := &cobra.Command{
		Use:   "list [--backend ADDR[:PORT]] [--proto tcp|udp|all] [--json]",
		Short: "List indexed sockets, all or those of one backend",
		Args:  noArgs,
		RunE: func(c *cobra.Command, _ []string) error {
			var (
				addr   netip.Addr
				port   uint16
				protos []sockindex.Proto
				err    error
			)
			if protos, err = parseProto(proto); err != nil {
				return err
			}
			if backend != "" {
				if addr, port, err = parseBackend(backend); err != nil {
					return err
				}
			}
			if err := host.CheckPrivileges(); err != nil {
				return err
			}
			ix, err := sockindex.Open(g.indexDir)
			if err != nil {
				return err
			}
			defer ix.Close()
			var socks []sockindex.Socket
			if backend != "" {
				socks, err = ix.Find(addr, port, protos...)
			} else {
				socks, err = ix.List()
			}
			if err != nil {
				return err
			}
			return printIndexed(e, socks, protos, asJSON)
		},
	}
	c.Flags().StringVar(&backend, "backend", "", "only sockets connected to ADDR, or ADDR:PORT ([v6]:port)")
	c.Flags().StringVar(&proto, "proto", "all", "tcp, udp or all")
	c.Flags().BoolVar(&asJSON, "json", false, "print JSON")
	return c
}

func printIndexed(e *env, socks []sockindex.Socket, protos []sockindex.Proto, asJSON bool) error {
	names := host.NetnsNames()
	out := []indexedSocket{}
	for _, s := range socks {
		if !s.Proto.In(protos) {
			continue
		}
		is := indexedSocket{
			Proto: s.Proto.String(), Backend: s.Remote.String(), Cookie: s.Cookie,
			NetnsCookie: s.NetnsCookie, Netns: names[s.NetnsCookie], Owner: s.Owner,
			Since: s.Since.UTC().Format(time.RFC3339), Seeded: s.Seeded,
		}
		if s.LocalKnown {
			is.Local = s.Local.String()
		}
		out = append(out, is)
	}
	if asJSON {
		return writeJSON(e.stdout, out)
	}
	if len(out) == 0 {
		fmt.Fprintln(e.stdout, "no indexed sockets")
		return nil
	}
	w := tabwriter.NewWriter(e.stdout, 0, 4, 2, ' ', 0)
	fmt.Fprintln(w, "PROTO\tLOCAL\tBACKEND\tNETNS\tPID\tCOOKIE")
	for _, s := range out {
		local, ns := s.Local, s.Netns
		if local == "" {
			local = "(not sent yet)"
		}
		if ns == "" {
			ns = strconv.FormatUint(s.NetnsCookie, 10)
		}
		fmt.Fprintf(w, "%s\t%s\t%s\t%s\t%d\t%d\n", s.Proto, local, s.Backend, ns, s.Owner, s.Cookie)
	}
	return w.Flush()
}

// parseBackend reads ADDR, ADDR:PORT, [V6ADDR] or [V6ADDR]:PORT.
func parseBackend(s string) (netip.Addr, uint16, error) {
	if ap, err := netip.ParseAddrPort(s); err == nil {
		if ap.Port() == 0 {
			return netip.Addr{}, 0, usageError{fmt.Errorf("--backend %q: port 0 names no backend; leave the port out to mean every port", s)}
		}
		return ap.Addr().Unmap(), ap.Port(), nil
	}
	if a, err := netip.ParseAddr(strings.TrimSuffix(strings.TrimPrefix(s, "["), "]")); err == nil && a.Zone() == "" {
		return a.Unmap(), 0, nil
	}
	return netip.Addr{}, 0, usageError{fmt.Errorf("--backend %q: want an IP address with an optional port, like 10.0.0.5, 10.0.0.5:8080 or [fd00::5]:8080", s)}
}

func parseProto(s string) ([]sockindex.Proto, error) {
	switch s {
	case "tcp":
		return []sockindex.Proto{sockindex.TCP}, nil
	case "udp":
		return []sockindex.Proto{sockindex.UDP}, nil
	case "all", "":
		return []sockindex.Proto{sockindex.TCP, sockindex.UDP}, nil
	}
	return nil, usageError{fmt.Errorf("--proto %q: want tcp, udp or all", s)}
}
