package bypass

import (
	"encoding/binary"
	"errors"
	"fmt"
	"os"
	"path/filepath"
	"slices"

	"github.com/cilium/ebpf"
	"github.com/cilium/ebpf/btf"
	"github.com/cilium/ebpf/link"
)

// MapFill is how full one map is.
type MapFill struct {
	Name    string `json:"name"`
	Entries int    `json:"entries"`
	Max     uint32 `json:"max"` // 0: grows with the sockets that use it
}

// Counters are events counted by the BPF programs since install. Each
// field's help tag says what it counts (shunt metrics exports them).
type Counters struct {
	Registered     uint64 `json:"handshakes_registered" help:"Connection requests registered by enabled servers."`
	Ambiguous      uint64 `json:"handshakes_ambiguous" help:"Connection requests with the same initial sequence numbers in two namespaces at once: not bypassed."`
	RegistryFull   uint64 `json:"handshakes_dropped" help:"Connection requests not registered (the registry could not take them): not bypassed."`
	Paired         uint64 `json:"connections_paired" help:"Connections bypassed."`
	Unpaired       uint64 `json:"connections_unpaired" help:"Local peers that could not be paired."`
	InsertFailed   uint64 `json:"insert_failed" help:"Socket storage or sockhash inserts that failed."`
	FallenBack     uint64 `json:"directions_fallen_back" help:"Directions that left the redirect path."`
	Throttled      uint64 `json:"directions_throttled" help:"Directions that left the redirect path because their reader fell behind."`
	Zerocopy       uint64 `json:"connections_zerocopy" help:"Connections left on TCP: an end set SO_ZEROCOPY (MSG_ZEROCOPY needs the TCP path)."`
	Excluded       uint64 `json:"connections_excluded" help:"Connections left on TCP: the server port is excluded."`
	TCPReaders     uint64 `json:"directions_tcp_reader" help:"Directions kept on TCP: the reader blocks in recv or asked for MSG_WAITALL, MSG_OOB or MSG_TRUNC."`
	Left           uint64 `json:"sockets_left" help:"Sockets moved back to plain TCP (out of the sockhash) after that."`
	EAGAIN         uint64 `json:"blocking_reads_eagain" help:"Blocking reads that got EAGAIN where TCP would have restarted (a signal, stop or ptrace)."`
	SpliceReaders  uint64 `json:"splice_readers" help:"Sockets whose reader spliced: sent back to TCP."`
	SpliceCaught   uint64 `json:"splice_readers_caught" help:"Splice readers caught with redirected bytes queued that splice cannot read (the guard resets them)."`
	LearnedReaders uint64 `json:"learned_readers" help:"Readers kept on TCP from their first recv: their program was seen splicing."`
	RefusedSends   uint64 `json:"sends_refused" help:"Sends failed with EACCES: the peer splices with redirected bytes unread (until the guard resets it)."`
	SplicesRefused uint64 `json:"splices_refused" help:"splice(2) calls from a bypassed socket refused with EINVAL before reading (BPF LSM kernels): the application read instead."`
	// SplicesRetried counts splices let through because the same socket's
	// last splice was refused and nothing read it since: a program that
	// does not read instead (HAProxy 2.6) is handled as without refusal.
	SplicesRetried  uint64 `json:"splices_retried" help:"splice(2) calls let through (--refuse-splice) because the same socket's last splice was refused and its reader read nothing since: sent back to TCP, caught if redirected bytes were queued."`
	ZerocopyRefused uint64 `json:"zerocopy_refused" help:"setsockopt(SO_ZEROCOPY) calls on a bypassed socket refused with EOPNOTSUPP: no completion would ever come."`
	// ULPRefused counts setsockopt(TCP_ULP) calls (kernel TLS) refused on
	// bypassed sockets: the kernel takes no TLS keys on a socket with a
	// psock, and the layer alone can leave a bypassed reader blind.
	ULPRefused uint64 `json:"ulp_refused" help:"setsockopt(TCP_ULP) calls (kernel TLS) on a bypassed socket refused with ENOENT: the kernel takes no TLS keys on a socket in a sockhash; the application keeps TLS in user space."`
	// UpperLayer counts connections left on TCP because an end had a TCP
	// upper layer protocol when it was established (an MPTCP subflow).
	UpperLayer uint64 `json:"connections_upper_layer" help:"Connections left on TCP: an end had a TCP upper layer protocol when established (an MPTCP subflow: both ends MPTCP), which a sockhash does not take."`
	// TxTimestamps counts connections kept on or sent back to TCP because
	// an end asked for transmit timestamps, which only TCP's transmit path
	// makes.
	TxTimestamps uint64 `json:"connections_tx_timestamps" help:"Connections kept on or sent back to TCP: an end asked for transmit timestamps (SO_TIMESTAMPING with a TX flag), which only TCP's transmit path makes."`
	// ZerocopyReceive counts connections kept on or sent back to TCP
	// because an end reads by getsockopt(TCP_ZEROCOPY_RECEIVE), which maps
	// TCP's receive queue alone.
	ZerocopyReceive uint64 `json:"connections_zerocopy_receive" help:"Connections kept on or sent back to TCP: an end reads by getsockopt(TCP_ZEROCOPY_RECEIVE), which maps TCP's receive queue alone."`
	// ZerocopyCaught counts those whose reader had redirected bytes queued
	// at a TCP_ZEROCOPY_RECEIVE call: it cannot map them, so the guard
	// resets the connection.
	ZerocopyCaught uint64 `json:"connections_zerocopy_receive_caught" help:"Of connections_zerocopy_receive: the reader had redirected bytes queued (read in before by read()), which zerocopy receive cannot map: the guard resets the connection."`
	// PeekReaders counts connections sent back to TCP because their reader
	// peeked in mid-stream: no peek reaches past redirected bytes.
	PeekReaders uint64 `json:"connections_peek_reader" help:"Connections sent back to TCP: the reader peeked (MSG_PEEK) in mid-stream, and no peek reaches past redirected bytes into TCP's queue; its peer's sends queue behind the redirected bytes until they are read."`
	// PeekStuck counts readers that peek at redirected bytes again and
	// again with TCP bytes behind them out of reach (reported by the guard).
	PeekStuck     uint64 `json:"readers_peek_stuck" help:"Readers that peeked three times in a row, reading nothing, at every redirected byte queued while TCP held more behind them, which no peek reaches: TCP bytes came behind before their first peek in mid-stream. The guard logs each with its pid and command."`
	CgroupsFull   uint64 `json:"cgroups_uncounted" help:"Sockets paired whose cgroup found no room among the per-cgroup counts (16,384 cgroups): their sends are not counted per cgroup."`
	StallsRescued uint64 `json:"stalls_rescued" help:"Readers found waiting with bytes queued (bytes FIONREAD did not count or a short read hid, or any for the stall scan), or told too few by FIONREAD where its answer cannot be corrected: their connection sent back to TCP and the reader woken."`
	// Translated counts the paired connections whose ends see different
	// addresses or ports (DNAT, REDIRECT, SNAT between them), included in Paired.
	Translated uint64 `json:"connections_translated" help:"Connections bypassed whose ends see different tuples (address translation between them): counted in connections_paired too."`
	// ReaderPort counts connections not paired because a reader of their
	// server port needed TCP within ReaderPortTTL (Stats.ReaderPorts).
	ReaderPort uint64 `json:"connections_reader_port" help:"Connections left on TCP unpaired: a reader of their server port needed TCP (blocking recv, MSG_WAITALL, splice) in the last 10 s."`
	// ReaderClient counts connections not paired because their client
	// process's reads of its connections to the same port needed TCP within
	// ReaderPortTTL (Stats.ReaderPorts, Client set).
	ReaderClient uint64 `json:"connections_reader_client" help:"Connections left on TCP unpaired: their client process read its last two connections to the same port in a way only TCP serves (blocking recv, MSG_WAITALL, io_uring) in the last 10 s."`
	// BriefPort counts connections not paired because their server port's
	// connections were brief lately (Stats.BriefPorts).
	BriefPort uint64 `json:"connections_brief_port" help:"Connections left on TCP unpaired: their server port's last 16 bypassed connections from the same client address in a row closed after at most 4 sends from each end, too few for the redirect to win back the pairing; one in 64 is still paired, to see whether they still are."`
	// ReaderHeld counts readers that read by TCP while their program was
	// on probation (ProbationReads).
	ReaderHeld uint64 `json:"readers_held" help:"Readers that read by TCP while their program (by command name) was new to the install: its readers of a role (accepted, connected) take no redirected bytes until the first of them has read 16 times without splicing, or twice and 1 s passed, so a program that reads a header and then splices is learned with no connection caught."`
	// PresumedSplicers counts bypassed sockets sent back to TCP when their
	// reader's program was learned splicing, before it spliced from them.
	PresumedSplicers uint64 `json:"presumed_splicers" help:"Bypassed sockets sent back to TCP when their reader's program was first seen splicing (before it could splice from them)."`
	// PresumedQueued counts those of PresumedSplicers that held redirected
	// bytes at that moment: a splice before their reader reads those is
	// caught (no hook before splice(2) reads on these kernels).
	PresumedQueued uint64 `json:"presumed_splicers_queued" help:"Of presumed_splicers, sockets that held redirected bytes unread at that moment: caught if their reader splices before it reads them."`
	// ClaimsUnbound counts servers that declined the socket that claimed
	// their handshake: the ACK that established them did not carry its
	// nonce (a claimant that is not the connection's client, or a
	// middlebox that strips TCP options).
	ClaimsUnbound uint64 `json:"claims_unbound" help:"Connections left on TCP: the ACK that established the server did not carry the claimant's nonce (a socket claimed a handshake it is not the client of, or a middlebox stripped the option)."`
	// EventsLost counts events the guard's ring had no room for (no
	// guard ran, or it fell behind), once per attempt: a caught
	// connection's report and a leaving socket's wake-up are tried again
	// until they fit.
	EventsLost uint64 `json:"guard_events_lost" help:"Events for the guard its ring had no room for (no guard running, or one behind), per attempt: a caught connection's report and a leaving socket's wake-up are tried again until they fit."`
	// SpliceTruncated counts, of SpliceCaught, the readers whose peer's
	// end of stream came before the guard's reset (at the catch, or while
	// the splice waited): the splice returned end of stream before the
	// redirected bytes (the application saw a short stream end).
	SpliceTruncated uint64 `json:"splice_readers_truncated" help:"Of the caught splice readers, those whose peer's end of stream came before the guard's reset (at the catch, or while the splice waited): the splice returned end of stream before the redirected bytes, so the application saw a short stream (alert on any)."`
	// FionreadCorrected counts FIONREAD answers that left queued bytes out
	// (this kernel's, for a socket in a sockhash) and were corrected.
	FionreadCorrected uint64 `json:"fionread_corrected" help:"FIONREAD answers that left out bytes queued for the reader (this kernel's answer for a socket in a sockhash) and were corrected."`
	// Urgent counts connections sent back to TCP because urgent data
	// (MSG_OOB) was sent on them: only TCP keeps that byte out of band.
	Urgent uint64 `json:"connections_urgent" help:"Connections sent back to TCP because urgent data (send with MSG_OOB) was sent on them: only TCP keeps that byte out of the stream."`
	// SmallWrites counts connections sent back to TCP because a writer
	// with Nagle's algorithm on streamed small sends over a loopback-sized
	// path: TCP gathers those into large segments, a redirect cannot.
	SmallWrites uint64 `json:"connections_small_writes" help:"Connections sent back to TCP because a writer with Nagle's algorithm on (no TCP_NODELAY) or TCP_CORK streamed small sends (64 of at most 16 KiB within 1 ms, no read between) over a path with loopback's large segments: TCP gathers such sends into large segments and moves more bytes than a redirect of each."`
	// BehindReader counts connections sent back to TCP because their
	// reader stayed behind its writer's TCP sends for BehindBytes in a row,
	// once the writer made BehindSends.
	BehindReader uint64 `json:"connections_behind_reader" help:"Connections sent back to TCP because their reader stayed behind its writer for 32 MiB of sends in a row once its writer made 4096 sends (it had not read every byte TCP carried, or the redirected bytes were past the bound): a reader slower than its writer never catches up, and the pair runs faster as plain TCP."`
	// ReceiveOptions counts sockets kept on TCP (or sent back) because
	// their reader set a receive option only TCP honours.
	ReceiveOptions uint64 `json:"receive_options" help:"Connections kept on TCP, or sent back to it, because an end set a receive option only TCP's receive path honours (SO_RCVLOWAT above 1, TCP_INQ, SO_PEEK_OFF, receive timestamps)."`
	// URingReaders counts directions kept on TCP (or sent back) because
	// their reader reads through io_uring: each completion says whether
	// bytes are left, which only TCP's receive path tells.
	URingReaders uint64 `json:"directions_uring_reader" help:"Directions kept on TCP, or sent back to it, because their reader reads through io_uring: each receive's completion says whether bytes are left (IORING_CQE_F_SOCK_NONEMPTY), which only TCP's receive path tells."`
}

