package main

import (
	"errors"
	"fmt"
	"io"
	"strconv"
	"strings"
	"text/tabwriter"
	"time"

	"github.com/spf13/cobra"

	"github.com/shunt-project/shunt/bypass"
	"github.com/shunt-project/shunt/guard"
	"github.com/shunt-project/shunt/host"
	"github.com/shunt-project/shunt/policy"
	"github.com/shunt-project/shunt/sockindex"
)

// statusReport is the JSON shape of `shunt status --json` (docs/CLI.md).
type statusReport struct {
	PinDir    string                 `json:"pin_dir"`
	Installed bool                   `json:"installed"`
	Cgroups   []bypass.EnabledCgroup `json:"cgroups"`
	Stats     *bypass.Stats          `json:"bypass,omitempty"`
	Index     *sockindex.Status      `json:"index,omitempty"`  // absent when not enabled
	Policy    *policy.Report         `json:"policy,omitempty"` // absent when none is installed
	Features  host.Features          `json:"kernel"`
	// Mechanisms says, per feature, how this kernel gives it.
	Mechanisms []host.Mechanism `json:"mechanisms"`
	Guard      *guardStatus     `json:"guard,omitempty"` // absent when bypass is not enabled
	// FlowControl is the bound on a reader's unread redirected bytes in
	// shunt's own network namespace; absent when bypass is not enabled.
	FlowControl *flowControl `json:"flow_control,omitempty"`
}

// flowControl says what bounds a reader's unread redirected bytes here.
type flowControl struct {
	Bound uint64 `json:"bound"` // min(max_backlog, tcp_rmem_max - tcp_wmem_max * 9/8)
	bypass.TCPBuffers
}

// guardStatus says whether a guard watches the install (bypass guard).
type guardStatus struct {
	Running bool   `json:"running"`
	Log     string `json:"log"` // where a guard started by enable writes
}

func newStatusCmd(e *env, g *globals) *cobra.Command {
	var asJSON bool
	c := &cobra.Command{
		Use:   "status [--json]",
		Short: "Show what shunt has installed and what the kernel supports",
		Args:  noArgs,
		RunE: func(c *cobra.Command, _ []string) error {
			if err := host.CheckPrivileges(); err != nil {
				return err
			}
			rep := statusReport{PinDir: g.pinDir, Cgroups: []bypass.EnabledCgroup{}, Features: e.probe()}
			rep.Mechanisms = rep.Features.Mechanisms()
			in, err := bypass.Open(g.pinDir)
			switch {
			case errors.Is(err, bypass.ErrNotInstalled):
			case err != nil:
				return err
			default:
				defer in.Close()
				rep.Installed = true
				if rep.Cgroups, err = in.Cgroups(); err != nil {
					return err
				}
				st, err := in.Stats()
				if err != nil {
					return err
				}
				rep.Stats = &st
				rep.Guard = &guardStatus{Running: guard.Running(g.pinDir), Log: guard.LogPath(g.pinDir)}
				if bufs, err := bypass.ReadTCPBuffers(); err == nil {
					rep.FlowControl = &flowControl{Bound: bufs.Bound(st.Options.MaxBacklog), TCPBuffers: bufs}
				}
			}
			ix, err := sockindex.Open(g.indexDir)
			switch {
			case errors.Is(err, sockindex.ErrNotEnabled):
			case err != nil:
				return err
			default:
				defer ix.Close()
				st, err := ix.Status()
				if err != nil {
					return err
				}
				rep.Index = &st
			}
			pol, err := policy.Open(g.policyDir)
			switch {
			case errors.Is(err, policy.ErrNotEnabled):
			case err != nil:
				return err
			default:
				defer pol.Close()
				if rep.Policy, err = pol.Show(); err != nil {
					return err
				}
			}
			if asJSON {
				return writeJSON(e.stdout, rep)
			}
			printStatus(e, rep)
			return nil
		},
	}
	c.Flags().BoolVar(&asJSON, "json", false, "print JSON")
	return c
}

// pidList names a few pids, and how many more there are.
func pidList(pids []int) string {
	if len(pids) == 0 {
		return "no process now"
	}
	var b strings.Builder
	for i, p := range pids {
		if i == 5 {
			fmt.Fprintf(&b, " and %d more", len(pids)-i)
			break
		}
		if i > 0 {
			b.WriteString(", ")
		}
		fmt.Fprintf(&b, "pid %d", p)
	}
	return b.String()
}

