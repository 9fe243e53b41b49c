// Package host answers questions about the machine shunt runs on: privileges,
// kernel features, where cgroup v2 and bpffs are.
package host

import (
	"errors"
	"fmt"
	"os"
	"strconv"
	"strings"

	"github.com/cilium/ebpf"
	"github.com/cilium/ebpf/asm"
	"github.com/cilium/ebpf/features"
	"golang.org/x/sys/unix"
)

// MinKernel is the oldest kernel shunt runs on: sk_msg programs attach to a
// sockhash as pinnable BPF links since 6.10.
var MinKernel = [2]int{6, 10}

// ErrNotRoot is returned when shunt lacks the privileges it needs.
var ErrNotRoot = errors.New("permission denied: run shunt as root (it needs CAP_BPF, CAP_NET_ADMIN and CAP_SYS_ADMIN)")

// CheckPrivileges fails unless the process may load BPF and attach to cgroups.
func CheckPrivileges() error {
	if os.Geteuid() != 0 {
		return ErrNotRoot
	}
	return nil
}

// Features is what the kernel offers shunt.
type Features struct {
	Kernel    string `json:"kernel"`
	SockHash  bool   `json:"sockhash"`
	SkMsg     bool   `json:"sk_msg"`
	SockOps   bool   `json:"sockops"`
	SkStorage bool   `json:"sk_storage"`
	SkMsgLink bool   `json:"sk_msg_link"`
	BTF       bool   `json:"btf"`
	// RecvTracepoint: a BTF tracepoint program can attach to
	// sock_recv_length (the reader watch; 6.3+).
	RecvTracepoint bool `json:"recv_tracepoint"`
	// SpliceTracepoint: a BTF tracepoint program can attach to
	// tcp_rcv_space_adjust (the splice watch).
	SpliceTracepoint bool `json:"splice_tracepoint"`
	// FileIterator: an iter/task_file program loads (how shunt finds the
	// sockets it holds, for flows and removal).
	FileIterator bool `json:"file_iterator"`
}

// Missing lists the features bypass needs and the kernel lacks.
func (f Features) Missing() []string {
	var m []string
	for _, c := range []struct {
		ok   bool
		name string
	}{
		{f.SockHash, "SOCKHASH maps (CONFIG_BPF_STREAM_PARSER / CONFIG_NET_SOCK_MSG)"},
		{f.SkMsg, "sk_msg programs (CONFIG_NET_SOCK_MSG)"},
		{f.SockOps, "sockops programs (CONFIG_CGROUP_BPF)"},
		{f.SkStorage, "socket local storage"},
		{f.SkMsgLink, fmt.Sprintf("sk_msg BPF links (kernel %d.%d or newer)", MinKernel[0], MinKernel[1])},
		{f.BTF, "kernel BTF (/sys/kernel/btf/vmlinux, CONFIG_DEBUG_INFO_BTF)"},
		{f.RecvTracepoint, "BTF tracepoint programs on sock_recv_length (kernel 6.3 or newer, not locked down)"},
		{f.SpliceTracepoint, "BTF tracepoint programs on tcp_rcv_space_adjust"},
		{f.FileIterator, "BPF iterators over open files (iter/task_file)"},
	} {
		if !c.ok {
			m = append(m, c.name)
		}
	}
	return m
}

// Err returns one line naming what the kernel lacks, or nil.
func (f Features) Err() error {
	if m := f.Missing(); len(m) > 0 {
		return fmt.Errorf("kernel %s cannot run shunt bypass: missing %s; use Linux %d.%d or newer with CONFIG_BPF_SYSCALL, CONFIG_CGROUP_BPF, CONFIG_NET_SOCK_MSG and BTF",
			f.Kernel, strings.Join(m, ", "), MinKernel[0], MinKernel[1])
	}
	return nil
}

// Probe asks the running kernel what it supports. Needs privileges.
func Probe() Features {
	f := Features{Kernel: kernelRelease()}
	f.SockHash = features.HaveMapType(ebpf.SockHash) == nil
	f.SkStorage = features.HaveMapType(ebpf.SkStorage) == nil
	f.SkMsg = features.HaveProgramType(ebpf.SkMsg) == nil
	f.SockOps = features.HaveProgramType(ebpf.SockOps) == nil
	maj, min := kernelVersion(f.Kernel)
	f.SkMsgLink = maj > MinKernel[0] || (maj == MinKernel[0] && min >= MinKernel[1])
	_, err := os.Stat("/sys/kernel/btf/vmlinux")
	f.BTF = err == nil
	f.RecvTracepoint = f.BTF && canLoadTracing(ebpf.AttachTraceRawTp, "sock_recv_length")
	f.SpliceTracepoint = f.BTF && canLoadTracing(ebpf.AttachTraceRawTp, "tcp_rcv_space_adjust")
	f.FileIterator = f.BTF && canLoadTracing(ebpf.AttachTraceIter, "task_file")
	return f
}

// canLoadTracing loads (and drops) a do-nothing tracing program of this
// attach type and target.
func canLoadTracing(attach ebpf.AttachType, target string) bool {
	p, err := ebpf.NewProgram(&ebpf.ProgramSpec{
		Type: ebpf.Tracing, AttachType: attach, AttachTo: target, License: "GPL",
		Instructions: asm.Instructions{asm.Mov.Imm(asm.R0, 0), asm.Return()},
	})
	if err != nil {
		return false
	}
	p.Close()
	return true
}

func kernelRelease() string {
	var u unix.Utsname
	if unix.Uname(&u) != nil {
		return "unknown"
	}
	return unix.ByteSliceToString(u.Release[:])
}

func kernelVersion(release string) (int, int) {
	parts := strings.SplitN(release, ".", 3)
	if len(parts) < 2 {
		return 0, 0
	}
	maj, _ := strconv.Atoi(parts[0])
	min, _ := strconv.Atoi(strings.TrimFunc(parts[1], func(r rune) bool { return r < '0' || r > '9' }))
	return maj, min
}
