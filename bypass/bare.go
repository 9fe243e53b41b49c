package bypass

import (
	"fmt"
	"path/filepath"

	"github.com/cilium/ebpf"
	"github.com/cilium/ebpf/link"
)

// UseBareRedirect swaps the install's sk_msg program for one that only
// redirects (no ordering guard, drain switch or counters), or back. It exists
// for benchmarks that measure what shunt's checks cost; a bare install must
// not carry real traffic.
func (in *Install) UseBareRedirect(bare bool) error {
	spec, err := loadBypass()
	if err != nil {
		return err
	}
	var objs struct {
		Full *ebpf.Program `ebpf:"shunt_sk_msg"`
		Bare *ebpf.Program `ebpf:"shunt_sk_msg_bare"`
	}
	if err := spec.LoadAndAssign(&objs, &ebpf.CollectionOptions{MapReplacements: in.maps}); err != nil {
		return fmt.Errorf("load sk_msg programs: %w", err)
	}
	defer objs.Full.Close()
	defer objs.Bare.Close()
	l, err := link.LoadPinnedLink(filepath.Join(in.dir, linksDir, skMsgLink), nil)
	if err != nil {
		return fmt.Errorf("open sk_msg link: %w", err)
	}
	defer l.Close()
	prog := objs.Full
	if bare {
		prog = objs.Bare
	}
	if err := l.Update(prog); err != nil {
		return fmt.Errorf("swap sk_msg program: %w", err)
	}
	return nil
}