// Program is a BPF program of the install and where it is attached.
type Program struct {
	Name     string   `json:"name"`
	ID       uint32   `json:"id"`       // program id (bpftool prog show id N)
	Links    []uint32 `json:"link_ids"` // BPF links attaching it
	Attached string   `json:"attached"` // what it is attached to
}

// Stats is the state of the install.
type Stats struct {
	Options  Options   `json:"options"` // as the install was created
	Programs []Program `json:"programs"`
	Maps     []MapFill `json:"maps"`
	Counters Counters  `json:"counters"`
	Draining bool      `json:"draining"`
	// FionreadCorrected: FIONREAD's answers are corrected where this
	// kernel's leave queued bytes out (Counters.FionreadCorrected).
	FionreadCorrected bool `json:"corrects_fionread"`
	// SplicePrograms were seen splicing from TCP sockets: their readers
	// stay on TCP.
	SplicePrograms []SpliceProgram `json:"splice_programs"`
	// NewPrograms are the programs the install met reading, and whether
	// their probation is over.
	NewPrograms []NewProgram `json:"new_programs"`
	// ExcludedPorts are server ports whose connections stay on TCP.
	ExcludedPorts []uint16 `json:"excluded_ports"`
	// ReaderPorts are server ports whose readers needed TCP lately: their
	// new connections are not paired until the entry expires.
	ReaderPorts []ReaderPort `json:"reader_ports"`
	// BriefPorts are server ports whose connections were brief lately:
	// most of their new connections are not paired.
	BriefPorts []BriefPort `json:"brief_ports"`
	// Totals is what the held sockets sent since install, by redirect and
	// by TCP; nil for an install made before per-cgroup counts.
	Totals *Traffic `json:"totals,omitempty"`
}

