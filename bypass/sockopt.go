package bypass

import (
	"errors"
	"fmt"
	"os"
	"path/filepath"
	"strconv"

	"github.com/cilium/ebpf"
	"github.com/cilium/ebpf/link"

	"github.com/shunt-project/shunt/host"
	"github.com/shunt-project/shunt/internal/pin"
)

// sockoptHook is a cgroup sockopt program that every enabled cgroup gets
// before sockops: a cgroup must never have sockets in the sockhash without
// the options a psock cannot honour being watched.
type sockoptHook struct {
	name   string // the program's pin under progs/, and its name in status
	dir    string // each enabled cgroup's link, pinned by cgroup id
	attach ebpf.AttachType
}

var sockoptHooks = []sockoptHook{
	// Refuses SO_ZEROCOPY and TCP_ULP, and sends receive options only TCP
	// honours back to TCP.
	{name: "setsockopt", dir: "cgroups-setsockopt", attach: ebpf.AttachCGroupSetsockopt},
	// Sends TCP_ZEROCOPY_RECEIVE readers back to TCP.
	{name: "getsockopt", dir: "cgroups-getsockopt", attach: ebpf.AttachCGroupGetsockopt},
}

// loadedSockopt is a hook whose program the install has pinned.
type loadedSockopt struct {
	sockoptHook
	prog *ebpf.Program
}

// openSockopts opens the hooks' pinned programs. Installs made before a
// hook existed lack its pin: their cgroups go without it.
func openSockopts(dir string) []loadedSockopt {
	var out []loadedSockopt
	for _, h := range sockoptHooks {
		p, err := ebpf.LoadPinnedProgram(filepath.Join(dir, progsDir, h.name), nil)
		if err == nil {
			out = append(out, loadedSockopt{h, p})
		}
	}
	return out
}

func (h loadedSockopt) linkPin(dir string, cgroupID uint64) string {
	return filepath.Join(dir, h.dir, strconv.FormatUint(cgroupID, 10))
}

// attachSockopts attaches the sockopt hooks to a cgroup and pins their
// links; a link pinned already stays. On failure none is left attached
// that was not before.
func (in *Install) attachSockopts(cg host.Cgroup) error {
	var done []loadedSockopt
	for _, h := range in.sockopts {
		attached, err := h.attachTo(in.dir, cg)
		if err != nil {
			for _, d := range done {
				err = errors.Join(err, d.detach(in.dir, cg.ID))
			}
			return err
		}
		if attached {
			done = append(done, h)
		}
	}
	return nil
}

func (h loadedSockopt) attachTo(dir string, cg host.Cgroup) (bool, error) {
	where := h.linkPin(dir, cg.ID)
	if _, err := os.Stat(where); err == nil {
		return false, nil
	}
	l, err := link.AttachCgroup(link.CgroupOptions{Path: cg.Path, Attach: h.attach, Program: h.prog})
	if err != nil {
		return false, fmt.Errorf("attach %s to %s: %w", h.name, cg.Path, err)
	}
	defer l.Close()
	tmp := where + "-new-" + strconv.Itoa(os.Getpid())
	if err := l.Pin(tmp); err != nil {
		return false, fmt.Errorf("pin %s link: %w", h.name, err)
	}
	if err := pin.RenameNoReplace(tmp, where); err != nil {
		os.Remove(tmp)
		if !errors.Is(err, os.ErrExist) {
			return false, fmt.Errorf("pin %s link: %w", h.name, err)
		}
		return false, nil // a racing enable pinned its own
	}
	return true, nil
}

// detachSockopts unpins a cgroup's sockopt links, those it has.
func (in *Install) detachSockopts(cgroupID uint64) error {
	var errs []error
	for _, h := range in.sockopts {
		errs = append(errs, h.detach(in.dir, cgroupID))
	}
	return errors.Join(errs...)
}

func (h loadedSockopt) detach(dir string, cgroupID uint64) error {
	l, err := link.LoadPinnedLink(h.linkPin(dir, cgroupID), nil)
	if errors.Is(err, os.ErrNotExist) {
		return nil
	}
	if err != nil {
		return fmt.Errorf("open %s link: %w", h.name, err)
	}
	defer l.Close()
	if err := l.Unpin(); err != nil {
		return fmt.Errorf("unpin %s link: %w", h.name, err)
	}
	return nil
}

// sockoptPrograms describes the hooks for status.
func (in *Install) sockoptPrograms(cgs []EnabledCgroup) ([]Program, error) {
	var out []Program
	for _, h := range in.sockopts {
		info, err := h.prog.Info()
		if err != nil {
			return nil, fmt.Errorf("%s program info: %w", h.name, err)
		}
		id, _ := info.ID()
		p := Program{Name: h.name, ID: uint32(id), Links: []uint32{}}
		for _, cg := range cgs {
			if lid, _, err := pinnedLinkIDs(h.linkPin(in.dir, cg.ID)); err == nil {
				p.Links = append(p.Links, lid)
			}
		}
		p.Attached = fmt.Sprintf("%d cgroup(s)", len(p.Links))
		out = append(out, p)
	}
	return out, nil
}
