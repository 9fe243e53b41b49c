//go:build k8snode

package k8snode_test

import (
	"fmt"
	"net"
	"os"
	"slices"
	"strconv"
	"strings"
	"testing"
	"time"

	"github.com/shunt-project/shunt/bypass"
	"github.com/shunt-project/shunt/host"
	"github.com/shunt-project/shunt/kube"
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
					if in = openInstall(b, pin); in != nil {
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
		reportAgent(b, lat, after, total, residentKiB(b, agent.Pid), scrapeTimes(b, c, "http://127.0.0.1:9464/metrics"))
	}
}

// BenchmarkAgentKubelet is BenchmarkAgent on TestKubelet's node: kubelet
// runs each pod (sandbox, cgroup, network, container) and the agent runs
// as its DaemonSet's pod. Each of the first 50 pods is timed from its API
// call, and from the moment its cgroup appeared (looked for every 2 ms),
// to enabled; then 150 more run:
//
//	go test -tags k8snode -run '^$' -bench BenchmarkAgentKubelet -benchtime 1x ./k8snode
func BenchmarkAgentKubelet(b *testing.B) {
	const timed, total = 50, 200
	for range b.N {
		c, k, pin, agent := startKubeletNode(b, kube.Cgroupfs)
		var in *bypass.Install // once the first pod's enable has installed bypass
		var lat, after []time.Duration
		for i := range total {
			start := time.Now()
			created := c.createContainerPod(b, fmt.Sprintf("bench-%d", i), map[string]string{"app": "bench"}, true, idlePod)
			if i >= timed {
				continue
			}
			path := kube.PodCgroup(k.root.Path, k.driver, created.Status.QOSClass, created.UID)
			var made time.Time
			for {
				if made.IsZero() {
					if _, err := os.Stat(path); err == nil {
						made = time.Now()
					}
				}
				if !made.IsZero() && in == nil {
					in = openInstall(b, pin)
				}
				if in != nil && !made.IsZero() {
					if cg, err := host.ResolveCgroup(path); err == nil && slices.Contains(cgroupIDs(b, in), cg.ID) {
						break
					}
				}
				if time.Since(start) > 60*time.Second {
					b.Fatalf("pod %d not enabled 60 s after its creation", i)
				}
				time.Sleep(2 * time.Millisecond)
			}
			lat = append(lat, time.Since(start))
			after = append(after, time.Since(made))
		}
		// The agent's pod is one of the node's, not enabled.
		for deadline := time.Now().Add(180 * time.Second); len(cgroupIDs(b, in)) < total; time.Sleep(100 * time.Millisecond) {
			if time.Now().After(deadline) {
				b.Fatalf("%d of %d pods enabled after 180 s", len(cgroupIDs(b, in)), total)
			}
		}
		agentCg := kube.PodCgroup(k.root.Path, k.driver, agent.Status.QOSClass, agent.UID)
		reportAgent(b, lat, after, total, residentKiB(b, pidIn(b, agentCg, "shunt")),
			scrapeTimes(b, c, "http://"+net.JoinHostPort(agent.Status.PodIP, "9464")+"/metrics"))
	}
}

// openInstall opens the install at pin if there is one yet, closed when
// the benchmark ends.
func openInstall(b *testing.B, pin string) *bypass.Install {
	in, err := bypass.Open(pin)
	if err != nil {
		return nil
	}
	b.Cleanup(func() { in.Close() })
	return in
}

// scrapeTimes times 7 scrapes of url.
func scrapeTimes(b *testing.B, c *cluster, url string) []time.Duration {
	var scrapes []time.Duration
	for range 7 {
		start := time.Now()
		if _, err := c.scrape(url); err != nil {
			b.Fatal(err)
		}
		scrapes = append(scrapes, time.Since(start))
	}
	return scrapes
}

// reportAgent reports the enable latencies (from the API call, and from
// the moment the pod's cgroup existed), and the agent's memory and scrape
// time with total pods.
func reportAgent(b *testing.B, lat, after []time.Duration, total, rss int, scrapes []time.Duration) {
	timed := len(lat)
	slices.Sort(lat)
	slices.Sort(after)
	slices.Sort(scrapes)
	b.ReportMetric(float64(lat[len(lat)/2].Microseconds())/1e3, "enable-p50-ms")
	b.ReportMetric(float64(lat[len(lat)-1].Microseconds())/1e3, "enable-max-ms")
	b.ReportMetric(float64(rss)/1024, "agent-rss-MiB")
	b.ReportMetric(float64(scrapes[len(scrapes)/2].Microseconds())/1e3, "scrape-ms")
	b.Logf("%d pods created one by one through the API: enabled after %v median, %v max (min %v); after their cgroup's mkdir %v median, %v max; %d pods: agent resident %.1f MiB, a scrape %v (median of 7)",
		timed, lat[len(lat)/2], lat[len(lat)-1], lat[0], after[len(after)/2], after[len(after)-1], total, float64(rss)/1024, scrapes[len(scrapes)/2])
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