// Stats reads map fill and counters as the kernel left them: reading
// changes nothing (the verbs sweep; see sweep).
func (in *Install) Stats() (Stats, error) {
	s := Stats{Draining: in.Draining(), FionreadCorrected: in.FionreadCorrected()}
	var err error
	if s.Options, err = in.Options(); err != nil {
		return s, err
	}
	progs, err := in.programs()
	if err != nil {
		return s, err
	}
	s.Programs = progs
	if s.Maps, err = in.MapFills("sock_hash", "sock_states", isnHandshakesMap, "peer_refs", shortcutsMap); err != nil {
		return s, err
	}
	if s.ExcludedPorts, err = in.ExcludedPorts(); err != nil {
		return s, err
	}
	if s.ExcludedPorts == nil {
		s.ExcludedPorts = []uint16{}
	}
	if s.SplicePrograms, err = in.SplicePrograms(); err != nil {
		return s, err
	}
	if s.NewPrograms, err = in.NewPrograms(); err != nil {
		return s, err
	}
	if s.ReaderPorts, err = in.ReaderPorts(); err != nil {
		return s, err
	}
	if s.BriefPorts, err = in.BriefPorts(); err != nil {
		return s, err
	}
	if s.Counters, err = in.Counters(); err != nil {
		return s, err
	}
	switch t, err := in.Totals(); {
	case errors.Is(err, ErrNoCgroupTraffic):
	case err != nil:
		return s, err
	default:
		s.Totals = &t
	}
	return s, nil
}

