package bypass

import (
	"bytes"
	"encoding/binary"
	"errors"
	"fmt"
	"net/netip"
	"os"
	"path/filepath"
	"slices"
	"strings"
	"time"

	"github.com/cilium/ebpf"
	"github.com/cilium/ebpf/ringbuf"
	"golang.org/x/sys/unix"
)

// SpliceProgram is a program seen calling splice(2) on a TCP socket. A
// splice reads only what TCP queued, never bytes shunt redirected, so every
// later reader of that program stays on TCP from its first recv.
type SpliceProgram struct {
	Command string    `json:"command"` // its process's command name (comm)
	First   time.Time `json:"first_seen"`
	Last    time.Time `json:"last_seen"`
	Splices uint64    `json:"splices"` // splice calls seen (once per socket shunt held)
	Caught  uint64    `json:"caught"`  // connections caught with redirected bytes it could not read
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

// SplicePrograms lists the programs shunt has seen splicing, by command.
func (in *Install) SplicePrograms() ([]SpliceProgram, error) {
	wall := bootOffset()
	out := []SpliceProgram{}
	var k bypassSpliceProgram
	var v bypassSpliceSeen
	it := in.maps[learnedMap].Iterate()
	for it.Next(&k, &v) {
		out = append(out, SpliceProgram{Command: commString(k.Comm), First: wall(v.FirstNs), Last: wall(v.LastNs), Splices: v.Splices, Caught: v.Caught})
	}
	if err := it.Err(); err != nil {
		return nil, fmt.Errorf("read %s: %w", learnedMap, err)
	}
	slices.SortFunc(out, func(a, b SpliceProgram) int { return strings.Compare(a.Command, b.Command) })
	return out, nil
}

// ErrUnknownProgram means Forget was asked for a program shunt never saw.
var ErrUnknownProgram = errors.New("no such program among those seen splicing")

// Forget drops one program (by command name) from those seen splicing, or
// every program with "": their readers may be bypassed again.
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
	if command != "" {
		if err := m.Delete(commKey(command)); err != nil {
			if errors.Is(err, os.ErrNotExist) {
				return 0, fmt.Errorf("%q: %w", command, ErrUnknownProgram)
			}
			return 0, err
		}
		return 1, nil
	}
	var k bypassSpliceProgram
	var keys []bypassSpliceProgram
	var v bypassSpliceSeen
	it := m.Iterate()
	for it.Next(&k, &v) {
		keys = append(keys, k)
	}
	if err := it.Err(); err != nil {
		return 0, err
	}
	for _, k := range keys {
		if err := m.Delete(k); err != nil && !errors.Is(err, os.ErrNotExist) {
			return 0, err
		}
	}
	return len(keys), nil
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
)

// Event is what the BPF programs tell the guard about one socket.
type Event struct {
	Kind          EventKind
	Local, Remote netip.AddrPort // the reading socket's own address, and its peer's
	Netns         uint64
	Cookie        uint64
	Unread        uint64 // SpliceCaught: redirected bytes queued when caught; StallRescued, Wake: bytes queued
	PID           int    // the process that read
	Command       string
	Inode         uint64 // StallRescued, Wake: the socket's inode ("socket:[N]" in /proc/PID/fd)
}

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
	e := Event{Kind: EventKind(ev.Kind), Local: server, Remote: client, Netns: ev.Self.Netns, Cookie: ev.Cookie, Unread: ev.Unread, PID: int(ev.Pid), Command: commString(ev.Comm), Inode: ev.Ino}
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
