// Package bypass installs and reads shunt's TCP bypass: sockops pairs the
// sockets of host-local connections and sk_msg moves each send straight into
// the peer's receive queue. State lives pinned in bpffs, so bypass keeps
// working after the installing process exits.
package bypass

import (
	"cmp"
	"errors"
	"fmt"
	"os"
	"path/filepath"
	"time"

	"github.com/cilium/ebpf"
	"github.com/cilium/ebpf/btf"
	"github.com/cilium/ebpf/link"
	"golang.org/x/sys/unix"

	"github.com/shunt-project/shunt/host"
	"github.com/shunt-project/shunt/internal/pin"
	"github.com/shunt-project/shunt/internal/sockmap"
)

// DefaultPinDir is where the install lives in bpffs.
const DefaultPinDir = "/sys/fs/bpf/shunt"

// redirectSettle bounds how long a redirect decided before a switch (drain,
// or a reader that needs TCP) may still be landing: it completes inside the
// sender's sendmsg, after the verdict, without a lock anyone else can wait on.
const redirectSettle = 100 * time.Millisecond

// stallAfter is how long a reader may go without reading after a read left
// bytes queued that FIONREAD does not count on this kernel, before shunt
// takes it for a reader waiting on an edge that never comes: an event loop
// that reads on does so within microseconds.
const stallAfter = 20 * time.Millisecond

// toldZeroStallAfter is stallAfter for a reader that FIONREAD, uncorrected,
// tells 0 while TCP holds bytes for it (6.18 under lockdown): one that
// trusts the answer waits at once, one that does not reads on at once.
const toldZeroStallAfter = 2 * time.Millisecond

// scanStallAfter is how long the stall scan lets a held socket sit with
// bytes queued that FIONREAD does not count, and nothing read, before it
// sends the connection to TCP and the guard wakes the reader. The guard
// scans as often, so such a reader is found within twice this.
const scanStallAfter = 500 * time.Millisecond

// ErrNotInstalled means no bypass install exists at the pin directory.
var ErrNotInstalled = errors.New("bypass is not enabled")

// Pin layout below the install directory.
const (
	mapsDir       = "maps"
	progsDir      = "progs"
	linksDir      = "links"
	cgroupsDir    = "cgroups"
	skMsgLink     = "sk_msg"
	refuseLink    = "refuse_splice"
	readsLinkName = "reads"
	splicesLink   = "splices"
	fionreadLink  = "fionread"
	toldLink      = "fionread_told"
)

var pinnedMaps = []string{"sock_hash", "sock_states", "control", "counters", "peer_refs", "excluded_ports", "guard_events"}

// cgroupSendsMap holds per-cgroup send counts (not in pinnedMaps: an
// install from before it lacks it).
const cgroupSendsMap = "cgroup_sends"

// isnHandshakesMap holds handshakes by sequence numbers (not in pinnedMaps:
// installs made before pairing through address translation have none).
const isnHandshakesMap = "isn_handshakes"

// readerPortsMap holds the server ports whose readers needed TCP lately (not
// in pinnedMaps: older installs have none).
const readerPortsMap = "reader_ports"

// shortcutsMap holds the joins whose legs bypass may pass by (shortcut.go;
// not in pinnedMaps: older installs have none).
const shortcutsMap = "shortcuts"

// wakesDeliveredMap holds when the guard last woke each socket's reader
// (stalls.go), readerFDsMap the descriptor each was read through, which
// the stall scan writes too (neither in pinnedMaps: older installs have
// none).
const (
	wakesDeliveredMap = "wakes_delivered"
	readerFDsMap      = "reader_fds"
)

// The sockets' timers, a pool of slots (leave_timers), the slots given back
// (free_timers) and how many were ever taken (timer_pool); peer_refs entries
// name their slot. Not in pinnedMaps: older installs keep a timer in each
// peer_refs entry instead.
const (
	leaveTimersMap = "leave_timers"
	freeTimersMap  = "free_timers"
	timerPoolMap   = "timer_pool"
)

// ReaderPortTTL is how long a server port whose reader needed TCP (a
// blocking recv, MSG_WAITALL, a splice) keeps its new connections unpaired:
// paired, each would be taken out again at its first read. After it, one
// connection is paired again, so a port whose program changed is bypassed
// within this, and one whose program did not is learned again.
const ReaderPortTTL = 10 * time.Second