func printStatus(e *env, r statusReport) {
	w := tabwriter.NewWriter(e.stdout, 0, 4, 2, ' ', 0)
	defer w.Flush()
	if !r.Installed {
		fmt.Fprintf(w, "bypass:\tnot enabled (nothing pinned at %s)\n", r.PinDir)
	} else {
		state := "enabled"
		if r.Stats.Draining {
			state = "draining (being removed; all sends take the TCP path; 'shunt bypass disable --all' finishes once readers have read what was redirected to them, or at once with --force, which resets their connections)"
		}
		fmt.Fprintf(w, "bypass:\t%s, pinned at %s\n", state, r.PinDir)
		for _, cg := range r.Cgroups {
			p := cg.Path
			if p == "" {
				p = "(cgroup removed)"
			}
			fmt.Fprintf(w, "cgroup:\t%s (id %d)\n", p, cg.ID)
		}
		fmt.Fprintf(w, "options:\t%s\n", describeOptions(r.Stats.Options))
		if fc := r.FlowControl; fc != nil {
			fmt.Fprintf(w, "flow control:\ta reader here may hold %s unread by redirect before its writer's sends take TCP (the least of --max-backlog and what tcp_rmem[2], %s, leaves beside the writer's send buffer, tcp_wmem[2] %s, and an eighth of it; in other network namespaces by their own; the reader's SO_RCVBUF, the writer's SO_SNDBUF where they set one)\n",
				humanBytes(fc.Bound), humanBytes(fc.RmemMax), humanBytes(fc.WmemMax))
		}
		for _, p := range r.Stats.Programs {
			fmt.Fprintf(w, "program %s:\tid %d, attached to %s (links %v)\n", p.Name, p.ID, p.Attached, p.Links)
		}
		for _, m := range r.Stats.Maps {
			if m.Max == 0 {
				fmt.Fprintf(w, "map %s:\t%d entries\n", m.Name, m.Entries)
			} else {
				fmt.Fprintf(w, "map %s:\t%d of %d entries\n", m.Name, m.Entries, m.Max)
			}
		}
		if t := r.Stats.Totals; t != nil {
			fmt.Fprintf(w, "sent:\t%s in %d sends redirected, %s in %d sends by TCP (sockets shunt held, since install)\n",
				humanBytes(t.RedirectedBytes), t.RedirectedSends, humanBytes(t.TCPBytes), t.TCPSends)
		}
		c := r.Stats.Counters
		fmt.Fprintf(w, "connections:\t%d paired (%d through address translation), %d local peers not paired, %d ambiguous handshakes, %d registry full, %d insert failures\n",
			c.Paired, c.Translated, c.Unpaired, c.Ambiguous, c.RegistryFull, c.InsertFailed)
		fmt.Fprintf(w, "fallbacks:\t%d directions moved to the TCP path, %d throttled by flow control, %d connections sent back to TCP behind a reader slower than its writer\n", c.FallenBack, c.Throttled, c.BehindReader)
		fmt.Fprintf(w, "kept on TCP:\t%d connections with an SO_ZEROCOPY end, %d to excluded ports, %d directions whose reader blocks or uses MSG_WAITALL, MSG_OOB or MSG_TRUNC, %d read through io_uring (its completions say whether bytes are left), %d connections that carried urgent data, %d whose writer streamed small sends with Nagle's algorithm on over loopback (TCP gathers them into large segments), %d for a receive option only TCP honours (SO_RCVLOWAT, TCP_INQ, SO_PEEK_OFF, timestamps) (%d sockets back on plain TCP), %d connections not paired to ports whose reader needed TCP, %d not paired from client processes whose reads of their connections to the same port did, %d not paired to ports whose connections are brief (a pairing costs them more than it wins), %d MPTCP connections (an upper layer on their subflows), %d for transmit timestamps, %d with a TCP_ZEROCOPY_RECEIVE reader (%d caught with redirected bytes queued: reset by the guard), %d whose reader peeked in mid-stream\n", c.Zerocopy, c.Excluded, c.TCPReaders, c.URingReaders, c.Urgent, c.SmallWrites, c.ReceiveOptions, c.Left, c.ReaderPort, c.ReaderClient, c.BriefPort, c.UpperLayer, c.TxTimestamps, c.ZerocopyReceive, c.ZerocopyCaught, c.PeekReaders)
		fmt.Fprintf(w, "stalls:\t%d readers found waiting with bytes queued that FIONREAD or a short read did not show, or with the peer's end unread, or told too few by FIONREAD where it cannot be corrected: sent back to TCP and woken by the guard; %d readers found peeking again and again at redirected bytes with TCP bytes behind them out of a peek's reach (logged by the guard)\n", c.StallsRescued, c.PeekStuck)
		if r.Stats.FionreadCorrected {
			fmt.Fprintf(w, "FIONREAD:\t%d answers corrected (the kernel's left queued bytes out)\n", c.FionreadCorrected)
		}
		fmt.Fprintf(w, "differences:\t%d blocking reads failed with EAGAIN where TCP would have restarted them (a signal), %d setsockopt(SO_ZEROCOPY) refused with EOPNOTSUPP, %d setsockopt(TCP_ULP) (kernel TLS) refused with ENOENT (docs/TRANSPARENCY.md)\n", c.EAGAIN, c.ZerocopyRefused, c.ULPRefused)
		fmt.Fprintf(w, "splice readers:\t%d splices refused with EINVAL (the application read instead), %d let through after a refused one (the application did not read instead), %d sockets sent back to TCP when their reader spliced, %d caught with redirected bytes queued (reset by the guard; %d of them cut short: their peer's end of stream came first and the splice returned it), %d readers kept on TCP because their program splices, %d sockets sent back to TCP when their program was learned (%d of them with redirected bytes queued), %d readers that read by TCP while their program was new to shunt (until one of its readers read 16 times without splicing, or twice and 1 s passed)\n", c.SplicesRefused, c.SplicesRetried, c.SpliceReaders, c.SpliceCaught, c.SpliceTruncated, c.LearnedReaders, c.PresumedSplicers, c.PresumedQueued, c.ReaderHeld)
		for _, p := range r.Stats.SplicePrograms {
			line := "any command line (taught by name)"
			if !p.ByName {
				line = strconv.Quote(p.CommandLine)
			}
			fmt.Fprintf(w, "splicer %s:\t%s, seen %s, %d splices, %d caught, running as %s (shunt bypass forget %s)\n",
				p.Command, line, p.First.Format(time.RFC3339), p.Splices, p.Caught, pidList(p.PIDs), p.Command)
		}
		for _, p := range r.Stats.NewPrograms {
			if p.Admitted {
				continue
			}
			fmt.Fprintf(w, "new program %s (%s connections):\tits readers read by TCP until one of them has read %d times without splicing (%d so far), or %d times and %s passed (began %s ago); %d readers held so far\n",
				p.Command, p.Role, bypass.ProbationReads, p.ProbeReads, bypass.ProbationTimeReads, bypass.ProbationTime, time.Since(p.Since).Round(time.Millisecond), p.Held)
		}
		for _, p := range r.Stats.ReaderPorts {
			if p.Client {
				fmt.Fprintf(w, "reader client %d (%s):\tneeded TCP to read its connections to port %d %s ago (netns cookie %d): the ones it makes stay unpaired for %s more, %d so far\n",
					p.PID, p.Command, p.Port, time.Since(p.Seen).Round(time.Second), p.Netns, time.Until(p.Expires).Round(time.Second), p.Kept)
				continue
			}
			fmt.Fprintf(w, "reader port %d:\tpid %d (%s) needed TCP to read it %s ago (netns cookie %d): new connections stay unpaired for %s more, %d so far\n",
				p.Port, p.PID, p.Command, time.Since(p.Seen).Round(time.Second), p.Netns, time.Until(p.Expires).Round(time.Second), p.Kept)
		}
		for _, p := range r.Stats.BriefPorts {
			fmt.Fprintf(w, "brief port %d from %s:\tits last %d bypassed connections from there in a row closed after at most %d sends each way, the last %s ago (netns cookie %d): new ones stay unpaired but one in %d, for %s more unless one of those sends more, %d so far\n",
				p.Port, p.Client, bypass.BriefStreak, bypass.BriefSends, time.Since(p.Seen).Round(time.Second), p.Netns, bypass.BriefSample, time.Until(p.Expires).Round(time.Second), p.Kept)
		}
		if c.EventsLost > 0 {
			fmt.Fprintf(w, "guard events lost:\t%d attempts found no room in the guard's ring (no guard ran, or it fell behind): reports of caught connections and wake-ups of leaving sockets are tried again until they fit\n", c.EventsLost)
		}
		if r.Guard.Running {
			fmt.Fprintf(w, "guard:\trunning, log %s\n", r.Guard.Log)
		} else {
			fmt.Fprintf(w, "guard:\tNOT running: a caught splice reader waits until its own timeout; start one with 'shunt bypass guard'\n")
		}
		if len(r.Stats.ExcludedPorts) > 0 {
			fmt.Fprintf(w, "excluded ports:\t%v\n", r.Stats.ExcludedPorts)
		}
	}
	if ix := r.Index; ix == nil {
		fmt.Fprintf(w, "index:\tnot enabled\n")
	} else {
		cg := ix.Cgroup
		if cg == "" {
			cg = fmt.Sprintf("(cgroup %d, removed)", ix.CgroupID)
		}
		fmt.Fprintf(w, "index:\tenabled for %s, pinned at %s\n", cg, ix.Dir)
		fmt.Fprintf(w, "indexed:\t%d sockets, %d backends seen; %d added, %d removed, %d not indexed (full)\n",
			ix.Sockets, ix.Backends, ix.Counters.Added, ix.Counters.Removed, ix.Counters.Full)
		if n := ix.Counters.NotRemoved; n > 0 {
			fmt.Fprintf(w, "index:\t%d entries of closed sockets stayed (the map's lock refused their removal); 'shunt index disable' and enable again clears them\n", n)
		}
	}
	printPolicyStatus(w, r.Policy)
	f := r.Features
	fmt.Fprintf(w, "kernel:\t%s\n", f.Kernel)
	for _, m := range r.Mechanisms {
		via := m.Via
		if via == "" {
			via = "MISSING"
		}
		fmt.Fprintf(w, "%s:\t%s\n", m.Feature, via)
	}
	if err := f.Err(); err != nil {
		fmt.Fprintf(w, "features:\t%v\n", err)
	} else {
		fmt.Fprintf(w, "features:\teverything bypass needs\n")
	}
}

