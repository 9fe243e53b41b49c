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

// ErrBusy means some bypassed sockets still hold bytes their readers have not
// read; removing them from the sockhash now would drop those bytes.
type ErrBusy struct{ Sockets int }

func (e ErrBusy) Error() string {
	return fmt.Sprintf("%d bypassed socket(s) still hold unread data; nothing was lost: new sends already take the TCP path, run 'shunt bypass disable --all' again once their readers have caught up", e.Sockets)
}

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

	left, err := in.drain(ctx)
	if err != nil {
		return err
	}
	if left > 0 {
		return ErrBusy{Sockets: left}
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
// none is left or ctx ends, and returns how many are left.
func (in *Install) drain(ctx context.Context) (int, error) {
	iter, err := in.loadIterators()
	if err != nil {
		return 0, err
	}
	defer iter.Close()
	for {
		buf, err := runIter(iter.Drain, in.maps["sock_hash"])
		if err != nil {
			return 0, fmt.Errorf("drain: %w", err)
		}
		left := len(buf) / binary.Size(bypassSockKey{})
		if left == 0 {
			return 0, nil
		}
		select {
		case <-ctx.Done():
			return left, nil
		case <-time.After(20 * time.Millisecond):
		}
	}
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
	spec, err := loadBypass()
	if err != nil {
		return nil, err
	}
	var it iterators
	if err := spec.LoadAndAssign(&it, &ebpf.CollectionOptions{MapReplacements: in.maps}); err != nil {
		return nil, fmt.Errorf("load BPF iterators: %w", err)
	}
	return &it, nil
}

// runIter runs one pass of an iterator over m and returns what it wrote.
func runIter(prog *ebpf.Program, m *ebpf.Map) ([]byte, error) {
	l, err := link.AttachIter(link.IterOptions{Program: prog, Map: m})
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