// ReaderClientStreak is how many of a client process's connections to one
// port in a row must have needed TCP (their reader blocked in recv or asked
// for MSG_WAITALL) before the next ones it makes to that port stay unpaired,
// for ReaderPortTTL. One is no habit: redis-benchmark reads the server's
// configuration on a blocking connection before its event-loop ones, and a
// connection of that process to the port read without blocking ends the
// streak.
const ReaderClientStreak = 2

// A server port whose last BriefStreak bypassed connections from one client
// address in a row each closed after at most BriefSends sends from either
// end leaves its next connections from there unpaired, all but one in BriefSample (BriefPort): a pairing
// costs more than a few redirected sends win back (ab without keep-alive
// against nginx ran at 0.60x of plain TCP with each connection paired; a
// connection per request behind nginx's stream proxy at 0.92x). The one in
// BriefSample paired to look costs the port about 1/BriefSample of that.
const (
	BriefStreak = 16
	BriefSends  = 4
	BriefSample = 64
)

// A program new to the install reads by TCP on all its connections of a
// role (accepted, connected) until the first of them, its probe, has read
// ProbationReads times without splicing, or ProbationTime passed since the
// probe began and the probe read ProbationTimeReads times: a program that
// reads a header and then splices (HAProxy's splice-response, a Go proxy's
// io.Copy) splices within that from a socket holding nothing splice cannot
// read, and is learned with no connection caught, where each of its
// connections holding redirected bytes then was (HAProxy, 20 concurrent
// connections: 2 and 4 resets in 2 of 14 runs). Time alone proves nothing:
// a probe that read its header and waits for a slow upstream's body before
// it splices has read once. Counted: Counters.ReaderHeld.
const (
	ProbationReads     = 16
	ProbationTime      = time.Second
	ProbationTimeReads = 2
)

// BehindBytes is how many bytes in a row a socket may send by TCP because
// its peer's reader is behind (it has not read every byte TCP carried, or
// the redirected ones are past the bound) before the connection goes back
// to TCP: a reader slower than its writer never catches up, and over the
// sockhash the pair then ran at 0.62-0.75x plain TCP (reads of 4 KiB a
// wake-up under 64 KiB writes). A throttle a reader recovers from sends a
// few MiB by TCP (its send buffer and receive window: 1.9 MiB an episode,
// docs/BENCHMARKS.md), and a run must also be longer than all the direction
// redirected: a stream that moved GBs by redirect keeps it through a long
// throttle. Counted: Counters.BehindReader.
const BehindBytes = 32 << 20

// BehindSends is how many sends a socket makes before BehindBytes applies
// to it: in a stream's first moments a fast reader on its writer's CPU can
// trail 32 MiB of TCP sends and still catch up (256 KiB writes and reads
// were sent back in 4-5 of 6 one-second runs, at 1.0x TCP instead of
// 1.2-1.5x; judged after 4096 sends, in none, while slow readers still were).
// 4096 sends are 256 MiB of 64 KiB writes.
const BehindSends = 4096

// recvProgramsMap holds the programs on probation or past it (not in
// pinnedMaps: older installs have none).
const recvProgramsMap = "recv_programs"

// briefPortsMap holds the ports (not in pinnedMaps: older installs have none).
const briefPortsMap = "brief_ports"

// learnedMap is pinned beside the install (LearnedDir), not in it, so what
// shunt learned outlives a removal and applies to the next install.
const learnedMap = "splice_programs"

// LearnedDir is where an install at dir keeps the programs it saw splicing.
func LearnedDir(dir string) string { return dir + "-learned" }

// DefaultMaxBacklog is how many redirected bytes a receiver may hold unread
// before its writer is moved to TCP, unless the receiver set SO_RCVBUF or
// its tcp_rmem[2] leaves less (BacklogBound). 16 MiB moved 1.18-1.26x the
// bytes at 16 and 64 KiB writes on one CPU and 0.84x at 256 KiB
// (docs/BENCHMARKS.md, "The writer's send buffer in the bound").
const DefaultMaxBacklog = 8 << 20

