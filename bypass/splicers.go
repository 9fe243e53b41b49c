package bypass

import (
	"bytes"
	"cmp"
	"encoding/binary"
	"errors"
	"fmt"
	"hash/fnv"
	"net/netip"
	"os"
	"path/filepath"
	"slices"
	"strconv"
	"strings"
	"time"

	"github.com/cilium/ebpf"
	"github.com/cilium/ebpf/ringbuf"
	"golang.org/x/sys/unix"
)

// SpliceProgram is a program seen calling splice(2) on a TCP socket. A
// splice reads only what TCP queued, never bytes shunt redirected, so every
// later reader of that program stays on TCP from its first recv. A program
// is its command name and its command line up to the first argument that is
// not an option (an interpreter's script, "java -jar app.jar"), so a
// splicing script keeps no other script of one interpreter on TCP, and a
// restart with other arguments is the same program; one taught by name
// (--splicer) matches any command line.
type SpliceProgram struct {
	Command string `json:"command"` // its process's command name (comm)
	// CommandLine is the part of its command line it is known by
	// (arguments separated by spaces); "" for a program taught by name.
	CommandLine string    `json:"command_line"`
	ByName      bool      `json:"by_name"` // taught by name: any command line matches
	First       time.Time `json:"first_seen"`
	Last        time.Time `json:"last_seen"`
	Splices     uint64    `json:"splices"` // splice calls seen (once per socket shunt held)
	Caught      uint64    `json:"caught"`  // connections caught with redirected bytes it could not read
	// PIDs are the running processes it keeps on TCP.
	PIDs []int `json:"pids"`
}

func commKey(name string) bypassSpliceProgram {
	var k bypassSpliceProgram
	for i := 0; i < len(k.Comm)-1 && i < len(name); i++ {
		k.Comm[i] = int8(name[i])
	}
	return k
}

func commString(c [16]int8) string {
	b := make([]byte, 0, len(c))
	for _, v := range c {
		if v == 0 {
			break
		}
		b = append(b, byte(v))
	}
	return string(b)
}

// argsLen is how much of a command line the BPF programs hash (ARGS_LEN).
const argsLen = 256

// programArgs is the part of a command line (NUL-separated, as
// /proc/PID/cmdline has it) that names the program, as the BPF programs
// take it: within its first argsLen bytes, the command and the arguments up
// to the first that is not an option, with its NUL ("python3\0app.py\0",
// "java\0-jar\0app.jar\0").
func programArgs(cmdline []byte) []byte {
	b := cmdline[:min(len(cmdline), argsLen)]
	arg, atStart := 0, true
	for i, c := range b {
		if atStart && arg > 0 && c != '-' {
			if j := bytes.IndexByte(b[i:], 0); j >= 0 {
				return b[:i+j+1]
			}
			return b
		}
		if c == 0 {
			arg++
			atStart = true
		} else {
			atStart = false
		}
	}
	return b
}

// argsHash is what the BPF programs compute for a command line: FNV-1a 64
// of programArgs, never 0 (0 stands for any command line).
func argsHash(cmdline []byte) uint64 {
	h := fnv.New64a()
	h.Write(programArgs(cmdline))
	if v := h.Sum64(); v != 0 {
		return v
	}
	return 1
}

// showArgs turns NUL-separated arguments into one line.
func showArgs(b []byte) string {
	return strings.TrimSpace(strings.ReplaceAll(strings.TrimRight(string(b), "\x00"), "\x00", " "))
}

// SpliceProgramCount is how many programs shunt has seen splicing:
// SplicePrograms' length without its walk of every process (a metrics
// scrape needs no more, and on a node of a few hundred pods the walk is
// much of a scrape).
func (in *Install) SpliceProgramCount() (int, error) {
	n := 0
	var k bypassSpliceProgram
	var v bypassSpliceSeen
	it := in.maps[learnedMap].Iterate()
	for it.Next(&k, &v) {
		n++
	}
	if err := it.Err(); err != nil {
		return 0, fmt.Errorf("read %s: %w", learnedMap, err)
	}
	return n, nil
}

