package fanout

import (
	"errors"

	"github.com/cilium/ebpf"
	"golang.org/x/sys/unix"
)

// KernelMapEntries counts the subscribers' entries in the kernel path's maps
// (what a leak would show), leaving out the pacer's; safe beside Run, as the
// maps are only read.
func (f *Forwarder) KernelMapEntries() (feeds, targets, cookies int, err error) {
	k := f.kern
	var v uint64
	for slot := uint32(0); slot < kernelMaxSubscribers; slot++ {
		for _, m := range []struct {
			m *ebpf.Map
			n *int
		}{{k.objs.Feeds, &feeds}, {k.objs.Targets, &targets}} {
			switch err := m.m.Lookup(slot, &v); {
			case err == nil:
				*m.n++
			case !errors.Is(err, ebpf.ErrKeyNotExist):
				return 0, 0, 0, err
			}
		}
	}
	var cookie uint64
	var slot uint32
	it := k.objs.Slots.Iterate()
	for it.Next(&cookie, &slot) {
		if slot != pacerSlot {
			cookies++
		}
	}
	return feeds, targets, cookies, it.Err()
}

// KernelMechanisms says how the kernel path's verdict runs: attached on the
// map (no link), and reading the skb by probe reads.
func (f *Forwarder) KernelMechanisms() (onMap, probeReads bool, err error) {
	var cfg kfanoutFanoutConfig
	err = f.kern.objs.Cfg.Get(&cfg)
	return f.kern.verdict.OnMap(), cfg.ProbeReads == 1, err
}

// CurrentCPU is the CPU the calling thread runs on.
var CurrentCPU = currentCPU

// KernelRelayed is how many messages the kernel path's pacer counted out of
// the loopback queue.
func (f *Forwarder) KernelRelayed() uint64 { return f.kern.relayed() }

// BreakEpoll closes the forwarder's epoll descriptor, so Run returns on an
// epoll error.
func (f *Forwarder) BreakEpoll() {
	unix.Close(f.ep)
	f.ep = -1
}
