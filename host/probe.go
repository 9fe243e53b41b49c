// Package host answers questions about the machine shunt runs on: privileges,
// kernel features, where cgroup v2 and bpffs are.
package host

import (
	"errors"
	"fmt"
	"os"
	"strconv"
	"strings"
	"sync"

	"github.com/cilium/ebpf"
	"github.com/cilium/ebpf/asm"
	"github.com/cilium/ebpf/btf"
	"github.com/cilium/ebpf/features"
	"github.com/cilium/ebpf/link"
	"golang.org/x/sys/unix"
)

// MinKernel is the oldest kernel shunt is tested on (Debian 12's
// 6.1). Before 6.3 the reader watch needs fexit programs, which a kernel
// may refuse (lockdown). Features are probed, not inferred from the version;
// this names the version in messages.
var MinKernel = [2]int{6, 1}

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
	// SkMsgLink: sk_msg attaches to a sockhash as a BPF link (6.10+);
	// without it shunt attaches to the map itself.
	SkMsgLink bool `json:"sk_msg_link"`
	BTF       bool `json:"btf"`
	// RdonlyCast: the kfunc bpf_rdonly_cast (6.2+), with which sk_msg
	// reads the peer's TCP state.
	RdonlyCast bool `json:"rdonly_cast"`
	// CastToKernCtx: the kfunc bpf_cast_to_kern_ctx (6.2+), with which
	// the join's and fan-out's sk_skb verdicts read the kernel's skb.
	CastToKernCtx bool `json:"cast_to_kern_ctx"`
	// SockDestroy: the kfunc bpf_sock_destroy (6.5+), with which reap's
	// iterators destroy what they find; without it sock_diag does.
	SockDestroy bool `json:"sock_destroy"`
	// RecvTracepoint: a BTF tracepoint program can attach to
	// sock_recv_length (the reader watch; 6.3+).
	RecvTracepoint bool `json:"recv_tracepoint"`
	// RecvFexit: an fexit program loads on tcp_bpf_recvmsg, the reader
	// watch where the tracepoint is missing.
	RecvFexit bool `json:"recv_fexit"`
	// SpliceTracepoint: a BTF tracepoint program can attach to
	// tcp_rcv_space_adjust (the splice watch).
	SpliceTracepoint bool `json:"splice_tracepoint"`
	// FileIterator: an iter/task_file program loads (how shunt finds the
	// sockets it holds, for flows and removal).
	FileIterator bool `json:"file_iterator"`
	// LSM: BPF LSM programs attach (lsm/file_permission: "bpf" among the
	// kernel's active LSMs, not locked down). Optional: with it a splice
	// from a bypassed socket is refused before it reads.
	LSM bool `json:"bpf_lsm"`
	// FionreadCountsTCP: FIONREAD (SIOCINQ) counts bytes that came by TCP
	// into a socket in a sockhash with an sk_msg program, as shunt's are.
	// Kernels without the fix (04af4efde58a, 7.2) report only redirected
	// bytes there. Not needed; what a reader sees differs without it.
	FionreadCountsTCP bool `json:"fionread_counts_tcp"`
	// PsockCounts: the psock counts redirected bytes (msg_tot_len), so
	// FIONREAD includes them.
	PsockCounts bool `json:"psock_counts"`
	// WriteUser: tracepoint programs may call bpf_probe_write_user (not
	// under lockdown). With it shunt corrects FIONREAD where the kernel's
	// leaves bytes out (FionreadCountsTCP or PsockCounts false); probed
	// only there.
	WriteUser bool `json:"bpf_probe_write_user"`
}

