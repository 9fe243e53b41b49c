package fanout_test

import (
	"testing"

	"github.com/shunt-project/shunt/fanout"
	"github.com/shunt-project/shunt/host"
)

func wantKernelMechanisms(t *testing.T, onMap, probeReads bool) {
	t.Helper()
	l := mustForwarder(t, fanout.Config{Framing: fanout.FramingU32, Path: fanout.PathKernel})
	m, p, err := l.f.KernelMechanisms()
	if err != nil {
		t.Fatal(err)
	}
	if m != onMap || p != probeReads {
		t.Errorf("kernel path: attached on the map %v, probe reads %v; want %v, %v", m, p, onMap, probeReads)
	}
}

// The kernel path runs as this kernel allows: a link where it has sockmap
// links (6.10), kfunc reads where it has bpf_cast_to_kern_ctx (6.2).
func TestKernelPathMechanismsOfThisKernel(t *testing.T) {
	f := host.Probe()
	wantKernelMechanisms(t, !f.SkMsgLink, !f.CastToKernCtx)
}

// TestKernelPathAsOnOlderKernels runs the kernel path as kernels before
// 6.10 (verdict attached on the map) and 6.2 (the skb's truesize read by
// probe read) make it run, on this kernel, through the tests whose outcome
// those change: the bound on a stalled subscriber is priced in truesize, and
// nothing is left behind.
func TestKernelPathAsOnOlderKernels(t *testing.T) {
	for _, k := range []struct {
		name       string
		probeReads bool
	}{{"6.2-6.9", false}, {"6.1", true}} {
		t.Run(k.name, func(t *testing.T) {
			useMechanisms(t, host.Mechanisms{AttachOnMap: true, ProbeReads: k.probeReads})
			wantKernelMechanisms(t, true, k.probeReads || !host.Probe().CastToKernCtx)
			t.Run("backlog-bounded", TestKernelPathBacklogBounded)
			t.Run("no-leak", TestKernelPathNoLeak)
		})
	}
}