// MapFills counts the entries of the named maps. sock_states, socket
// storage keyed by socket descriptors, is counted through an iterator over
// every open file of the machine: the costly one.
func (in *Install) MapFills(names ...string) ([]MapFill, error) {
	var out []MapFill
	for _, name := range names {
		m, ok := in.maps[name]
		if !ok {
			continue // an install made by an older shunt lacks it
		}
		f := MapFill{Name: name, Max: maxEntries(m)}
		if m.Type() == ebpf.SkStorage {
			recs, err := in.records()
			if err != nil {
				return nil, err
			}
			f.Entries = len(recs)
		} else {
			f.Entries = countKeys(m)
		}
		out = append(out, f)
	}
	return out, nil
}

// Counters sums the per-CPU counters of the BPF programs.
func (in *Install) Counters() (Counters, error) {
	var vals [bypassCounterCNT_MAX][]uint64
	// An install made by an older shunt has fewer counters: the rest are 0.
	n := min(int(in.maps["counters"].MaxEntries()), len(vals))
	for i := range vals[:n] {
		if err := in.maps["counters"].Lookup(uint32(i), &vals[i]); err != nil {
			return Counters{}, err
		}
	}
	sum := func(c bypassCounter) uint64 {
		var t uint64
		for _, v := range vals[c] {
			t += v
		}
		return t
	}
	return Counters{
		Registered:        sum(bypassCounterCNT_REGISTERED),
		Ambiguous:         sum(bypassCounterCNT_AMBIGUOUS),
		RegistryFull:      sum(bypassCounterCNT_REGISTRY_FULL),
		Paired:            sum(bypassCounterCNT_PAIRED),
		Unpaired:          sum(bypassCounterCNT_UNPAIRED),
		InsertFailed:      sum(bypassCounterCNT_INSERT_FAILED),
		FallenBack:        sum(bypassCounterCNT_FALLBACK),
		Throttled:         sum(bypassCounterCNT_THROTTLED),
		Zerocopy:          sum(bypassCounterCNT_ZEROCOPY),
		Excluded:          sum(bypassCounterCNT_EXCLUDED),
		TCPReaders:        sum(bypassCounterCNT_TCP_READER),
		Left:              sum(bypassCounterCNT_LEFT),
		EAGAIN:            sum(bypassCounterCNT_EAGAIN),
		SpliceReaders:     sum(bypassCounterCNT_SPLICE_READER),
		SpliceCaught:      sum(bypassCounterCNT_SPLICE_CAUGHT),
		LearnedReaders:    sum(bypassCounterCNT_LEARNED_READER),
		RefusedSends:      sum(bypassCounterCNT_REFUSED_SENDS),
		SplicesRefused:    sum(bypassCounterCNT_SPLICE_REFUSED),
		SplicesRetried:    sum(bypassCounterCNT_SPLICE_RETRIED),
		ZerocopyRefused:   sum(bypassCounterCNT_ZEROCOPY_REFUSED),
		ULPRefused:        sum(bypassCounterCNT_ULP_REFUSED),
		UpperLayer:        sum(bypassCounterCNT_UPPER_LAYER),
		TxTimestamps:      sum(bypassCounterCNT_TX_TIMESTAMPS),
		ZerocopyReceive:   sum(bypassCounterCNT_ZEROCOPY_RECEIVE),
		ZerocopyCaught:    sum(bypassCounterCNT_ZEROCOPY_CAUGHT),
		PeekReaders:       sum(bypassCounterCNT_PEEK_READER),
		PeekStuck:         sum(bypassCounterCNT_PEEK_STUCK),
		CgroupsFull:       sum(bypassCounterCNT_CGROUPS_FULL),
		StallsRescued:     sum(bypassCounterCNT_STALL_RESCUED),
		Translated:        sum(bypassCounterCNT_PAIRED_TRANSLATED),
		ReaderPort:        sum(bypassCounterCNT_READER_PORT),
		ReaderClient:      sum(bypassCounterCNT_READER_CLIENT),
		PresumedSplicers:  sum(bypassCounterCNT_PRESUMED_SPLICER),
		PresumedQueued:    sum(bypassCounterCNT_PRESUMED_QUEUED),
		ClaimsUnbound:     sum(bypassCounterCNT_CLAIM_UNBOUND),
		EventsLost:        sum(bypassCounterCNT_EVENTS_LOST),
		SpliceTruncated:   sum(bypassCounterCNT_SPLICE_TRUNCATED),
		FionreadCorrected: sum(bypassCounterCNT_FIONREAD_CORRECTED),
		Urgent:            sum(bypassCounterCNT_URGENT),
		SmallWrites:       sum(bypassCounterCNT_SMALL_WRITES),
		BehindReader:      sum(bypassCounterCNT_BEHIND_READER),
		BriefPort:         sum(bypassCounterCNT_BRIEF_PORT),
		ReaderHeld:        sum(bypassCounterCNT_READER_HELD),
		ReceiveOptions:    sum(bypassCounterCNT_RECEIVE_OPTION),
		URingReaders:      sum(bypassCounterCNT_URING_READER),
	}, nil
}