// FionreadMisses says whether FIONREAD of a socket in a sockhash leaves
// queued bytes out on this kernel: TCP's (6.18 without the fix) or the
// redirected ones (6.1).
func (f Features) FionreadMisses() bool {
	return !f.FionreadCountsTCP || !f.PsockCounts
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
		{f.BTF, "kernel BTF (/sys/kernel/btf/vmlinux, CONFIG_DEBUG_INFO_BTF)"},
		{f.RecvTracepoint || f.RecvFexit, "a reader watch: BTF tracepoint programs on sock_recv_length (kernel 6.3 or newer) or fexit programs on tcp_bpf_recvmsg (not locked down)"},
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
	f.SkMsgLink = f.SockHash && f.SkMsg && canLinkSkMsg()
	_, err := os.Stat("/sys/kernel/btf/vmlinux")
	f.BTF = err == nil
	f.RdonlyCast = f.BTF && HasRdonlyCast()
	f.CastToKernCtx = f.BTF && kernelHasFunc("bpf_cast_to_kern_ctx")
	f.SockDestroy = f.BTF && kernelHasFunc("bpf_sock_destroy")
	f.RecvTracepoint = f.BTF && canLoadTracing(ebpf.AttachTraceRawTp, "sock_recv_length")
	f.RecvFexit = f.BTF && canLoadTracing(ebpf.AttachTraceFExit, "tcp_bpf_recvmsg")
	f.SpliceTracepoint = f.BTF && canLoadTracing(ebpf.AttachTraceRawTp, "tcp_rcv_space_adjust")
	f.FileIterator = f.BTF && canLoadTracing(ebpf.AttachTraceIter, "task_file")
	f.LSM = f.BTF && CanRefuseSplice()
	f.PsockCounts = f.BTF && PsockCountsQueue()
	f.FionreadCountsTCP = f.SockHash && f.SkMsg && fionreadCountsTCP(f.SkMsgLink)
	// Asked only where it matters: loading the helper makes the kernel
	// log a warning.
	if f.FionreadMisses() {
		f.WriteUser = CanWriteUser()
	}
	return f
}

// Mechanism is how the running kernel gives shunt one feature.
type Mechanism struct {
	Feature string `json:"feature"`
	Via     string `json:"via"` // "" when the kernel lacks it
}

// Mechanisms lists, per feature, the mechanism this kernel offers.
func (f Features) Mechanisms() []Mechanism {
	pick := func(ok bool, via string) string {
		if ok {
			return via
		}
		return ""
	}
	splice := pick(f.SpliceTracepoint, "seen by the splice watch: the socket goes back to TCP, or is reset by the guard if redirected bytes were queued")
	if splice != "" && f.LSM {
		splice += "; or, installed with --refuse-splice, refused with EINVAL by lsm/file_permission before it reads"
	}
	peer := "kfunc bpf_rdonly_cast"
	if !f.RdonlyCast {
		peer = "bpf_probe_read_kernel (no bpf_rdonly_cast: kernels before 6.2)"
	}
	reads := pick(f.RecvTracepoint, "tp_btf/sock_recv_length")
	if reads == "" && f.RecvFexit {
		reads = "fexit/tcp_bpf_recvmsg (no sock_recv_length tracepoint: kernels before 6.3)"
	}
	fionread := "counted, as over TCP (the kernel has the fix)"
	if !f.FionreadCountsTCP {
		fionread = "not counted while the socket is in the sockhash (kernel fix 04af4efde58a missing; docs/TRANSPARENCY.md)"
	}
	redirected := "counted (the psock counts its queue)"
	if !f.PsockCounts {
		redirected = "not counted (no msg_tot_len in the psock: kernels before 6.8ish; shunt counts them itself for flow control; docs/TRANSPARENCY.md)"
	}
	correct := "not needed: the kernel counts every byte"
	if f.FionreadMisses() {
		correct = "not possible: bpf_probe_write_user refused (lockdown); tracepoint syscalls/sys_exit_ioctl notes each reader told too few, whose connection the guard sends back to TCP at once, and the stall watch and scan wake readers told 0 (docs/TRANSPARENCY.md)"
		if f.WriteUser {
			correct = "tracepoint syscalls/sys_exit_ioctl adds the bytes the kernel leaves out (bpf_probe_write_user)"
		}
	}
	attach := "on the sockhash itself (no link: kernels before 6.10)"
	if f.SkMsgLink {
		attach = "a pinned BPF link"
	}
	// sk_skb links came with sk_msg links (6.10).
	verdict := "on the sockmap itself (no link: kernels before 6.10)"
	if f.SkMsgLink {
		verdict = "a BPF link"
	}
	skb := "kfunc bpf_cast_to_kern_ctx"
	if !f.CastToKernCtx {
		skb = "bpf_probe_read_kernel (no bpf_cast_to_kern_ctx: kernels before 6.2)"
	}
	destroy := "iter/tcp and iter/udp, kfunc bpf_sock_destroy"
	if !f.SockDestroy {
		destroy = "iter/tcp and iter/udp find, sock_diag destroys (no bpf_sock_destroy: kernels before 6.5)"
	}
	return []Mechanism{
		{"bypass: sk_msg on the sockhash", pick(f.SkMsg && f.SockHash, attach)},
		{"bypass: pairing", pick(f.SockOps && f.SkStorage, "sockops on the cgroup, socket storage")},
		{"bypass: the peer's TCP state", peer},
		{"bypass: reader watch", reads},
		{"bypass: a reader waiting to write (stalls)", pick(f.BTF, "its process's sockets looked through when it seems stuck (4,096 descriptors at most): one whose send found its buffer full gives the reader 20 ms more for its write before it is woken")},
		{"bypass: splice(2) watch", pick(f.SpliceTracepoint, "tp_btf/tcp_rcv_space_adjust")},
		{"bypass: finding held sockets", pick(f.FileIterator, "iter/task_file")},
		{"bypass: splice(2) after recv", splice},
		{"bypass: FIONREAD of bytes that came by TCP", pick(f.SockHash && f.SkMsg, fionread)},
		{"bypass: FIONREAD of redirected bytes", pick(f.SockHash && f.SkMsg, redirected)},
		{"bypass: FIONREAD corrected", correct},
		{"join and fan-out: sk_skb verdict on the sockmap", verdict},
		{"join and fan-out: reading the skb", pick(f.BTF, skb)},
		{"reap without the index", pick(f.BTF, destroy)},
	}
}

