package bare_test

import (
	"testing"

	"github.com/cilium/ebpf"
	"github.com/cilium/ebpf/link"

	"github.com/shunt-project/shunt/bench/bare"
	"github.com/shunt-project/shunt/bypass"
	"github.com/shunt-project/shunt/bypass/bypasstest"
	"github.com/shunt-project/shunt/host"
	"github.com/shunt-project/shunt/internal/testenv"
)

// TestUseSwapsWhereTheProgramIsAttached: the bare program goes where the
// install's sk_msg program is, by link or on the sockhash itself (kernels
// before 6.10), and the install's own comes back.
func TestUseSwapsWhereTheProgramIsAttached(t *testing.T) {
	for _, attach := range []string{"link", "map"} {
		t.Run(attach, func(t *testing.T) {
			testenv.RequireRoot(t)
			opts := bypass.Options{Mechanisms: host.Mechanisms{AttachOnMap: attach == "map"}}
			in, err := bypass.Create(bypasstest.MustPinDir(t), opts)
			if err != nil {
				t.Fatal(err)
			}
			defer in.Close()
			if got := in.SkMsgAttach(); got != attach {
				t.Fatalf("install attached by %s, want %s", got, attach)
			}
			own := attachedProgram(t, in)
			if err := bare.Use(in, true); err != nil {
				t.Fatal(err)
			}
			if id := attachedProgram(t, in); id == own {
				t.Fatalf("the install's own program %d is still attached", own)
			}
			if err := bare.Use(in, false); err != nil {
				t.Fatal(err)
			}
			if id := attachedProgram(t, in); id != own {
				t.Fatalf("program %d attached after swapping back, want the install's %d", id, own)
			}
		})
	}
}

// attachedProgram is the ID of the one sk_msg program on the install's
// sockhash.
func attachedProgram(t *testing.T, in *bypass.Install) ebpf.ProgramID {
	t.Helper()
	m, err := ebpf.LoadPinnedMap(bypass.PinPaths(in.Dir()).SockHash, nil)
	if err != nil {
		t.Fatal(err)
	}
	defer m.Close()
	res, err := link.QueryPrograms(link.QueryOptions{Target: m.FD(), Attach: ebpf.AttachSkMsgVerdict})
	if err != nil {
		t.Fatal(err)
	}
	if len(res.Programs) != 1 {
		t.Fatalf("%d sk_msg programs on the sockhash, want 1", len(res.Programs))
	}
	return res.Programs[0].ID
}
