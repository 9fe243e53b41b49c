package reap

import (
	"context"
	"encoding/binary"
	"fmt"
	"net/netip"
	"syscall"
	"time"
	"unsafe"

	"github.com/cilium/ebpf"
	"github.com/cilium/ebpf/link"

	"github.com/shunt-project/shunt/host"
	"github.com/shunt-project/shunt/internal/bpfiter"
	"github.com/shunt-project/shunt/sockindex"
)

// reapIter runs the iterator programs in every namespace of the host.
func reapIter(ctx context.Context, t Target, opts Options, res *Result) error {
	start := time.Now()
	defer func() { res.Destroy = time.Since(start) }()
	spec, err := loadReapiter()
	if err != nil {
		return fmt.Errorf("load BPF spec: %w", err)
	}
	// Without the kfunc (before 6.5) the iterators only find, and each
	// namespace's finds are destroyed through sock_diag, as the index's are.
	byDiag := !opts.DryRun && !host.HasSockDestroy()
	cfg := reapiterReapConfig{Addr: t.Addr.As16(), Port: t.Port}
	switch {
	case opts.DryRun:
		cfg.DryRun = 1
	case byDiag:
		cfg.DryRun = 1
		res.DestroyBy = "sock_diag"
	default:
		res.DestroyBy = "kfunc"
	}
	if err := spec.Variables["reap_cfg"].Set(cfg); err != nil {
		return fmt.Errorf("configure BPF: %w", err)
	}
	var objs reapiterObjects
	if err := spec.LoadAndAssign(&objs, nil); err != nil {
		return fmt.Errorf("load BPF programs: %w", err)
	}
	defer objs.Close()

	var iters []*link.Iter
	for _, p := range t.Protos {
		prog := map[sockindex.Proto]*ebpf.Program{sockindex.TCP: objs.ShuntReapTcp, sockindex.UDP: objs.ShuntReapUdp}[p]
		it, err := link.AttachIter(link.IterOptions{Program: prog})
		if err != nil {
			return fmt.Errorf("attach iterator: %w", err)
		}
		defer it.Close()
		iters = append(iters, it)
	}

	for _, ns := range host.AllNetns() {
		if err := ctx.Err(); err != nil {
			return err
		}
		var out []byte
		var iterErr, diagErr error
		// The iterators see the namespace the reading thread is in.
		err := host.InNetns(ns.Path, func() error {
			for _, it := range iters {
				b, err := bpfiter.Read(it)
				out = append(out, b...)
				if err != nil {
					iterErr = err
					return nil
				}
			}
			if byDiag && len(out) > 0 {
				diagErr = destroyFound(out, res)
				out = nil
			}
			return nil
		})
		if err != nil {
			continue // the namespace went away
		}
		res.Namespaces++
		appendReaped(res, out, !opts.DryRun)
		if iterErr != nil {
			return fmt.Errorf("socket iterator in %s: %w", ns.Path, iterErr)
		}
		if diagErr != nil {
			return fmt.Errorf("destroy in %s: %w", ns.Path, diagErr)
		}
	}
	return nil
}

// destroyFound destroys the sockets an iterator found in this thread's
// namespace through sock_diag, each by tuple and cookie.
func destroyFound(out []byte, res *Result) error {
	var socks []sockindex.Socket
	for _, r := range decodeReaped(out) {
		socks = append(socks, sockindex.Socket{
			Proto:       sockindex.Proto(r.Proto),
			Family:      int(r.Family),
			Local:       netip.AddrPortFrom(netip.AddrFrom16(r.Local).Unmap(), r.LocalPort),
			Remote:      netip.AddrPortFrom(netip.AddrFrom16(r.Remote).Unmap(), r.RemotePort),
			Cookie:      r.Cookie,
			NetnsCookie: r.NetnsCookie,
			LocalKnown:  true,
			KeepsPort:   r.Proto == uint8(sockindex.UDP),
		})
	}
	d, err := openDiag()
	if err != nil {
		return err
	}
	defer d.Close()
	return destroyIn(d, socks, false, res)
}

func decodeReaped(out []byte) []reapiterReaped {
	size := int(unsafe.Sizeof(reapiterReaped{}))
	var rs []reapiterReaped
	for len(out) >= size {
		var r reapiterReaped
		_, _ = binary.Decode(out[:size], binary.NativeEndian, &r)
		out = out[size:]
		rs = append(rs, r)
	}
	return rs
}

func appendReaped(res *Result, out []byte, destroying bool) {
	for _, r := range decodeReaped(out) {
		s := Socket{
			Proto:       sockindex.Proto(r.Proto).String(),
			Local:       netip.AddrPortFrom(netip.AddrFrom16(r.Local).Unmap(), r.LocalPort).String(),
			Remote:      netip.AddrPortFrom(netip.AddrFrom16(r.Remote).Unmap(), r.RemotePort).String(),
			Cookie:      r.Cookie,
			NetnsCookie: r.NetnsCookie,
			Destroyed:   destroying && r.Err == 0,
		}
		if r.Err != 0 {
			s.Error = syscall.Errno(-r.Err).Error()
		}
		res.Sockets = append(res.Sockets, s)
	}
}