// Options shape a new install.
type Options struct {
	// MaxBacklog bounds the unread redirected bytes per receiving socket
	// (flow control); 0 means DefaultMaxBacklog.
	MaxBacklog uint32 `json:"max_backlog"`
	// TrustReaders redirects to a socket before its reader has been seen
	// in recv, so a connection's first exchange is bypassed too. Only for
	// applications that never splice(2) from their sockets: bytes
	// redirected to a splice reader never reach it.
	TrustReaders bool `json:"trust_readers"`
	// RefuseSplice refuses a splice(2) from a bypassed socket with EINVAL
	// before it reads (lsm/file_permission; kernels that run BPF LSM
	// programs). For applications that read instead when a splice fails
	// with EINVAL, as Go's io.Copy does: their connections stay bypassed.
	// A program that splices again without reading (HAProxy 2.6) has that
	// splice let through, and is handled as without RefuseSplice.
	RefuseSplice bool `json:"refuse_splice"`
	// PairBrief pairs every connection, also those to ports whose
	// connections were brief lately (BriefPort), which are otherwise left
	// unpaired.
	PairBrief bool `json:"pair_brief"`
	// NoProbation admits every reader at its first non-blocking read, also
	// of programs new to the install (ProbationReads): for hosts where no
	// program reads a header and then splices, and for tests whose every
	// end is one process.
	NoProbation bool `json:"no_probation"`
	// NoFIONREADWatch leaves out, where FIONREAD leaves bytes out of a
	// socket in the sockhash and cannot be corrected (lockdown), the
	// tracepoint on the ioctl system call's exit that sends a reader told
	// too few to TCP at once: every system call of the host keeps the
	// kernel's fast path (with it, 62-69 ns more each on these VMs), and
	// such a reader waits for the stall watch (one that waits for an
	// edge: 2-20 ms) or the stall scan (one that sleeps while told 0: up
	// to 1 s) instead.
	NoFIONREADWatch bool `json:"no_fionread_watch"`
	// Mechanisms: the zero value uses the kernel's newest; tests set it
	// to run an older kernel's ways on this one.
	Mechanisms host.Mechanisms `json:"-"`
	// ProbationLimit replaces ProbationTime in the programs; 0 keeps it.
	// Tests under qemu set it longer: there setting up a few connections
	// can outlast a second, and end a probation before its probe splices.
	ProbationLimit time.Duration `json:"-"`
	// settle replaces redirectSettle in the programs (tests only).
	settle time.Duration
	// smallWindow replaces smallWriteWindow in the programs (tests only:
	// a kernel under qemu sends 64 times in 1 ms seldom).
	smallWindow time.Duration
	// behindBytes and behindSends replace BehindBytes and BehindSends in
	// the programs (tests only; behindBytes ^0: never).
	behindBytes, behindSends uint32
}

// ErrNoSpliceRefusal: RefuseSplice asked on a kernel that runs no BPF LSM
// programs.
var ErrNoSpliceRefusal = errors.New("refusing splices needs a kernel that runs BPF LSM programs (\"bpf\" in /sys/kernel/security/lsm, no lockdown); this one does not")

// Install is a bypass installation pinned in bpffs.
type Install struct {
	dir     string
	maps    map[string]*ebpf.Map
	sockops *ebpf.Program
	// sockopts are the hooks each enabled cgroup gets with sockops (those
	// the install has: sockoptHooks).
	sockopts []loadedSockopt
	// refuseIterators makes the drain fail as on a kernel that refuses its
	// iterator (tests of a forced removal).
	refuseIterators bool
}

// Dir returns the pin directory.
func (in *Install) Dir() string { return in.dir }

// Create installs bypass at dir, or opens the install already there (whose
// options stay as they were). The install is built in a temporary directory
// beside dir and renamed into place, so a crash never leaves half an install.
func Create(dir string, opts Options) (*Install, error) {
	if in, err := Open(dir); err == nil {
		return in, nil
	} else if !errors.Is(err, ErrNotInstalled) {
		return nil, err
	}

	if err := pin.Claim(LearnedDir(dir)); err != nil {
		return nil, err
	}
	_, statErr := os.Stat(LearnedDir(dir))
	learned, err := openLearned(dir)
	if err != nil {
		return nil, err
	}
	defer learned.Close()
	if err := pin.Install(dir, func(tmp string) error { return build(tmp, opts, learned) }); err != nil {
		if os.IsNotExist(statErr) {
			_ = RemoveLearned(dir, true)
		}
		return nil, err
	}
	in, err := Open(dir)
	if errors.Is(err, ErrNotInstalled) {
		// What is at dir is not ours to open, and was not ours to replace.
		err = fmt.Errorf("%s exists and holds no shunt install: remove it and enable again", dir)
	}
	if err != nil && os.IsNotExist(statErr) {
		_ = RemoveLearned(dir, true)
	}
	return in, err
}