// SplicePrograms lists the programs shunt has seen splicing, by command,
// with the running processes each keeps on TCP.
func (in *Install) SplicePrograms() ([]SpliceProgram, error) {
	wall := bootOffset()
	out := []SpliceProgram{}
	var k bypassSpliceProgram
	var v bypassSpliceSeen
	var keys []bypassSpliceProgram
	it := in.maps[learnedMap].Iterate()
	for it.Next(&k, &v) {
		cmdline := make([]byte, len(v.Cmdline))
		for i, c := range v.Cmdline {
			cmdline[i] = byte(c)
		}
		out = append(out, SpliceProgram{Command: commString(k.Comm), CommandLine: showArgs(programArgs(cmdline)), ByName: k.Args == 0,
			First: wall(v.FirstNs), Last: wall(v.LastNs), Splices: v.Splices, Caught: v.Caught, PIDs: []int{}})
		keys = append(keys, k)
	}
	if err := it.Err(); err != nil {
		return nil, fmt.Errorf("read %s: %w", learnedMap, err)
	}
	if len(keys) == 0 {
		return out, nil // no need to read every process's command line
	}
	for _, p := range runningPrograms() {
		for i, k := range keys {
			if commString(k.Comm) == p.comm && (k.Args == 0 || k.Args == p.args) {
				out[i].PIDs = append(out[i].PIDs, p.pid)
			}
		}
	}
	slices.SortFunc(out, func(a, b SpliceProgram) int {
		return cmp.Or(strings.Compare(a.Command, b.Command), strings.Compare(a.CommandLine, b.CommandLine))
	})
	return out, nil
}

type runningProgram struct {
	pid  int
	comm string
	args uint64
}

// runningPrograms lists the processes of the host as learning knows them.
func runningPrograms() []runningProgram {
	ents, _ := os.ReadDir("/proc")
	var out []runningProgram
	for _, e := range ents {
		pid, err := strconv.Atoi(e.Name())
		if err != nil {
			continue
		}
		comm, err := os.ReadFile(filepath.Join("/proc", e.Name(), "comm"))
		if err != nil {
			continue
		}
		cmdline, err := os.ReadFile(filepath.Join("/proc", e.Name(), "cmdline"))
		if err != nil {
			continue
		}
		out = append(out, runningProgram{pid: pid, comm: strings.TrimSuffix(string(comm), "\n"), args: argsHash(cmdline)})
	}
	return out
}

// ErrUnknownProgram means Forget was asked for a program shunt never saw.
var ErrUnknownProgram = errors.New("no such program among those seen splicing")

// Forget drops one program (by command name: every command line of it)
// from those seen splicing, or every program with "": their readers may be
// bypassed again.
func (in *Install) Forget(command string) (int, error) {
	return forget(in.maps[learnedMap], command)
}

// ForgetAt is Forget for what was learned beside an install at dir, with or
// without the install (what was learned outlives it).
func ForgetAt(dir, command string) (int, error) {
	m, err := ebpf.LoadPinnedMap(filepath.Join(LearnedDir(dir), learnedMap), nil)
	if errors.Is(err, os.ErrNotExist) {
		if command != "" {
			return 0, fmt.Errorf("%q: %w", command, ErrUnknownProgram)
		}
		return 0, nil
	}
	if err != nil {
		return 0, err
	}
	defer m.Close()
	return forget(m, command)
}

