package reap

import (
	"context"
	"fmt"
	"net/netip"
	"syscall"
	"time"

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
	byDiag := !opts.DryRun && !opts.Mechanisms.SockDestroy()
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
	for _, r := range bpfiter.Records[reapiterReaped](out) {
		socks = append(socks, FoundSocket(r.Proto, r.Family, r.Local, r.LocalPort, r.Remote, r.RemotePort, r.Cookie, r.NetnsCookie))
	}
	return destroyHere(socks, res)
}

// FoundSocket is a socket an iterator found, as DestroyHere takes it.
func FoundSocket(proto, family uint8, local [16]byte, lport uint16, remote [16]byte, rport uint16, cookie, netns uint64) sockindex.Socket {
	return sockindex.Socket{
		Proto:       sockindex.Proto(proto),
		Family:      int(family),
		Local:       netip.AddrPortFrom(netip.AddrFrom16(local).Unmap(), lport),
		Remote:      netip.AddrPortFrom(netip.AddrFrom16(remote).Unmap(), rport),
		Cookie:      cookie,
		NetnsCookie: netns,
		LocalKnown:  true,
		KeepsPort:   proto == uint8(sockindex.UDP),
	}
}

// DestroyHere destroys sockets an iterator found in the calling thread's
// network namespace through sock_diag (kernels without bpf_sock_destroy),
// each by tuple and cookie, so a socket closed and reused meanwhile is
// spared.
func DestroyHere(socks []sockindex.Socket) (*Result, error) {
	res := &Result{}
	return res, destroyHere(socks, res)
}

func destroyHere(socks []sockindex.Socket, res *Result) error {
	d, err := openDiag()
	if err != nil {
		return err
	}
	defer d.Close()
	return destroyIn(d, socks, false, res)
}

func appendReaped(res *Result, out []byte, destroying bool) {
	for _, r := range bpfiter.Records[reapiterReaped](out) {
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
