package bypass

import (
	"bytes"
	"context"
	"encoding/binary"
	"errors"
	"fmt"
	"io"
	"os"
	"strconv"
	"time"

	"github.com/cilium/ebpf"
	"github.com/cilium/ebpf/link"
)

// ErrBusy means some bypassed sockets could not leave the sockhash yet:
// Unread of them hold bytes their readers have not read (removing them now
// would drop those bytes), and Unheld are open in no process shunt can see
// (a server socket its listener has not accepted yet), so shunt cannot look.
type ErrBusy struct{ Unread, Unheld int }

func (e ErrBusy) Error() string {
	var what string
	switch {
	case e.Unheld == 0:
		what = fmt.Sprintf("%d bypassed socket(s) still hold unread data", e.Unread)
	case e.Unread == 0:
		what = fmt.Sprintf("%d bypassed socket(s) are not accepted by their server yet", e.Unheld)
	default:
		what = fmt.Sprintf("%d bypassed socket(s) still hold unread data and %d are not accepted by their server yet", e.Unread, e.Unheld)
	}
	return what + "; nothing was lost: new sends already take the TCP path, run 'shunt bypass disable --all' again once their readers have caught up"
}

// Sockets is how many sockets kept the install in place.
func (e ErrBusy) Sockets() int { return e.Unread + e.Unheld }

// Remove takes bypass off the host without losing a byte: it detaches every
// cgroup, switches all sends to the TCP path, waits until no socket holds
// redirected bytes that its reader has not consumed, removes the sockets from
// the sockhash and only then unpins everything.
//
// If readers do not catch up before ctx ends, it returns ErrBusy and leaves
// the install in place (draining, no cgroup attached).
func (in *Install) Remove(ctx context.Context) error {
	cgs, err := in.Cgroups()
	if err != nil {
		return err
	}
	for _, cg := range cgs {
		if _, err := in.Detach(cg.ID); err != nil {
			return err
		}
	}
	if err := in.setDraining(true); err != nil {
		return err
	}
	// A send that read the control word just before it flipped finishes its
	// redirect within its own syscall; give those a moment to land.
	time.Sleep(redirectSettle)

	if err := in.drain(ctx); err != nil {
		return err
	}

	// Rename first so a concurrent reader never sees half an install.
	gone := in.dir + "-old-" + strconv.Itoa(os.Getpid())
	if err := os.Rename(in.dir, gone); err != nil {
		return fmt.Errorf("remove %s: %w", in.dir, err)
	}
	in.Close()
	if err := os.RemoveAll(gone); err != nil {
		return fmt.Errorf("unpin %s: %w", gone, err)
	}
	return nil
}

// drain removes sockets with empty redirect queues from the sockhash until
// none is left, or returns ErrBusy when ctx ends first.
func (in *Install) drain(ctx context.Context) error {
	iter, err := in.loadIterators()
	if err != nil {
		return err
	}
	defer iter.Close()
	for {
		buf, err := runIter(iter.Drain)
		if err != nil {
			return fmt.Errorf("drain: %w", err)
		}
		unread := map[bypassSockKey]bool{}
		for _, k := range decodeKeys(buf) {
			unread[k] = true
		}
		// What the iterator did not see is open in no process: it may
		// hold redirected bytes all the same, so it is not deleted.
		var busy ErrBusy
		var key bypassSockKey
		var cookie uint64
		it := in.maps["sock_hash"].Iterate()
		for it.Next(&key, &cookie) {
			if unread[key] {
				busy.Unread++
			} else {
				busy.Unheld++
			}
		}
		if err := it.Err(); err != nil {
			return fmt.Errorf("drain: read sockhash: %w", err)
		}
		if busy.Sockets() == 0 {
			return nil
		}
		select {
		case <-ctx.Done():
			return busy
		case <-time.After(20 * time.Millisecond):
		}
	}
}

func decodeKeys(buf []byte) []bypassSockKey {
	keys := make([]bypassSockKey, len(buf)/binary.Size(bypassSockKey{}))
	_ = binary.Read(bytes.NewReader(buf), binary.NativeEndian, keys)
	return keys
}

type iterators struct {
	Drain *ebpf.Program `ebpf:"shunt_iter_drain"`
	Flows *ebpf.Program `ebpf:"shunt_iter_flows"`
}

func (it *iterators) Close() {
	it.Drain.Close()
	it.Flows.Close()
}

// loadIterators loads the iterator programs bound to the pinned maps.
func (in *Install) loadIterators() (*iterators, error) {
	var it iterators
	if err := in.loadBound(&it, nil); err != nil {
		return nil, fmt.Errorf("load BPF iterators: %w", err)
	}
	return &it, nil
}

// loadBound loads the programs objs names against the install's pinned
// maps, configured as the install's own programs are. An install made by
// an older shunt keeps the shapes its maps were made with: the spec takes
// them, so programs that do not use a map whose shape changed still load
// (a program that reads past an older value is refused by the verifier).
// vars sets constants of the program's own (as the listener watch).
func (in *Install) loadBound(objs any, vars map[string]any) error {
	spec, err := newSpec()
	if err != nil {
		return err
	}
	if cfg, err := in.config(); err == nil {
		if err := spec.Variables["cfg"].Set(cfg); err != nil {
			return err
		}
	}
	for name, v := range vars {
		if err := spec.Variables[name].Set(v); err != nil {
			return fmt.Errorf("configure %s: %w", name, err)
		}
	}
	// The iterators over files find shunt's storage of a socket by its
	// map's id (iter.h, held_state).
	info, err := in.maps[bypassMapSockStates].Info()
	if err != nil {
		return fmt.Errorf("read the socket storage map's id: %w", err)
	}
	id, _ := info.ID()
	if err := spec.Variables["states_map_id"].Set(uint32(id)); err != nil {
		return fmt.Errorf("configure states_map_id: %w", err)
	}
	for name, m := range in.maps {
		ms, ok := spec.Maps[name]
		if !ok || ms.Compatible(m) == nil {
			continue
		}
		ms.ValueSize, ms.MaxEntries = m.ValueSize(), m.MaxEntries()
		ms.Value = nil
	}
	return spec.LoadAndAssign(objs, &ebpf.CollectionOptions{MapReplacements: in.maps})
}

// runIter runs one pass of an iterator over every open file on the host
// and returns what it wrote.
func runIter(prog *ebpf.Program) ([]byte, error) {
	l, err := link.AttachIter(link.IterOptions{Program: prog})
	if err != nil {
		return nil, err
	}
	defer l.Close()
	r, err := l.Open()
	if err != nil {
		return nil, err
	}
	defer r.Close()
	var b bytes.Buffer
	if _, err := io.Copy(&b, r); err != nil && !errors.Is(err, io.EOF) {
		return nil, err
	}
	return b.Bytes(), nil
}