func forget(m *ebpf.Map, command string) (int, error) {
	var k bypassSpliceProgram
	var v bypassSpliceSeen
	var keys []bypassSpliceProgram
	it := m.Iterate()
	for it.Next(&k, &v) {
		if command == "" || commString(k.Comm) == command {
			keys = append(keys, k)
		}
	}
	if err := it.Err(); err != nil {
		return 0, err
	}
	if command != "" && len(keys) == 0 {
		return 0, fmt.Errorf("%q: %w", command, ErrUnknownProgram)
	}
	n := 0
	for _, k := range keys {
		if err := m.Delete(k); err == nil {
			n++
		} else if !errors.Is(err, os.ErrNotExist) {
			return n, err
		}
	}
	return n, nil
}

// Learn adds a program (by command name) to those whose readers stay on
// TCP, before shunt has seen it splice.
func (in *Install) Learn(command string) error {
	if command == "" || len(command) > 15 {
		return fmt.Errorf("%q: a command name has 1 to 15 characters (as ps -o comm shows it)", command)
	}
	now := uint64(monotonicNow())
	return in.maps[learnedMap].Update(commKey(command), bypassSpliceSeen{FirstNs: now, LastNs: now}, 0)
}

// EventKind says what an Event reports.
type EventKind uint32

const (
	// SpliceCaught: a splice reader with redirected bytes queued that
	// splice cannot read; the guard resets the connection.
	SpliceCaught = EventKind(bypassEventKindEVENT_SPLICE_CAUGHT)
	// BlockingEAGAIN: a blocking read failed with EAGAIN where TCP would
	// have restarted it (a signal, stop or ptrace ended its wait, in a
	// connection's first read, before shunt saw the reader block).
	BlockingEAGAIN = EventKind(bypassEventKindEVENT_BLOCKING_EAGAIN)
	// StallRescued: a reader read nothing for a while with bytes queued
	// (bytes its kernel's FIONREAD leaves out, or any, to the stall
	// scan); its connection goes back to TCP and the guard wakes it.
	StallRescued = EventKind(bypassEventKindEVENT_STALL_RESCUED)
	// Wake: a socket whose reader may have been told by FIONREAD that
	// queued bytes were not there left the sockhash; the guard wakes it.
	Wake = EventKind(bypassEventKindEVENT_WAKE)
	// SpliceTruncated: a splice reader caught after its peer's end of
	// stream had come (by TCP): the splice returned end of stream at once,
	// before the redirected bytes, so the application saw a short stream
	// end cleanly. No hook before the splice runs on these kernels to
	// prevent it; the guard resets the connection and says so.
	SpliceTruncated = EventKind(bypassEventKindEVENT_SPLICE_TRUNCATED)
	// ZerocopyCaught: a reader that takes its bytes with
	// getsockopt(TCP_ZEROCOPY_RECEIVE), which maps TCP's queue alone, with
	// redirected bytes queued (it read them in before by read()); the
	// guard resets the connection.
	ZerocopyCaught = EventKind(bypassEventKindEVENT_ZEROCOPY_CAUGHT)
	// PeekStuck: a reader that peeked three times in a row, reading
	// nothing, at every redirected byte queued while TCP held more behind
	// them, which no peek reaches (it waits for a whole message to show).
	// Readers that peek in mid-stream go back to TCP at their first peek;
	// this is one whose TCP bytes came behind before that. The guard says
	// so: nothing can bring the two queues together for it.
	PeekStuck = EventKind(bypassEventKindEVENT_PEEK_STUCK)
	// ToldShort: FIONREAD told a reader fewer bytes than a held socket
	// had queued, and this kernel's answer cannot be corrected
	// (lockdown). The guard runs the stall scan over the reader's
	// process (StallScan.RunIn): it sends the connection back to TCP and
	// reports it as a StallRescued found by FIONREAD.
	ToldShort = EventKind(bypassEventKindEVENT_TOLD_SHORT)
)