func maxEntries(m *ebpf.Map) uint32 {
	if m.Type() == ebpf.SkStorage {
		return 0
	}
	return m.MaxEntries()
}

// countKeys counts the entries of a map with ordinary keys.
func countKeys(m *ebpf.Map) int {
	n := 0
	// The first call must pass an untyped nil: a nil []byte is a zero-length
	// key, which the kernel rejects, and the count would silently be 0.
	var key any
	next := make([]byte, m.KeySize())
	for {
		if err := m.NextKey(key, &next); err != nil {
			return n
		}
		n++
		key = slices.Clone(next)
	}
}

// sweep removes state the BPF programs could not: published refs of
// sockets that closed after their cgroup was detached (the close callback runs only while attached). Attach and
// Detach run it; readers do not, so tests see what the kernel left.
// Their timer slots go back to the pool, as the close callback would have
// given them.
func (in *Install) sweep() {
	_, _ = in.CgroupTraffic() // deletes the counts of cgroups that are gone
	type stale struct {
		key  bypassSockKey
		slot uint32 // plus one; 0: none
	}
	refs := in.maps["peer_refs"]
	slotAt, pooled := in.timerSlotOffset()
	var key bypassSockKey
	var gone []stale
	it := refs.Iterate()
	val := make([]byte, refs.ValueSize())
	for it.Next(&key, &val) {
		var cookie uint64
		if in.maps["sock_hash"].Lookup(key, &cookie) != nil {
			s := stale{key: key}
			if pooled {
				s.slot = binary.NativeEndian.Uint32(val[slotAt:])
			}
			gone = append(gone, s)
		}
	}
	for _, s := range gone {
		// Only the delete that succeeds gives the slot back (the
		// programs' unpublish does the same).
		if refs.Delete(s.key) == nil && s.slot != 0 {
			_ = in.maps[freeTimersMap].Update(nil, s.slot-1, ebpf.UpdateAny)
		}
	}
}

