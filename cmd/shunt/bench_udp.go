package main

import (
	"fmt"
	"io"
	"strings"
	"text/tabwriter"
	"time"

	"github.com/spf13/cobra"
	"github.com/spf13/pflag"

	"github.com/shunt-project/shunt/bench"
	"github.com/shunt-project/shunt/bench/report"
	"github.com/shunt-project/shunt/host"
)

func newBenchUDPCmd(e *env) *cobra.Command {
	var (
		cfg bench.UDPConfig
		f   udpFlags
	)
	c := &cobra.Command{
		Use:   "udp",
		Short: "Two UDP sockets joined in the kernel against a user-space relay",
		Long: `udp measures what 'shunt splice' and the daemon do for UDP: two connected
UDP sockets joined in the kernel (kernel), against the relay a UDP proxy runs,
a goroutine per direction reading one socket and writing the other (relay).
Client and echo server run on CPU 1, the relay on CPU 0. For each datagram
size and mode (interleaved, --rounds times): --requests round trips (p50,
p99, p99.9, max, lost), then --bulk-time of the client sending as fast as it
can (datagrams sent and delivered, Gbit/s, whole-machine CPU per GB).`,
		Example: `  shunt bench udp --sizes 64,1400 --out /tmp/udp`,
		Args:    noArgs,
		RunE: func(c *cobra.Command, _ []string) error {
			var err error
			if cfg.Sizes, cfg.Modes, err = f.parse(); err != nil {
				return err
			}
			cfg.Requests, cfg.BulkTime, cfg.Rounds, cfg.Progress = f.requests, f.bulkTime, f.rounds, f.progress(e)
			if err := cfg.Check(); err != nil {
				return usageError{err}
			}
			if err := host.CheckPrivileges(); err != nil {
				return err
			}
			res, err := bench.RunUDP(c.Context(), cfg)
			if err != nil {
				return err
			}
			return emitBench(e, res, f.out, f.asJSON, printUDP, report.UDP)
		},
	}
	f.register(c.Flags(), "udp", "64,1400", "datagram sizes in bytes (8 to 65507)", bench.UDPModes, "kernel (joined by shunt), relay (user space)")
	return c
}

func printUDP(out io.Writer, res []bench.UDPResult) {
	w := tabwriter.NewWriter(out, 0, 4, 2, ' ', tabwriter.AlignRight)
	fmt.Fprintln(w, "mode\tsize\tp50\tp99\tmax\tlost\tsent\tdelivered\tGbit/s\tCPU s/GB\t")
	for _, r := range res {
		fmt.Fprintf(w, "%s\t%d\t%v\t%v\t%v\t%d\t%d\t%d\t%.2f\t%.2f\t\n", r.Mode, r.Size, r.RoundTrip.P50, r.RoundTrip.P99, r.RoundTrip.Max,
			r.Lost, r.Sent, r.Delivered, r.Gbps, r.CPUPerGB)
	}
	w.Flush()
}

// udpFlags are bench udp's flags: sizes and modes swept over interleaved
// rounds, with round trips and a bulk run each.
type udpFlags struct {
	sizes, modes, out string
	asJSON            bool
	requests, rounds  int
	bulkTime          time.Duration
}

func (f *udpFlags) register(fs *pflag.FlagSet, name, sizes, sizesHelp string, modes []string, modesHelp string) {
	fs.StringVar(&f.sizes, "sizes", sizes, sizesHelp)
	fs.StringVar(&f.modes, "modes", strings.Join(modes, ","), modesHelp)
	fs.IntVar(&f.requests, "requests", 20000, "round trips per run")
	fs.DurationVar(&f.bulkTime, "bulk-time", 2*time.Second, "sending time per bulk run")
	fs.IntVar(&f.rounds, "rounds", 3, "interleaved rounds")
	fs.StringVar(&f.out, "out", "", "write "+name+".md and "+name+".json to this directory")
	fs.BoolVar(&f.asJSON, "json", false, "print JSON")
}

// parse reads --sizes and --modes.
func (f *udpFlags) parse() (sizes []int, modes []string, err error) {
	if sizes, err = parseSizes("--sizes", f.sizes); err != nil {
		return nil, nil, err
	}
	for _, m := range strings.Split(f.modes, ",") {
		modes = append(modes, strings.TrimSpace(m))
	}
	return sizes, modes, nil
}

// progress is where a sweep reports its runs: stderr, unless it prints JSON.
func (f *udpFlags) progress(e *env) io.Writer {
	if f.asJSON {
		return nil
	}
	return e.stderr
}