// Event is what the BPF programs tell the guard about one socket.
type Event struct {
	Kind          EventKind
	Local, Remote netip.AddrPort // the reading socket's own address, and its peer's
	Netns         uint64
	Cookie        uint64
	Unread        uint64 // SpliceCaught, SpliceTruncated, ZerocopyCaught, PeekStuck: redirected bytes queued when caught; StallRescued, Wake: bytes queued; ToldShort: bytes the answer left out
	PID           int    // the process that read
	Command       string
	Inode         uint64 // StallRescued, Wake: the socket's inode ("socket:[N]" in /proc/PID/fd)
	Found         StallFound
	AsleepIn      int // Found == FoundByWatch: the system call the reader slept in
	FD            int // StallRescued, Wake: the descriptor its reader last read it through, a hint (-1: unknown)
}

// StallFound says how a stall was found (StallRescued, and a Wake of a
// stalled reader).
type StallFound uint32

const (
	// FoundUnknown: not a stall, or an install older than the field.
	FoundUnknown StallFound = 0
	// FoundByWatch: a read left bytes FIONREAD does not count, and the
	// reader then slept 20 ms in a wait for its socket (AsleepIn).
	FoundByWatch = StallFound(bypassStallFoundFOUND_BY_WATCH)
	// FoundByScan: the stall scan saw nothing read for 500 ms.
	FoundByScan = StallFound(bypassStallFoundFOUND_BY_SCAN)
	// FoundByFIONREAD: FIONREAD told the reader fewer bytes than were
	// queued (ToldShort), before it could wait on them.
	FoundByFIONREAD = StallFound(bypassStallFoundFOUND_BY_FIONREAD)
)

// EventReader delivers events as the BPF programs report them.
type EventReader struct{ rd *ringbuf.Reader }

// WatchEvents opens the install's stream of events. Only one reader
// should consume it (the guard).
func (in *Install) WatchEvents() (*EventReader, error) {
	rd, err := ringbuf.NewReader(in.maps["guard_events"])
	if err != nil {
		return nil, fmt.Errorf("open guard_events: %w", err)
	}
	return &EventReader{rd: rd}, nil
}

// Read waits until an event comes or the deadline passes
// (os.ErrDeadlineExceeded).
func (r *EventReader) Read(deadline time.Time) (Event, error) {
	r.rd.SetDeadline(deadline)
	var rec ringbuf.Record
	if err := r.rd.ReadInto(&rec); err != nil {
		return Event{}, err
	}
	var ev bypassGuardEvent
	if err := decodeInto(rec.RawSample, &ev); err != nil {
		return Event{}, err
	}
	t := ev.Self.Tuple
	client := netip.AddrPortFrom(netip.AddrFrom16(t.ClientIp).Unmap(), t.ClientPort)
	server := netip.AddrPortFrom(netip.AddrFrom16(t.ServerIp).Unmap(), t.ServerPort)
	e := Event{Kind: EventKind(ev.Kind), Local: server, Remote: client, Netns: ev.Self.Netns, Cookie: ev.Cookie, Unread: ev.Unread, PID: int(ev.Pid), Command: commString(ev.Comm), Inode: ev.Ino,
		Found: StallFound(ev.Found), AsleepIn: int(ev.AsleepIn), FD: int(ev.Fd) - 1}
	if ev.Self.Role == roleClient {
		e.Local, e.Remote = client, server
	}
	return e, nil
}

// Close stops the reader.
func (r *EventReader) Close() error { return r.rd.Close() }

// decodeInto reads a record into v. Records of installs made by an older
// shunt may be shorter (fields were added at the end): the rest stays zero.
func decodeInto(b []byte, v any) error {
	if size := binary.Size(v); len(b) < size {
		b = append(b[:len(b):len(b)], make([]byte, size-len(b))...)
	}
	return binary.Read(bytes.NewReader(b), binary.NativeEndian, v)
}

// monotonicNow reads CLOCK_MONOTONIC, the clock of bpf_ktime_get_ns.
func monotonicNow() int64 {
	var ts unix.Timespec
	_ = unix.ClockGettime(unix.CLOCK_MONOTONIC, &ts)
	return ts.Nano()
}
