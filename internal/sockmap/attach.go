// Package sockmap attaches sk_msg and sk_skb programs to a sockmap or
// sockhash the way the running kernel allows: as a BPF link (6.10 and
// later), else on the map itself (the older attach, which lasts as long as
// the map does and has no descriptor of its own).
package sockmap

import (
	"errors"
	"fmt"
	"os"
	"strconv"

	"github.com/cilium/ebpf"
	"github.com/cilium/ebpf/link"
	"golang.org/x/sys/unix"
)

// Attachment is a program attached to a map.
type Attachment struct {
	link link.Link // nil: attached on the map
	m    *ebpf.Map
	prog *ebpf.Program
	typ  ebpf.AttachType
}

// Attach attaches prog to m as typ: as a link where the kernel has them,
// unless onMap asks for the older attach on the map itself. The Attachment
// holds m and prog only as long as their owner keeps them open.
func Attach(m *ebpf.Map, prog *ebpf.Program, typ ebpf.AttachType, onMap bool) (*Attachment, error) {
	a := &Attachment{m: m, prog: prog, typ: typ}
	if !onMap {
		l, err := link.AttachRawLink(link.RawLinkOptions{Target: m.FD(), Program: prog, Attach: typ})
		if err == nil {
			a.link = l
			return a, nil
		}
		// Kernels before 6.10 answer a link on a sockmap with EINVAL.
		if !errors.Is(err, ebpf.ErrNotSupported) && !errors.Is(err, unix.EINVAL) {
			return nil, err
		}
	}
	if err := link.RawAttachProgram(link.RawAttachProgramOptions{Target: m.FD(), Program: prog, Attach: typ}); err != nil {
		return nil, fmt.Errorf("attach on the map: %w", err)
	}
	return a, nil
}

// OnMap says whether the program is attached on the map (no link).
func (a *Attachment) OnMap() bool { return a.link == nil }

// Link is the BPF link, nil for an attach on the map.
func (a *Attachment) Link() link.Link { return a.link }

// FD is what a hand-over passes for the attachment: the link's descriptor,
// or for an attach on the map the map's own (Adopt tells them apart).
func (a *Attachment) FD() int {
	if a.link != nil {
		return a.link.(interface{ FD() int }).FD()
	}
	return a.m.FD()
}

// Close detaches the program (a link: drops this descriptor of it, which
// detaches once no other process holds one).
func (a *Attachment) Close() error {
	if a.link != nil {
		return a.link.Close()
	}
	err := link.RawDetachProgram(link.RawDetachProgramOptions{Target: a.m.FD(), Program: a.prog, Attach: a.typ})
	if errors.Is(err, unix.ENOENT) { // detached already
		return nil
	}
	return err
}

// Release lets go of the attachment without detaching: another process
// holds it now (a hand-over).
func (a *Attachment) Release() error {
	if a.link != nil {
		return a.link.Close()
	}
	return nil
}

// Adopt takes over an attachment from a descriptor another process passed
// (see FD): a link, or the map m itself. It owns fd.
func Adopt(fd int, m *ebpf.Map, prog *ebpf.Program, typ ebpf.AttachType) (*Attachment, error) {
	// A BPF object's kind is in its anonymous inode's name; asking for
	// the info of the wrong kind would read one struct as another.
	kind, err := os.Readlink("/proc/self/fd/" + strconv.Itoa(fd))
	if err != nil {
		unix.Close(fd)
		return nil, err
	}
	switch kind {
	case "anon_inode:bpf_link":
		l, err := link.NewFromFD(fd)
		if err != nil {
			return nil, err
		}
		return &Attachment{link: l, m: m, prog: prog, typ: typ}, nil
	case "anon_inode:bpf-map":
		same, err := sameMap(fd, m)
		unix.Close(fd)
		if err != nil {
			return nil, err
		}
		if !same {
			return nil, errors.New("the attachment names another map")
		}
		return &Attachment{m: m, prog: prog, typ: typ}, nil
	}
	unix.Close(fd)
	return nil, fmt.Errorf("the attachment is neither a BPF link nor its map (%s)", kind)
}

func sameMap(fd int, m *ebpf.Map) (bool, error) {
	dup, err := unix.FcntlInt(uintptr(fd), unix.F_DUPFD_CLOEXEC, 0)
	if err != nil {
		return false, err
	}
	other, err := ebpf.NewMapFromFD(dup)
	if err != nil {
		return false, err
	}
	defer other.Close()
	a, err := other.Info()
	if err != nil {
		return false, err
	}
	b, err := m.Info()
	if err != nil {
		return false, err
	}
	ida, oka := a.ID()
	idb, okb := b.ID()
	return oka && okb && ida == idb, nil
}