// HasRdonlyCast says whether the kernel has the kfunc bpf_rdonly_cast,
// with which sk_msg reads the peer's TCP state without a helper call.
func HasRdonlyCast() bool {
	return kernelHasFunc("bpf_rdonly_cast")
}

// HasSockDestroy says whether the kernel has the kfunc bpf_sock_destroy
// (6.5), with which the reap iterators destroy the sockets they find.
func HasSockDestroy() bool {
	return kernelHasFunc("bpf_sock_destroy")
}

// Mechanisms are the ways of using the kernel that differ between the
// kernels shunt runs on. The zero value takes the newest the running
// kernel has; a field set takes an older kernel's way where the running
// kernel has both, so that tests run both ways on one kernel. Programs
// take them from their package's options, never from the environment.
type Mechanisms struct {
	// ProbeReads: BPF programs read kernel structs with
	// bpf_probe_read_kernel, as before the kfunc casts (6.2).
	ProbeReads bool
	// AttachOnMap: sk_msg and sk_skb verdicts are attached on their map,
	// as before sockmap links (6.10).
	AttachOnMap bool
	// DiagDestroy: sockets found by an iterator are destroyed through
	// sock_diag, as before bpf_sock_destroy (6.5).
	DiagDestroy bool
	// KernelFIONREAD: FIONREAD is left as the kernel answers it, as under
	// lockdown (no bpf_probe_write_user), where it leaves bytes out.
	KernelFIONREAD bool
}

// KernelReadsByProbe says whether programs loaded with m read kernel
// structs with bpf_probe_read_kernel: m asks for it, or the kernel lacks
// the kfuncs bpf_rdonly_cast and bpf_cast_to_kern_ctx (both 6.2).
func (m Mechanisms) KernelReadsByProbe() bool {
	return m.ProbeReads || !HasRdonlyCast() || !kernelHasFunc("bpf_cast_to_kern_ctx")
}

// SockDestroy says whether iterators loaded with m destroy the sockets
// they find themselves (bpf_sock_destroy), not through sock_diag.
func (m Mechanisms) SockDestroy() bool {
	return !m.DiagDestroy && HasSockDestroy()
}

// FionreadCountsTCP says whether FIONREAD counts the bytes that came by TCP
// into a socket in a sockhash with an sk_msg program (Features has the
// same answer among the others).
func FionreadCountsTCP() bool {
	return fionreadCountsTCP(canLinkSkMsg())
}

