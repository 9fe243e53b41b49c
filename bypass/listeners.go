package bypass

import (
	"errors"
	"fmt"

	"github.com/cilium/ebpf"
	"github.com/cilium/ebpf/link"

	"github.com/shunt-project/shunt/host"
	"github.com/shunt-project/shunt/internal/bpfiter"
)

// ErrListenersNotWatched: this kernel has no bpf_setsockopt of
// TCP_BPF_SOCK_OPS_CB_FLAGS (before 6.12), so a listener that listened
// before its cgroup was enabled pairs only connections whose tuple is
// not translated.
var ErrListenersNotWatched = errors.New("this kernel cannot ask for an older listener's SYN-ACKs (6.12 and later can): its translated connections stay on TCP until the server listens anew")

// WatchListeners asks for the SYN-ACKs of the listeners in cg's subtree
// that listened before cg was enabled, in every network namespace: a
// listener made since asks for them itself (TCP_LISTEN_CB), and pairing
// through address translation needs them (the sequence numbers are
// registered from the SYN-ACK). Returns how many listeners it found and
// ErrListenersNotWatched where the kernel cannot.
func (in *Install) WatchListeners(cg host.Cgroup) (int, error) {
	var objs struct {
		Listeners *ebpf.Program `ebpf:"shunt_iter_listeners"`
	}
	watch := bypassListenerWatch{CgroupId: cg.ID, Level: uint32(cg.Level())}
	if err := in.loadBound(&objs, map[string]any{"watch": watch}); err != nil {
		return 0, fmt.Errorf("load the listener iterator: %w", err)
	}
	defer objs.Listeners.Close()
	it, err := link.AttachIter(link.IterOptions{Program: objs.Listeners})
	if err != nil {
		return 0, fmt.Errorf("attach the listener iterator: %w", err)
	}
	defer it.Close()
	found, refused := 0, 0
	for _, ns := range host.AllNetns() {
		var out []byte
		var readErr error
		if err := host.InNetns(ns.Path, func() error {
			out, readErr = bpfiter.Read(it)
			return nil
		}); err != nil {
			continue // the namespace went away
		}
		if readErr != nil {
			return found, fmt.Errorf("find listeners in %s: %w", ns.Path, readErr)
		}
		for _, rc := range bpfiter.Records[int32](out) {
			found++
			if rc != 0 {
				refused++
			}
		}
	}
	if refused > 0 {
		return found, ErrListenersNotWatched
	}
	return found, nil
}

// DescribeWatch says in one line what WatchListeners found, for enable's
// output and the agent's log; "" when there was no older listener.
func DescribeWatch(found int, err error) string {
	switch {
	case errors.Is(err, ErrListenersNotWatched):
		return fmt.Sprintf("%d listening socket(s) older than the enable: their connections through address translation (a Service, a sidecar's redirect) stay on TCP until the server listens anew (this kernel cannot ask for their SYN-ACKs; 6.12 and later can)", found)
	case err != nil:
		return fmt.Sprintf("could not look for listening sockets older than the enable (%v): their connections through address translation may stay on TCP until the server listens anew", err)
	case found > 0:
		return fmt.Sprintf("%d listening socket(s) older than the enable asked for their SYN-ACKs: their connections through address translation pair too", found)
	}
	return ""
}
