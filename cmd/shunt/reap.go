package main

import (
	"fmt"
	"text/tabwriter"
	"time"

	"github.com/spf13/cobra"

	"github.com/shunt-project/shunt/host"
	"github.com/shunt-project/shunt/reap"
)

func newReapCmd(e *env, g *globals) *cobra.Command {
	var (
		backend string
		proto   string
		method  string
		dryRun  bool
		asJSON  bool
	)
	c := &cobra.Command{
		Use:   "reap --backend ADDR[:PORT] [--proto tcp|udp|all] [--dry-run] [--json]",
		Short: "Destroy every socket connected to a backend, in any namespace",
		Long: `reap destroys every socket on this host, in every network namespace, that
is connected to the backend: TCP sockets are aborted (the application gets
ECONNABORTED), connected UDP sockets get ECONNABORTED on their next call.
Without a port, every port of the address.

With the index enabled ('shunt index enable') reap sends one exact
SOCK_DESTROY per socket (tuple and cookie) in each namespace concerned, so its
time grows with the sockets destroyed, not with the sockets of the host. The
index covers the cgroup it was enabled for (by default the root: every
socket of the host); 'shunt status' shows which.
Without it, reap runs a socket iterator in every namespace and says so.`,
		Example: `  shunt reap --backend 10.0.0.5:8080
  shunt reap --backend [fd00::5]:53 --proto udp --dry-run`,
		Args: noArgs,
		RunE: func(c *cobra.Command, _ []string) error {
			addr, port, err := parseBackend(backend)
			if backend == "" {
				err = usageError{fmt.Errorf("--backend is required (see '%s --help')", c.CommandPath())}
			}
			if err != nil {
				return err
			}
			protos, err := parseProto(proto)
			if err != nil {
				return err
			}
			var m reap.Method
			switch method {
			case "auto":
			case "index", "iter":
				m = reap.Method(method)
			default:
				return usageError{fmt.Errorf("--method %q: want auto, index or iter", method)}
			}
			if err := host.CheckPrivileges(); err != nil {
				return err
			}
			res, err := reap.Reap(c.Context(), reap.Target{Addr: addr, Port: port, Protos: protos},
				reap.Options{IndexDir: g.indexDir, Method: m, DryRun: dryRun})
			if err != nil {
				return err
			}
			if asJSON {
				return writeJSON(e.stdout, res)
			}
			return printReap(e, res)
		},
	}
	c.Flags().StringVar(&backend, "backend", "", "the backend: ADDR, ADDR:PORT or [V6ADDR]:PORT")
	c.Flags().StringVar(&proto, "proto", "all", "tcp, udp or all")
	c.Flags().StringVar(&method, "method", "auto", "auto (the index if enabled, else iterators), index or iter")
	c.Flags().BoolVar(&dryRun, "dry-run", false, "list what would be destroyed, destroy nothing")
	c.Flags().BoolVar(&asJSON, "json", false, "print JSON")
	return c
}

func printReap(e *env, res *reap.Result) error {
	if res.Fallback != "" {
		fmt.Fprintf(e.stderr, "shunt: %s: searching every socket of every namespace instead\n", res.Fallback)
	}
	if res.NotIndexed > 0 {
		fmt.Fprintf(e.stderr, "shunt: warning: %d sockets could not be indexed (index full) and may be missed: --method iter searches them all\n", res.NotIndexed)
	}
	verb := "destroyed"
	if res.DryRun {
		verb = "would destroy"
	}
	if len(res.Sockets) == 0 {
		fmt.Fprintf(e.stdout, "no socket connected to %s (%s, %v)\n", res.Target, res.Method, res.Took.Round(time.Microsecond))
		return nil
	}
	w := tabwriter.NewWriter(e.stdout, 0, 4, 2, ' ', 0)
	fmt.Fprintln(w, "PROTO\tLOCAL\tBACKEND\tNETNS\tPID\tRESULT")
	names := host.NetnsNames()
	failed := 0
	for _, s := range res.Sockets {
		result := verb
		if s.Error != "" {
			result, failed = "failed: "+s.Error, failed+1
		}
		ns := names[s.NetnsCookie]
		if ns == "" {
			ns = fmt.Sprint(s.NetnsCookie)
		}
		fmt.Fprintf(w, "%s\t%s\t%s\t%s\t%d\t%s\n", s.Proto, s.Local, s.Remote, ns, s.Owner, result)
	}
	w.Flush()
	fmt.Fprintf(e.stdout, "%s %d sockets connected to %s in %d namespaces in %v (%s)\n",
		verb, len(res.Sockets)-failed, res.Target, res.Namespaces, res.Took.Round(time.Microsecond), res.Method)
	if failed > 0 {
		return fmt.Errorf("%d sockets could not be destroyed", failed)
	}
	return nil
}