// RemoveLearned unpins what shunt learned beside an install at dir (the
// programs seen splicing), or only if it holds nothing when onlyIfEmpty:
// for commands that remove what they made themselves.
func RemoveLearned(dir string, onlyIfEmpty bool) error {
	where := filepath.Join(LearnedDir(dir), learnedMap)
	if onlyIfEmpty {
		m, err := ebpf.LoadPinnedMap(where, nil)
		if err != nil {
			return nil
		}
		n := countKeys(m)
		m.Close()
		if n > 0 {
			return nil
		}
	}
	return os.RemoveAll(LearnedDir(dir))
}

// openLearned opens the programs-seen-splicing map pinned beside dir, or
// creates and pins it there.
func openLearned(dir string) (*ebpf.Map, error) {
	where := filepath.Join(LearnedDir(dir), learnedMap)
	spec, err := newSpec()
	if err != nil {
		return nil, fmt.Errorf("load BPF spec: %w", err)
	}
	if m, err := ebpf.LoadPinnedMap(where, nil); err == nil {
		if spec.Maps[learnedMap].Compatible(m) == nil {
			return m, nil
		}
		// Learned by an older shunt, by command name alone: what it
		// holds would keep every script of an interpreter on TCP.
		// Programs are learned again, by command line.
		m.Close()
		if err := os.Remove(where); err != nil {
			return nil, err
		}
	}
	m, err := ebpf.NewMap(spec.Maps[learnedMap])
	if err != nil {
		return nil, fmt.Errorf("create %s: %w", learnedMap, err)
	}
	if err := os.MkdirAll(LearnedDir(dir), 0o700); err != nil {
		m.Close()
		return nil, err
	}
	if err := m.Pin(where); err != nil {
		m.Close()
		// Another install pinned it first: use that one.
		if errors.Is(err, os.ErrExist) {
			return ebpf.LoadPinnedMap(where, nil)
		}
		return nil, fmt.Errorf("pin %s: %w", where, err)
	}
	return m, nil
}

