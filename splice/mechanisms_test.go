package splice_test

import (
	"testing"

	"github.com/shunt-project/shunt/host"
	"github.com/shunt-project/shunt/splice"
)

// mechanismsTest is something that has Mechanisms (either splicer).
type mechanismsTest interface {
	Mechanisms() (onMap, probeReads bool, err error)
}

func wantMechanisms(t *testing.T, what string, s mechanismsTest, onMap, probeReads bool) {
	t.Helper()
	m, p, err := s.Mechanisms()
	if err != nil {
		t.Fatal(err)
	}
	if m != onMap || p != probeReads {
		t.Errorf("%s: attached on the map %v, probe reads %v; want %v, %v", what, m, p, onMap, probeReads)
	}
}

// The join runs as this kernel allows: a link where it has sockmap links
// (6.10), kfunc reads where it has bpf_cast_to_kern_ctx (6.2).
func TestJoinMechanismsOfThisKernel(t *testing.T) {
	f := host.Probe()
	wantMechanisms(t, "TCP", mustSplicer(t, splice.Options{}), !f.SkMsgLink, !f.CastToKernCtx)
	wantMechanisms(t, "UDP", mustUDPSplicer(t, splice.UDPOptions{}), !f.SkMsgLink, !f.CastToKernCtx)
}

// olderKernels are the kernel classes whose mechanisms can be forced here:
// 6.2 to 6.9 lack sockmap links (the verdict is attached on the map), 6.1
// also bpf_cast_to_kern_ctx (the skb is read by probe reads).
var olderKernels = []struct {
	name       string
	probeReads bool
}{
	{"6.2-6.9", false},
	{"6.1", true},
}

// TestJoinAsOnOlderKernels runs the join as older kernels make it run, on
// this kernel, through the tests whose outcome those mechanisms change: the
// verdict reads TCP's sequence number (retransmissions, EOF accounting) and
// the skb's truesize (the UDP bound), and a hand-over passes the attachment
// as the map itself.
func TestJoinAsOnOlderKernels(t *testing.T) {
	for _, k := range olderKernels {
		t.Run(k.name, func(t *testing.T) {
			useMechanisms(t, host.Mechanisms{AttachOnMap: true, ProbeReads: k.probeReads})
			probe := k.probeReads || !host.Probe().CastToKernCtx
			wantMechanisms(t, "TCP", mustSplicer(t, splice.Options{}), true, probe)
			wantMechanisms(t, "UDP", mustUDPSplicer(t, splice.UDPOptions{}), true, probe)
			for _, tc := range []struct {
				name string
				test func(*testing.T)
			}{
				{"retransmissions", TestRetransmissionsThroughTheKernel},
				{"eof", TestEOFWaitsForPassedBytes},
				{"stream", TestStreamBothWays},
				{"hand-over", TestHandOverMidStream},
				{"udp-bound", TestUDPBoundDrops},
				{"udp-hand-over", TestUDPHandOver},
			} {
				t.Run(tc.name, tc.test)
			}
		})
	}
}