// PsockCountsQueue says whether the kernel's psock counts the bytes
// redirected into it (sk_psock.msg_tot_len): FIONREAD counts them there,
// and shunt's flow control reads the count; before it (6.1) shunt counts.
func PsockCountsQueue() bool {
	return kernelStructHas("sk_psock", "msg_tot_len")
}

// CanRefuseSplice says whether a BPF LSM program attaches to
// file_permission, where shunt refuses a splice from a bypassed socket.
func CanRefuseSplice() bool {
	p, err := ebpf.NewProgram(&ebpf.ProgramSpec{
		Type: ebpf.LSM, AttachType: ebpf.AttachLSMMac, AttachTo: "file_permission", License: "GPL",
		Instructions: asm.Instructions{asm.Mov.Imm(asm.R0, 0), asm.Return()},
	})
	if err != nil {
		return false
	}
	defer p.Close()
	l, err := link.AttachLSM(link.LSMOptions{Program: p})
	if err != nil {
		return false
	}
	l.Close()
	return true
}

// canLinkSkMsg says whether an sk_msg program attaches to a sockhash as a
// BPF link.
func canLinkSkMsg() bool {
	m, p, err := scratchSkMsg()
	if err != nil {
		return false
	}
	defer m.Close()
	defer p.Close()
	l, err := link.AttachRawLink(link.RawLinkOptions{Target: m.FD(), Program: p, Attach: ebpf.AttachSkMsgVerdict})
	if err != nil {
		return false
	}
	l.Close()
	return true
}

// scratchSkMsg makes a one-entry sockhash and an sk_msg program that passes
// every send, for probes.
func scratchSkMsg() (*ebpf.Map, *ebpf.Program, error) {
	m, err := ebpf.NewMap(&ebpf.MapSpec{Type: ebpf.SockHash, KeySize: 4, ValueSize: 8, MaxEntries: 1})
	if err != nil {
		return nil, nil, err
	}
	p, err := ebpf.NewProgram(&ebpf.ProgramSpec{
		Type: ebpf.SkMsg, AttachType: ebpf.AttachSkMsgVerdict, License: "GPL",
		Instructions: asm.Instructions{asm.Mov.Imm(asm.R0, 1), asm.Return()},
	})
	if err != nil {
		m.Close()
		return nil, nil, err
	}
	return m, p, nil
}

// kernelHasFunc says whether the kernel's BTF has a function of this name
// (a kfunc, for instance).
func kernelHasFunc(name string) bool {
	return kernelBTFSays("func "+name, func(spec *btf.Spec) bool {
		var fn *btf.Func
		return spec.TypeByName(name, &fn) == nil
	})
}

// kernelStructHas says whether the kernel's BTF has a struct of this name
// with a member of that name.
func kernelStructHas(name, member string) bool {
	return kernelBTFSays("struct "+name+"."+member, func(spec *btf.Spec) bool {
		var st *btf.Struct
		if spec.TypeByName(name, &st) != nil {
			return false
		}
		for _, m := range st.Members {
			if m.Name == member {
				return true
			}
		}
		return false
	})
}

// kernelAnswers holds what the running kernel's BTF said, by question: it
// cannot change while shunt runs, and decoding it for each question took
// 20 ms on the host and seconds under qemu without KVM, several times an
// install.
var kernelAnswers sync.Map

// kernelBTFSays asks the kernel's BTF once per process; without BTF every
// answer is no.
func kernelBTFSays(question string, ask func(*btf.Spec) bool) bool {
	if v, ok := kernelAnswers.Load(question); ok {
		return v.(bool)
	}
	spec, err := btf.LoadKernelSpec()
	yes := err == nil && ask(spec)
	kernelAnswers.Store(question, yes)
	return yes
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

// OlderThan says whether the running kernel is older than v.
func OlderThan(v [2]int) bool {
	maj, min := kernelVersion(kernelRelease())
	return maj < v[0] || (maj == v[0] && min < v[1])
}

// Explain adds to a load error of what on a kernel older than need, which
// kernel it needs: the verifier's own words name a helper or kfunc, not a
// version.
func Explain(err error, what string, need [2]int) error {
	if err == nil || !OlderThan(need) {
		return err
	}
	return fmt.Errorf("%w (%s needs Linux %d.%d or newer; this is %s)", err, what, need[0], need[1], kernelRelease())
}