func build(dir string, opts Options, learned *ebpf.Map) error {
	spec, err := newSpec()
	if err != nil {
		return fmt.Errorf("load BPF spec: %w", err)
	}
	if opts.MaxBacklog == 0 {
		opts.MaxBacklog = DefaultMaxBacklog
	}
	cfg := newConfig(opts)
	if err := spec.Variables["cfg"].Set(cfg); err != nil {
		return fmt.Errorf("configure BPF: %w", err)
	}
	var objs struct {
		bypassMaps
		Sockops    *ebpf.Program `ebpf:"shunt_sockops"`
		Setsockopt *ebpf.Program `ebpf:"shunt_setsockopt"`
		Getsockopt *ebpf.Program `ebpf:"shunt_getsockopt"`
		SkMsg      *ebpf.Program `ebpf:"shunt_sk_msg"`
		Splices    *ebpf.Program `ebpf:"shunt_splices"`
		// Loaded only to know that they load here, and closed: without
		// them shunt can neither list nor remove what it installs, nor
		// scan for stalls (a kernel whose verifier refused them, 6.18.44
		// of 2026-12-02 before held_state, got an install it could not
		// take out again).
		Flows  *ebpf.Program `ebpf:"shunt_iter_flows"`
		Drain  *ebpf.Program `ebpf:"shunt_iter_drain"`
		Stalls *ebpf.Program `ebpf:"shunt_iter_stalls"`
	}
	// One decode of the kernel's BTF for every load of this install (each
	// load made its own: seconds under qemu without KVM).
	cache := btf.NewCache()
	replace := map[string]*ebpf.Map{learnedMap: learned}
	if err := spec.LoadAndAssign(&objs, &ebpf.CollectionOptions{MapReplacements: replace, Cache: cache}); err != nil {
		return host.Explain(fmt.Errorf("load BPF programs: %w", err), "shunt bypass", host.MinKernel)
	}
	defer objs.Sockops.Close()
	defer objs.Setsockopt.Close()
	defer objs.Getsockopt.Close()
	defer objs.SkMsg.Close()
	defer objs.Splices.Close()
	defer objs.Flows.Close()
	defer objs.Drain.Close()
	defer objs.Stalls.Close()
	defer objs.bypassMaps.Close()
	shared := mapsOf(&objs.bypassMaps)
	shared[learnedMap] = learned
	reads, err := loadReaderWatch(spec, shared, cache)
	if err != nil {
		return err
	}
	defer reads.Close()

	dirs := []string{mapsDir, progsDir, linksDir, cgroupsDir}
	for _, h := range sockoptHooks {
		dirs = append(dirs, h.dir)
	}
	for _, d := range dirs {
		if err := os.Mkdir(filepath.Join(dir, d), 0o700); err != nil {
			return err
		}
	}
	for name, m := range mapsOf(&objs.bypassMaps) {
		if err := m.Pin(filepath.Join(dir, mapsDir, name)); err != nil {
			return fmt.Errorf("pin map %s: %w", name, err)
		}
	}
	if err := objs.Sockops.Pin(filepath.Join(dir, progsDir, "sockops")); err != nil {
		return fmt.Errorf("pin sockops: %w", err)
	}
	for name, p := range map[string]*ebpf.Program{"setsockopt": objs.Setsockopt, "getsockopt": objs.Getsockopt} {
		if err := p.Pin(filepath.Join(dir, progsDir, name)); err != nil {
			return fmt.Errorf("pin %s: %w", name, err)
		}
	}
	if err := objs.SkMsg.Pin(filepath.Join(dir, progsDir, skMsgLink)); err != nil {
		return fmt.Errorf("pin sk_msg: %w", err)
	}
	// The reader watch goes first: without it nothing is ever redirected.
	l, err := link.AttachTracing(link.TracingOptions{Program: reads})
	if err := pinLink(dir, readsLinkName, l, err, fmt.Sprintf("the reader watch (%s)", reads)); err != nil {
		return err
	}
	l, err = link.AttachTracing(link.TracingOptions{Program: objs.Splices})
	if err := pinLink(dir, splicesLink, l, err, "the splice watch (tp_btf/tcp_rcv_space_adjust)"); err != nil {
		return err
	}
	if err := attachSkMsg(dir, objs.SockHash, objs.SkMsg, opts.Mechanisms.AttachOnMap); err != nil {
		return err
	}
	switch {
	case cfg.FionreadCorrected != 0:
		if err := attachFionreadFix(dir, spec, &objs.bypassMaps, cache); err != nil {
			return err
		}
	case fionreadMisses(cfg) && cfg.NoFionreadWatch == 0:
		if err := attachFionreadTold(dir, spec, &objs.bypassMaps, cache); err != nil {
			return err
		}
	}
	if !opts.RefuseSplice {
		return nil // the splice watch and the guard act
	}
	if !host.CanRefuseSplice() {
		return ErrNoSpliceRefusal
	}
	return attachSpliceRefusal(dir, spec, &objs.bypassMaps, cache)
}

// A writer with Nagle's algorithm on whose sends of at most smallWriteSize
// come smallWriteRun in a row within smallWriteWindow, with no read
// between, over a path whose segments are at least smallWriteMSS
// (loopback's 32-64 KiB, not veth's 1,448 bytes), streams: TCP gathers such
// sends into large segments and moved 1.4-3.2x the bytes a redirect of each
// did (docs/BENCHMARKS.md, "Small writes"), so its connection goes back to
// TCP. 64 sends in 1 ms is 64,000 a second: a request and its answer, or a
// trickle, never get there.
const (
	smallWriteRun    = 64
	smallWriteSize   = 16 << 10
	smallWriteMSS    = 16 << 10
	smallWriteWindow = time.Millisecond
)