// timerSlotOffset is where a peer_refs entry names its timer slot, if the
// install keeps its timers in a pool laid out as this shunt's.
func (in *Install) timerSlotOffset() (int, bool) {
	if in.maps[freeTimersMap] == nil {
		return 0, false
	}
	spec, err := newSpec()
	if err != nil || spec.Maps["peer_refs"].ValueSize != in.maps["peer_refs"].ValueSize() {
		return 0, false
	}
	var ref *btf.Struct
	if spec.Types.TypeByName("peer_ref", &ref) != nil {
		return 0, false
	}
	for _, m := range ref.Members {
		if m.Name == "timer" {
			return int(m.Offset.Bytes()), true
		}
	}
	return 0, false
}

// programs describes the install's programs from their pins.
func (in *Install) programs() ([]Program, error) {
	var out []Program
	info, err := in.sockops.Info()
	if err != nil {
		return nil, fmt.Errorf("sockops program info: %w", err)
	}
	id, _ := info.ID()
	sockops := Program{Name: "sockops", ID: uint32(id), Links: []uint32{}}
	cgs, err := in.Cgroups()
	if err != nil {
		return nil, err
	}
	for _, cg := range cgs {
		if lid, _, err := pinnedLinkIDs(in.cgroupPin(cg.ID)); err == nil {
			sockops.Links = append(sockops.Links, lid)
		}
	}
	sockops.Attached = fmt.Sprintf("%d cgroup(s)", len(sockops.Links))
	out = append(out, sockops)
	hooks, err := in.sockoptPrograms(cgs)
	if err != nil {
		return nil, err
	}
	out = append(out, hooks...)

	if in.SkMsgAttach() == "link" {
		lid, pid, err := pinnedLinkIDs(filepath.Join(in.dir, linksDir, skMsgLink))
		if err != nil {
			return nil, fmt.Errorf("sk_msg link info: %w", err)
		}
		out = append(out, Program{Name: "sk_msg", ID: pid, Links: []uint32{lid}, Attached: "map sock_hash"})
	} else {
		pid, err := pinnedProgID(filepath.Join(in.dir, progsDir, skMsgLink))
		if err != nil {
			return nil, fmt.Errorf("sk_msg program info: %w", err)
		}
		out = append(out, Program{Name: "sk_msg", ID: pid, Links: []uint32{}, Attached: "map sock_hash (attached to the map, no link)"})
	}

	reads, err := pinnedLinkInfo(filepath.Join(in.dir, linksDir, readsLinkName))
	if err != nil {
		return nil, fmt.Errorf("reader watch link info: %w", err)
	}
	watch := "tracepoint sock_recv_length"
	if t := reads.Tracing(); t != nil && ebpf.AttachType(t.AttachType) == ebpf.AttachTraceFExit {
		watch = "fexit tcp_bpf_recvmsg" // kernels without the tracepoint
	}
	out = append(out, Program{Name: "reads", ID: uint32(reads.Program), Links: []uint32{uint32(reads.ID)}, Attached: watch})

	lid, pid, err := pinnedLinkIDs(filepath.Join(in.dir, linksDir, splicesLink))
	if err != nil {
		return nil, fmt.Errorf("splice watch link info: %w", err)
	}
	out = append(out, Program{Name: "splices", ID: pid, Links: []uint32{lid}, Attached: "tracepoint tcp_rcv_space_adjust"})

	// Optional: pinned where this kernel offers them.
	for _, o := range []struct{ link, what, attached string }{
		{fionreadLink, "FIONREAD correction", "tracepoint syscalls/sys_exit_ioctl"}, // FIONREAD wrong and correctable
		{toldLink, "FIONREAD watch", "tracepoint syscalls/sys_exit_ioctl"},          // FIONREAD wrong, not correctable
		{refuseLink, "splice refusal", "lsm file_permission"},                       // BPF LSM
	} {
		lid, pid, err = pinnedLinkIDs(filepath.Join(in.dir, linksDir, o.link))
		switch {
		case errors.Is(err, os.ErrNotExist):
		case err != nil:
			return nil, fmt.Errorf("%s link info: %w", o.what, err)
		default:
			out = append(out, Program{Name: o.link, ID: pid, Links: []uint32{lid}, Attached: o.attached})
		}
	}
	return out, nil
}

func pinnedLinkIDs(pin string) (linkID, progID uint32, err error) {
	info, err := pinnedLinkInfo(pin)
	if err != nil {
		return 0, 0, err
	}
	return uint32(info.ID), uint32(info.Program), nil
}

func pinnedLinkInfo(pin string) (*link.Info, error) {
	l, err := link.LoadPinnedLink(pin, nil)
	if err != nil {
		return nil, err
	}
	defer l.Close()
	return l.Info()
}

func pinnedProgID(pin string) (uint32, error) {
	p, err := ebpf.LoadPinnedProgram(pin, nil)
	if err != nil {
		return 0, err
	}
	defer p.Close()
	info, err := p.Info()
	if err != nil {
		return 0, err
	}
	id, _ := info.ID()
	return uint32(id), nil
}
