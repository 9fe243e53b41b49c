//go:build kernelmatrix

package bypass_test

import (
	"os/exec"
	"testing"

	"github.com/shunt-project/shunt/internal/testenv"
)

// Built only for the kernel matrix (scripts/kernels/build-tests.sh): the
// host's kernel has no IPVS, the Debian kernels the matrix boots have it.

// TestBypassThroughIPVS: kube-proxy's IPVS mode puts a Service's address on
// a dummy device of the node and lets IPVS, in NAT ("masquerading") mode,
// rewrite each connection's destination to an endpoint. IPVS rewrites
// addresses and ports, not sequence numbers: the connection is paired.
func TestBypassThroughIPVS(t *testing.T) {
	testenv.NeedProgram(t, "ipvsadm")
	in, cg := mustInstall(t)
	fams := []string{"ipv4", "ipv6"}
	if testing.Short() {
		fams = fams[:1] // the matrix's time; IPv6 passed by hand on 6.1 and 6.12 (docs/KERNELS.md)
	}
	for _, fam := range fams {
		t.Run(fam, func(t *testing.T) {
			v6 := fam == "ipv6"
			tr := routedTopology(t, v6)
			r := tr.router
			r.IP(t, "link", "add", "kube-ipvs0", "type", "dummy")
			vip, service, endpoint := testenv.ServiceIPv4+"/32", testenv.ServiceIPv4+":80", testenv.EndpointIPv4+":8080"
			if v6 {
				vip, service, endpoint = testenv.ServiceIPv6+"/128", "["+testenv.ServiceIPv6+"]:80", "["+testenv.EndpointIPv6+"]:8080"
			}
			r.AddAddress(t, "kube-ipvs0", vip)
			for _, args := range [][]string{
				{"-A", "-t", service, "-s", "rr"},
				{"-a", "-t", service, "-r", endpoint, "-m"},
			} {
				run(t, exec.Command("ip", append([]string{"netns", "exec", r.Name, "ipvsadm"}, args...)...), "")
			}
			checkTranslated(t, in, cg, tr)
		})
	}
}