// newConfig is the programs' configuration for an install with opts.
func newConfig(opts Options) bypassConfig {
	cfg := bypassConfig{
		SettleNs:           uint64(cmp.Or(opts.settle, redirectSettle)),
		MaxBacklog:         opts.MaxBacklog,
		WriterMargin:       WriterMargin,
		SpliceNr:           unix.SYS_SPLICE,
		SendtoNr:           unix.SYS_SENDTO,
		SendmsgNr:          unix.SYS_SENDMSG,
		SendmmsgNr:         unix.SYS_SENDMMSG,
		StallNs:            uint64(stallAfter),
		ToldZeroNs:         uint64(toldZeroStallAfter),
		ScanStallNs:        uint64(scanStallAfter),
		ReaderPortTtlS:     uint32(ReaderPortTTL / time.Second),
		ReaderClientStreak: ReaderClientStreak,
		SmallRun:           smallWriteRun,
		SmallSize:          smallWriteSize,
		SmallMss:           smallWriteMSS,
		SmallWindowNs:      uint64(cmp.Or(opts.smallWindow, smallWriteWindow)),
		// The stall watch wakes a reader whose thread sleeps in
		// io_uring_enter, or in epoll_wait, poll or select asking for its
		// socket's input (the socket's wait queue says what each asks).
		UringNr:  unix.SYS_IO_URING_ENTER,
		EpollNrs: [3]uint32{unix.SYS_EPOLL_WAIT, unix.SYS_EPOLL_PWAIT, unix.SYS_EPOLL_PWAIT2},
		PollNrs:  [4]uint32{unix.SYS_POLL, unix.SYS_PPOLL, unix.SYS_SELECT, unix.SYS_PSELECT6},
	}
	if opts.TrustReaders {
		cfg.TrustReaders = 1
	}
	if opts.NoFIONREADWatch {
		cfg.NoFionreadWatch = 1
	}
	if opts.RefuseSplice {
		cfg.RefuseSplice = 1
	}
	if !opts.PairBrief {
		cfg.BriefStreak, cfg.BriefSends, cfg.BriefSample = BriefStreak, BriefSends, BriefSample
	}
	if opts.behindBytes != ^uint32(0) {
		cfg.BehindBytes = cmp.Or(opts.behindBytes, BehindBytes)
		cfg.BehindSends = cmp.Or(opts.behindSends, BehindSends)
	}
	if !opts.NoProbation {
		cfg.ProbationReads, cfg.ProbationNs = ProbationReads, uint64(cmp.Or(opts.ProbationLimit, ProbationTime))
		cfg.ProbationTimeReads = ProbationTimeReads
	}
	if opts.Mechanisms.KernelReadsByProbe() {
		cfg.ProbeReads = 1
	}
	// Where it cannot be measured, watch TCP's bytes too: a wake-up too
	// many costs nothing.
	missesTCP := !host.FionreadCountsTCP()
	if missesTCP {
		cfg.FionreadMissesTcp = 1
	}
	// Corrected where this kernel's FIONREAD leaves bytes out of a socket
	// in a sockhash and the helper that writes the answer loads (no
	// lockdown).
	if !opts.Mechanisms.KernelFIONREAD && fionreadMisses(cfg) && host.CanWriteUser() {
		cfg.FionreadCorrected = 1
	}
	return cfg
}

// fionreadMisses says whether FIONREAD of a socket in the sockhash leaves
// bytes out on this kernel, for an install with cfg: TCP's (6.18), or the
// redirected ones where the psock does not count them (6.1).
func fionreadMisses(cfg bypassConfig) bool {
	return cfg.FionreadMissesTcp != 0 || !host.PsockCountsQueue()
}

// loadReaderWatch loads the reader watch on the sock_recv_length tracepoint
// (6.3), or where that is missing as fexit on tcp_bpf_recvmsg (kernels
// whose fexit programs load; not these VMs, locked down). Errors name the
// tracepoint, the mechanism shunt prefers.
func loadReaderWatch(spec *ebpf.CollectionSpec, maps map[string]*ebpf.Map, cache *btf.Cache) (*ebpf.Program, error) {
	opts := &ebpf.CollectionOptions{MapReplacements: maps, Cache: cache}
	var tp struct {
		Reads *ebpf.Program `ebpf:"shunt_reads"`
	}
	err := spec.LoadAndAssign(&tp, opts)
	if err == nil {
		return tp.Reads, nil
	}
	var fexit struct {
		Reads *ebpf.Program `ebpf:"shunt_reads_fexit"`
	}
	fexitErr := spec.LoadAndAssign(&fexit, opts)
	if fexitErr == nil {
		return fexit.Reads, nil
	}
	return nil, host.Explain(fmt.Errorf("load the reader watch (tp_btf/sock_recv_length, or fexit/tcp_bpf_recvmsg: %v): %w", fexitErr, err), "shunt bypass", host.MinKernel)
}

// pinLink pins the link an attach returned (l, err) as name under the
// install's links and closes it: the pin holds the program attached.
func pinLink(dir, name string, l link.Link, err error, what string) error {
	if err != nil {
		return fmt.Errorf("attach %s: %w", what, err)
	}
	defer l.Close()
	if err := l.Pin(filepath.Join(dir, linksDir, name)); err != nil {
		return fmt.Errorf("pin the link of %s: %w", what, err)
	}
	return nil
}

