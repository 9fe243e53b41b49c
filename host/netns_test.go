package host_test

import (
	"testing"

	"github.com/shunt-project/shunt/host"
	"github.com/shunt-project/shunt/internal/testenv"
)

// Namespaces are named for what they are, wherever shunt runs: the kernel's
// initial one "host", one made by `ip netns` by its name (never "shunt"
// for the namespace shunt itself runs in, as a container's would be).
func TestNetnsNames(t *testing.T) {
	testenv.RequireRoot(t)
	ns := testenv.MustNetNS(t)
	hostCookie, err := host.CurrentNetnsCookie()
	if err != nil {
		t.Fatal(err)
	}
	var own uint64
	var names map[uint64]string
	ns.Do(t, func() {
		own, err = host.CurrentNetnsCookie()
		names = host.NetnsNames()
	})
	if err != nil {
		t.Fatal(err)
	}
	if names[hostCookie] != "host" {
		t.Errorf("the initial namespace is named %q, want host", names[hostCookie])
	}
	if names[own] != ns.Name {
		t.Errorf("the namespace shunt ran in is named %q, want its ip netns name %q", names[own], ns.Name)
	}
}