// printPolicyStatus gives one line per scope: what its rules and default
// decided ('shunt policy show' has them rule by rule).
func printPolicyStatus(w io.Writer, rep *policy.Report) {
	if rep == nil {
		fmt.Fprintf(w, "policy:\tnone\n")
		return
	}
	fmt.Fprintf(w, "policy:\t%d scopes ('shunt policy show' lists the rules)\n", len(rep.Scopes))
	for _, s := range rep.Scopes {
		name := s.Cgroup
		if name == "" {
			name = fmt.Sprintf("(cgroup %d, removed)", s.CgroupID)
		}
		for _, d := range policy.Directions {
			rr := s.Of(d)
			var denied, allowed, closed uint64
			add := func(a policy.Action, c policy.Counts) {
				if a == policy.Deny {
					denied += c.Connects + c.Sends
				} else {
					allowed += c.Connects + c.Sends
				}
				closed += c.Closed
			}
			for _, r := range rr.Rules {
				add(r.Action, r.Counts)
			}
			add(rr.Default, rr.DefaultCounts)
			fmt.Fprintf(w, "scope %s %s:\t%d rules, default %s; %d connections and datagrams denied, %d allowed, %d open connections closed\n",
				name, d, len(rr.Rules), rr.Default, denied, allowed, closed)
		}
	}
}

// describeOptions says how an install was created, in the flags' words.
func describeOptions(o bypass.Options) string {
	readers := "redirect once a reader has called recv"
	if o.TrustReaders {
		readers = "--trust-readers (redirect from the first byte)"
	}
	if o.RefuseSplice {
		readers += ", --refuse-splice"
	}
	if o.PairBrief {
		readers += ", --pair-brief"
	}
	if o.NoProbation {
		readers += ", --no-probation"
	}
	if o.NoFIONREADWatch {
		readers += ", --no-fionread-watch"
	}
	return fmt.Sprintf("--max-backlog %s, %s", formatSize(uint64(o.MaxBacklog)), readers)
}