// attachSpliceRefusal loads and attaches the LSM program that refuses a
// splice from a bypassed socket (kernels that run BPF LSM programs).
func attachSpliceRefusal(dir string, spec *ebpf.CollectionSpec, maps *bypassMaps, cache *btf.Cache) error {
	var objs struct {
		Refuse *ebpf.Program `ebpf:"shunt_refuse_splice"`
	}
	if err := setStatesMapID(spec, maps.SockStates); err != nil {
		return err
	}
	if err := spec.LoadAndAssign(&objs, &ebpf.CollectionOptions{MapReplacements: mapsOf(maps), Cache: cache}); err != nil {
		return fmt.Errorf("load the splice refusal (lsm/file_permission): %w", err)
	}
	defer objs.Refuse.Close()
	if err := objs.Refuse.Pin(filepath.Join(dir, progsDir, refuseLink)); err != nil {
		return fmt.Errorf("pin the splice refusal: %w", err)
	}
	l, err := link.AttachLSM(link.LSMOptions{Program: objs.Refuse})
	return pinLink(dir, refuseLink, l, err, "the splice refusal (lsm/file_permission)")
}

// FionreadCorrected says whether the install corrects FIONREAD: this
// kernel's leaves bytes out of a socket in a sockhash, and shunt_fionread
// adds them.
func (in *Install) FionreadCorrected() bool {
	_, err := os.Stat(filepath.Join(in.dir, linksDir, fionreadLink))
	return err == nil
}

// attachFionreadFix attaches the FIONREAD correction to the ioctl system
// call's exit tracepoint (tracefs names it: mounted if it is not).
func attachFionreadFix(dir string, spec *ebpf.CollectionSpec, maps *bypassMaps, cache *btf.Cache) error {
	var objs struct {
		Fionread *ebpf.Program `ebpf:"shunt_fionread"`
	}
	replace := map[string]*ebpf.Map{"counters": maps.Counters}
	if err := spec.LoadAndAssign(&objs, &ebpf.CollectionOptions{MapReplacements: replace, Cache: cache}); err != nil {
		return fmt.Errorf("load the FIONREAD correction (tracepoint syscalls/sys_exit_ioctl): %w", err)
	}
	defer objs.Fionread.Close()
	if err := host.EnsureTracefs(); err != nil {
		return fmt.Errorf("attach the FIONREAD correction: %w", err)
	}
	l, err := link.Tracepoint("syscalls", "sys_exit_ioctl", objs.Fionread, nil)
	return pinLink(dir, fionreadLink, l, err, "the FIONREAD correction (tracepoint syscalls/sys_exit_ioctl)")
}

// attachFionreadTold attaches, where FIONREAD leaves bytes out and cannot
// be corrected (lockdown), the program that notes a reader told too few of
// a held socket's bytes, for the guard to rescue at once (the ioctl system
// call's exit tracepoint, as the correction).
func attachFionreadTold(dir string, spec *ebpf.CollectionSpec, maps *bypassMaps, cache *btf.Cache) error {
	var objs struct {
		Told *ebpf.Program `ebpf:"shunt_fionread_told"`
	}
	if err := setStatesMapID(spec, maps.SockStates); err != nil {
		return err
	}
	what := "the watch on FIONREAD's answers (tracepoint syscalls/sys_exit_ioctl)"
	if err := spec.LoadAndAssign(&objs, &ebpf.CollectionOptions{MapReplacements: mapsOf(maps), Cache: cache}); err != nil {
		return fmt.Errorf("load %s: %w", what, err)
	}
	defer objs.Told.Close()
	if err := host.EnsureTracefs(); err != nil {
		return fmt.Errorf("attach %s: %w", what, err)
	}
	l, err := link.Tracepoint("syscalls", "sys_exit_ioctl", objs.Told, nil)
	return pinLink(dir, toldLink, l, err, what)
}

// attachSkMsg attaches the sk_msg program to the sockhash: as a pinned BPF
// link where the kernel has them (6.10), else on the map itself (the older
// attach, which lasts as long as the map; the pinned program says so).
func attachSkMsg(dir string, sockhash *ebpf.Map, prog *ebpf.Program, onMap bool) error {
	a, err := sockmap.Attach(sockhash, prog, ebpf.AttachSkMsgVerdict, onMap)
	if err != nil {
		return fmt.Errorf("attach sk_msg to sockhash: %w", err)
	}
	if a.OnMap() {
		return nil
	}
	defer func() { _ = a.Release() }() // the pin holds it
	if err := a.Link().Pin(filepath.Join(dir, linksDir, skMsgLink)); err != nil {
		return fmt.Errorf("pin sk_msg link: %w", err)
	}
	return nil
}

