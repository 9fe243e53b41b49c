// Package bare swaps a bypass install's sk_msg program for one that only
// redirects (bpf/bench_bare.c), for benchmarks that measure what shunt's
// checks cost. Not for real traffic: a bare install drops sends to a
// missing peer and has no flow control.
package bare

import (
	"fmt"

	"github.com/cilium/ebpf"
	"github.com/cilium/ebpf/link"

	"github.com/shunt-project/shunt/bypass"
)

//go:generate go run github.com/cilium/ebpf/cmd/bpf2go -cc clang -target bpfel -no-global-types -cflags "-O2 -g -Wall -Werror -mcpu=v3 -I/usr/include/x86_64-linux-gnu" bare ../../bpf/bench_bare.c

// Use puts the bare program (bare) or the install's own (!bare) where the
// install's sk_msg program is attached: its link, or the sockhash itself.
func Use(in *bypass.Install, bare bool) error {
	paths := bypass.PinPaths(in.Dir())
	if !bare {
		return swap(in, paths)
	}
	spec, err := loadBare()
	if err != nil {
		return err
	}
	maps := map[string]*ebpf.Map{}
	for name, path := range map[string]string{"sock_hash": paths.SockHash, "sock_states": paths.SockStates} {
		m, err := ebpf.LoadPinnedMap(path, nil)
		if err != nil {
			return fmt.Errorf("open pinned map %s: %w", name, err)
		}
		defer m.Close()
		maps[name] = m
	}
	// The program alone: the header's other maps are not loaded at all.
	var objs struct {
		Bare *ebpf.Program `ebpf:"shunt_sk_msg_bare"`
	}
	if err := spec.LoadAndAssign(&objs, &ebpf.CollectionOptions{MapReplacements: maps}); err != nil {
		return fmt.Errorf("load the bare sk_msg program: %w", err)
	}
	defer objs.Bare.Close()
	return update(in, paths, objs.Bare)
}

// swap puts the install's own sk_msg program back.
func swap(in *bypass.Install, paths bypass.Paths) error {
	p, err := ebpf.LoadPinnedProgram(paths.SkMsgProg, nil)
	if err != nil {
		return fmt.Errorf("open the install's sk_msg program: %w", err)
	}
	defer p.Close()
	return update(in, paths, p)
}

// update attaches p in place of the sk_msg program there now: on the link,
// or, for an install attached to the map itself (before 6.10), on the
// sockhash, where a new program replaces the old one.
func update(in *bypass.Install, paths bypass.Paths, p *ebpf.Program) error {
	if in.SkMsgAttach() == "map" {
		m, err := ebpf.LoadPinnedMap(paths.SockHash, nil)
		if err != nil {
			return fmt.Errorf("open the sockhash: %w", err)
		}
		defer m.Close()
		if err := link.RawAttachProgram(link.RawAttachProgramOptions{Target: m.FD(), Program: p, Attach: ebpf.AttachSkMsgVerdict}); err != nil {
			return fmt.Errorf("swap sk_msg program: %w", err)
		}
		return nil
	}
	l, err := link.LoadPinnedLink(paths.SkMsgLink, nil)
	if err != nil {
		return fmt.Errorf("open sk_msg link: %w", err)
	}
	defer l.Close()
	if err := l.Update(p); err != nil {
		return fmt.Errorf("swap sk_msg program: %w", err)
	}
	return nil
}
