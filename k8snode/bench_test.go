//go:build k8snode

package k8snode_test

import (
	"fmt"
	"os"
	"slices"
	"strconv"
	"strings"
	"testing"
	"time"

	"github.com/shunt-project/shunt/bypass"
)

// BenchmarkAgent measures the agent on a node as TestNode makes it (no
// kube-proxy): how long after a selected pod is created through the API its
// cgroup is enabled (kubelet's cgroup made right after the API call, as
// kubelet makes it once it sees the pod), one pod after another; then, with
// more pods on the node, the agent's resident memory and how long a scrape
// of its metrics takes. One iteration is the whole run:
//
//	scripts/k8s.sh bench   (go test -tags k8snode -run '^$' -bench BenchmarkAgent -benchtime 1x ./k8snode)
func BenchmarkAgent(b *testing.B) {
	const timed, total = 50, 200
	for range b.N {
		c, k, pin, agent := startNode(b, "")
		var in *bypass.Install
		var lat, after []time.Duration // from the API call, from the cgroup's mkdir
		for i := range total {
			start := time.Now()
			created := c.createPod(b, fmt.Sprintf("bench-%d", i), map[string]string{"app": "bench"}, true)
			made := time.Now()
			cg := k.podCgroup(b, created)
			if i >= timed {
				continue // enabled in the background; waited for below
			}
			for in == nil || !slices.Contains(cgroupIDs(b, in), cg.ID) {
				if in == nil { // the first pod's enable installs bypass
					if opened, err := bypass.Open(pin); err == nil {
						in = opened
						b.Cleanup(func() { opened.Close() })
						continue
					}
				}
				if time.Since(start) > 30*time.Second {
					b.Fatalf("pod %d not enabled 30 s after its creation", i)
				}
				time.Sleep(2 * time.Millisecond)
			}
			lat = append(lat, time.Since(start))
			after = append(after, time.Since(made))
		}
		for deadline := time.Now().Add(60 * time.Second); len(cgroupIDs(b, in)) < total; time.Sleep(50 * time.Millisecond) {
			if time.Now().After(deadline) {
				b.Fatalf("%d of %d pods enabled after 60 s", len(cgroupIDs(b, in)), total)
			}
		}
		var scrapes []time.Duration
		for range 7 {
			start := time.Now()
			if _, err := c.scrape("http://127.0.0.1:9464/metrics"); err != nil {
				b.Fatal(err)
			}
			scrapes = append(scrapes, time.Since(start))
		}
		slices.Sort(lat)
		slices.Sort(after)
		slices.Sort(scrapes)
		rss := residentKiB(b, agent.Pid)
		b.ReportMetric(float64(lat[len(lat)/2].Microseconds())/1e3, "enable-p50-ms")
		b.ReportMetric(float64(lat[len(lat)-1].Microseconds())/1e3, "enable-max-ms")
		b.ReportMetric(float64(rss)/1024, "agent-rss-MiB")
		b.ReportMetric(float64(scrapes[len(scrapes)/2].Microseconds())/1e3, "scrape-ms")
		b.Logf("%d pods created one by one through the API: enabled after %v median, %v max (min %v); after their cgroup's mkdir %v median, %v max; %d pods: agent resident %.1f MiB, a scrape %v (median of 7)",
			timed, lat[len(lat)/2], lat[len(lat)-1], lat[0], after[len(after)/2], after[len(after)-1], total, float64(rss)/1024, scrapes[len(scrapes)/2])
	}
}

func cgroupIDs(t testing.TB, in *bypass.Install) []uint64 {
	t.Helper()
	ids, err := in.CgroupIDs()
	if err != nil {
		t.Fatal(err)
	}
	return ids
}

// residentKiB is a process's resident set (VmRSS).
func residentKiB(t testing.TB, pid int) int {
	t.Helper()
	b, err := os.ReadFile(fmt.Sprintf("/proc/%d/status", pid))
	if err != nil {
		t.Fatal(err)
	}
	for _, l := range strings.Split(string(b), "\n") {
		if v, ok := strings.CutPrefix(l, "VmRSS:"); ok {
			n, err := strconv.Atoi(strings.TrimSuffix(strings.TrimSpace(v), " kB"))
			if err != nil {
				t.Fatal(err)
			}
			return n
		}
	}
	t.Fatalf("no VmRSS for pid %d", pid)
	return 0
}