// SkMsgAttach says how the install's sk_msg program is attached: "link"
// (a pinned BPF link, 6.10+) or "map" (on the sockhash itself).
func (in *Install) SkMsgAttach() string {
	if _, err := os.Stat(filepath.Join(in.dir, linksDir, skMsgLink)); err == nil {
		return "link"
	}
	return "map"
}

// Paths are where an install at a pin directory keeps what tools outside
// this package may open (bpftool, the benchmarks' bare redirect).
type Paths struct {
	SockHash, SockStates string // the sockhash and the socket storage
	SkMsgProg, SkMsgLink string // the sk_msg program and its link on the sockhash
}

// PinPaths lays out an install's pins below dir.
func PinPaths(dir string) Paths {
	return Paths{
		SockHash:   filepath.Join(dir, mapsDir, "sock_hash"),
		SockStates: filepath.Join(dir, mapsDir, "sock_states"),
		SkMsgProg:  filepath.Join(dir, progsDir, skMsgLink),
		SkMsgLink:  filepath.Join(dir, linksDir, skMsgLink),
	}
}

func mapsOf(m *bypassMaps) map[string]*ebpf.Map {
	return map[string]*ebpf.Map{
		"sock_hash":       m.SockHash,
		"sock_states":     m.SockStates,
		"control":         m.Control,
		"counters":        m.Counters,
		"peer_refs":       m.PeerRefs,
		"excluded_ports":  m.ExcludedPorts,
		"guard_events":    m.GuardEvents,
		cgroupSendsMap:    m.CgroupSends,
		isnHandshakesMap:  m.IsnHandshakes,
		readerPortsMap:    m.ReaderPorts,
		shortcutsMap:      m.Shortcuts,
		wakesDeliveredMap: m.WakesDelivered,
		readerFDsMap:      m.ReaderFds,
		leaveTimersMap:    m.LeaveTimers,
		freeTimersMap:     m.FreeTimers,
		timerPoolMap:      m.TimerPool,
		briefPortsMap:     m.BriefPorts,
		recvProgramsMap:   m.RecvPrograms,
	}
}

// Open loads the install pinned at dir.
func Open(dir string) (*Install, error) {
	// The install is renamed into place whole: any pin means all of it.
	if _, err := os.Stat(filepath.Join(dir, progsDir, skMsgLink)); err != nil {
		if errors.Is(err, os.ErrNotExist) {
			return nil, ErrNotInstalled
		}
		return nil, fmt.Errorf("open %s: %w", dir, err)
	}
	in := &Install{dir: dir, maps: map[string]*ebpf.Map{}}
	for _, name := range pinnedMaps {
		m, err := ebpf.LoadPinnedMap(filepath.Join(dir, mapsDir, name), nil)
		if err != nil {
			in.Close()
			return nil, fmt.Errorf("open pinned map %s: %w", name, err)
		}
		in.maps[name] = m
	}
	// Installs made before per-cgroup counts or pairing by sequence
	// numbers lack those maps; they still open (and can be removed).
	for _, name := range []string{cgroupSendsMap, isnHandshakesMap, readerPortsMap, shortcutsMap, wakesDeliveredMap, readerFDsMap, leaveTimersMap, freeTimersMap, timerPoolMap, briefPortsMap, recvProgramsMap} {
		if m, err := ebpf.LoadPinnedMap(filepath.Join(dir, mapsDir, name), nil); err == nil {
			in.maps[name] = m
		}
	}
	learned, err := ebpf.LoadPinnedMap(filepath.Join(LearnedDir(dir), learnedMap), nil)
	if err != nil {
		in.Close()
		return nil, fmt.Errorf("open pinned map %s: %w", learnedMap, err)
	}
	in.maps[learnedMap] = learned
	p, err := ebpf.LoadPinnedProgram(filepath.Join(dir, progsDir, "sockops"), nil)
	if err != nil {
		in.Close()
		return nil, fmt.Errorf("open pinned sockops program: %w", err)
	}
	in.sockops = p
	in.sockopts = openSockopts(dir)
	return in, nil
}

// Close releases this process's handles; the pinned install stays.
func (in *Install) Close() error {
	for _, m := range in.maps {
		m.Close()
	}
	if in.sockops != nil {
		in.sockops.Close()
	}
	for _, h := range in.sockopts {
		h.prog.Close()
	}
	return nil
}
