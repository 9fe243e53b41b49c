//go:build k8snode

package k8snode_test

import (
	"bytes"
	"context"
	"crypto/sha256"
	"fmt"
	"math/rand/v2"
	"net"
	"os"
	"path/filepath"
	"slices"
	"strconv"
	"strings"
	"testing"
	"time"

	corev1 "k8s.io/api/core/v1"
	apierrors "k8s.io/apimachinery/pkg/api/errors"
	metav1 "k8s.io/apimachinery/pkg/apis/meta/v1"
	"k8s.io/apimachinery/pkg/types"

	"github.com/shunt-project/shunt/bypass/bypasstest"
	"github.com/shunt-project/shunt/host"
	"github.com/shunt-project/shunt/internal/testenv"
	"github.com/shunt-project/shunt/kube"
)

// v1Hierarchies are the cgroup v1 hierarchies of a hybrid host (this VM's
// layout, docs/KUBERNETES.md): kubelet's cgroupfs driver makes its
// cgroups in each, and in the v2 tree, which is where shunt attaches.
func v1Hierarchies() []string {
	return mountPoints(func(_, fstype string) bool { return fstype == "cgroup" })
}

// realKubelet is kubelet itself, running the node's pods in containerd.
type realKubelet struct {
	root   host.Cgroup // its cgroup root in the v2 tree (--cgroup-root, or systemd's root)
	driver kube.Driver
}

// nodeCgroupRoot makes the node's cgroup root: a cgroup of the test's in
// the v2 tree and one of the same name in every v1 hierarchy, where
// kubelet (or the node's systemd) makes the pods' cgroups; they go when
// the test ends, what was made below them first.
func nodeCgroupRoot(t testing.TB) host.Cgroup {
	t.Helper()
	root := testenv.MustCgroup(t)
	name := filepath.Base(root.Path)
	// kubelet checks its root in every hierarchy; cpuset's children take
	// their parent's CPUs and memory nodes only if the parent has them.
	var roots []string
	t.Cleanup(func() {
		// Deepest first, the v2 root itself last (testenv removes it).
		for _, r := range append(roots, root.Path) {
			removeCgroupTree(t, r, r != root.Path)
		}
	})
	for _, h := range v1Hierarchies() {
		p := filepath.Join(h, name)
		must(t, os.Mkdir(p, 0o755))
		roots = append(roots, p)
		if strings.HasSuffix(h, "/cpuset") {
			for _, f := range []string{"cpuset.cpus", "cpuset.mems"} {
				b, err := os.ReadFile(filepath.Join(h, f))
				must(t, err)
				must(t, os.WriteFile(filepath.Join(p, f), b, 0o644))
			}
		}
	}
	return root
}

// startKubelet runs kubelet in the node's namespaces with driver, its
// cgroup root root (the cgroupfs driver's --cgroup-root; with systemd,
// the root of the node's systemd), every directory it writes the test's
// own, and waits until it has registered the node Ready. When the test
// ends the pods go first (through the API, as kubelet stops them), then
// kubelet, then what it ran.
func startKubelet(t testing.TB, c *cluster, rt *containerd, root host.Cgroup, driver kube.Driver) *realKubelet {
	t.Helper()
	// Once kubelet has stopped (it would start them again), and before
	// their cgroups go.
	t.Cleanup(func() { rt.stopContainers(t) })

	// systemd's slices are under its own root already.
	cgroupRoot := "/"
	if driver == kube.Cgroupfs {
		cgroupRoot += filepath.Base(root.Path)
	}
	dir := t.TempDir()
	cfg := filepath.Join(dir, "kubelet.yaml")
	// Thresholds out of the way: a test machine's disk and memory are
	// not the test's to judge.
	must(t, os.WriteFile(cfg, []byte(fmt.Sprintf(`apiVersion: kubelet.config.k8s.io/v1beta1
kind: KubeletConfiguration
cgroupDriver: %s
cgroupRoot: %s
failCgroupV1: false
failSwapOn: false
containerRuntimeEndpoint: unix://%s
authentication: {anonymous: {enabled: true}, webhook: {enabled: false}}
authorization: {mode: AlwaysAllow}
readOnlyPort: 0
healthzBindAddress: 127.0.0.1
podLogsDir: %s
resolvConf: /etc/resolv.conf
evictionHard: {memory.available: 1Mi, nodefs.available: 1%%, nodefs.inodesFree: 1%%, imagefs.available: 1%%}
imageGCHighThresholdPercent: 100
imageGCLowThresholdPercent: 99
localStorageCapacityIsolation: false
maxPods: 250 # BenchmarkAgentKubelet runs 200 and the test's own
clusterDNS: [%s]
clusterDomain: cluster.local
`, driver, cgroupRoot, rt.sock, filepath.Join(dir, "logs"), nodeIP)), 0o644))
	// The cluster DNS, on the node's address: CoreDNS answering for
	// Services and pods from the API.
	corefile := filepath.Join(dir, "Corefile")
	must(t, os.WriteFile(corefile, []byte(fmt.Sprintf(`cluster.local:53 {
	errors
	kubernetes cluster.local {
		kubeconfig %s c
	}
}
`, c.kubeconfig(t, "coredns.kubeconfig", adminToken))), 0o644))
	c.start(t, "coredns", bin("coredns"), "-conf", corefile)
	c.start(t, "kubelet", bin("kubelet"), "--config", cfg,
		"--kubeconfig", c.kubeconfig(t, "kubelet.kubeconfig", adminToken),
		"--root-dir", filepath.Join(dir, "root"), "--cert-dir", filepath.Join(dir, "pki"),
		"--hostname-override", nodeName, "--node-ip", nodeIP)
	t.Cleanup(func() { c.deletePods(t) })

	start := time.Now()
	defer func() { t.Logf("kubelet registered the node Ready in %v", time.Since(start).Round(time.Millisecond)) }()
	eventually(t, 120*time.Second, "kubelet registers the node Ready", func() error {
		n, err := c.client.CoreV1().Nodes().Get(context.Background(), nodeName, metav1.GetOptions{})
		if err != nil {
			return err
		}
		for _, cond := range n.Status.Conditions {
			if cond.Type == corev1.NodeReady {
				if cond.Status != corev1.ConditionTrue {
					return fmt.Errorf("not ready: %s", cond.Message)
				}
				return nil
			}
		}
		return fmt.Errorf("no Ready condition yet")
	})
	return &realKubelet{root: root, driver: driver}
}

// deletePods deletes every pod (and the DaemonSets) through the API and
// waits until kubelet has stopped them and confirmed it.
func (c *cluster) deletePods(t testing.TB) {
	ctx := context.Background()
	start := time.Now()
	defer func() { t.Logf("pods deleted in %v", time.Since(start).Round(time.Millisecond)) }()
	// The DaemonSet would make its pod again.
	c.client.AppsV1().DaemonSets(releaseNS).DeleteCollection(ctx, metav1.DeleteOptions{}, metav1.ListOptions{})
	for _, ns := range []string{podNamespace, releaseNS} {
		c.client.CoreV1().Pods(ns).DeleteCollection(ctx, metav1.DeleteOptions{GracePeriodSeconds: new(int64(1))}, metav1.ListOptions{})
	}
	deadline := time.Now().Add(180 * time.Second) // BenchmarkAgentKubelet's 200 pods
	for time.Now().Before(deadline) {
		left := 0
		for _, ns := range []string{podNamespace, releaseNS} {
			l, err := c.client.CoreV1().Pods(ns).List(ctx, metav1.ListOptions{})
			if err == nil {
				left += len(l.Items)
			}
		}
		if left == 0 {
			return
		}
		time.Sleep(250 * time.Millisecond)
	}
	t.Errorf("pods still there 180 s after their deletion")
}

// removeCgroupTree removes the cgroups below top, deepest first, and top
// too if self.
func removeCgroupTree(t testing.TB, top string, self bool) {
	var dirs []string
	filepath.WalkDir(top, func(p string, d os.DirEntry, err error) error {
		if err == nil && d.IsDir() && (self || p != top) {
			dirs = append(dirs, p)
		}
		return nil
	})
	for i := len(dirs) - 1; i >= 0; i-- {
		var err error
		for range 50 {
			if err = os.Remove(dirs[i]); err == nil || os.IsNotExist(err) {
				break
			}
			time.Sleep(20 * time.Millisecond)
		}
		if err != nil && !os.IsNotExist(err) {
			t.Errorf("remove cgroup %s: %v", dirs[i], err)
		}
	}
}

// runContainerPod creates a pod through the API for kubelet to run, with
// spec's containers, and waits until it runs; the pod's cgroup is found
// where kube.PodCgroup says and its network namespace through a process
// in it.
func (k *realKubelet) runContainerPod(t testing.TB, c *cluster, name string, labels map[string]string, annotated bool, spec corev1.PodSpec) *pod {
	t.Helper()
	c.createContainerPod(t, name, labels, annotated, spec)
	start := time.Now()
	running := c.waitRunning(t, podNamespace, name)
	t.Logf("pod %s running in %v", name, time.Since(start).Round(time.Millisecond))
	p := &pod{name: name, ip: running.Status.PodIP,
		cg: mustResolve(t, kube.PodCgroup(k.root.Path, k.driver, running.Status.QOSClass, running.UID))}
	pid := pidIn(t, p.cg.Path, "")
	p.enter = []string{"nsenter", fmt.Sprintf("--net=/proc/%d/ns/net", pid), "--"}
	return p
}

// createContainerPod creates a pod of spec's containers on this node
// through the API, for kubelet to run.
func (c *cluster) createContainerPod(t testing.TB, name string, labels map[string]string, annotated bool, spec corev1.PodSpec) *corev1.Pod {
	t.Helper()
	spec.NodeName = nodeName
	spec.AutomountServiceAccountToken = new(bool)
	spec.TerminationGracePeriodSeconds = new(int64(1))
	obj := &corev1.Pod{ObjectMeta: metav1.ObjectMeta{Name: name, Namespace: podNamespace, Labels: labels}, Spec: spec}
	if annotated {
		obj.Annotations = map[string]string{"shunt.dev/bypass": "true"}
	}
	var created *corev1.Pod
	eventually(t, 30*time.Second, "create pod "+name, func() error {
		var err error
		created, err = c.client.CoreV1().Pods(podNamespace).Create(context.Background(), obj, metav1.CreateOptions{})
		return err
	})
	return created
}

// idlePod is a pod of one container that does nothing.
var idlePod = corev1.PodSpec{Containers: []corev1.Container{{Name: "idle", Image: pauseImage, ImagePullPolicy: corev1.PullNever}}}

// waitRunning waits until the pod's containers all run and returns it.
func (c *cluster) waitRunning(t testing.TB, ns, name string) *corev1.Pod {
	t.Helper()
	var p *corev1.Pod
	eventually(t, 120*time.Second, "pod "+ns+"/"+name+" running", func() error {
		var err error
		if p, err = c.client.CoreV1().Pods(ns).Get(context.Background(), name, metav1.GetOptions{}); err != nil {
			return err
		}
		if p.Status.Phase != corev1.PodRunning || p.Status.PodIP == "" {
			return fmt.Errorf("%s: %+v", p.Status.Phase, p.Status.ContainerStatuses)
		}
		for _, cs := range p.Status.ContainerStatuses {
			if cs.State.Running == nil {
				return fmt.Errorf("container %s: %+v", cs.Name, cs.State)
			}
		}
		return nil
	})
	return p
}

// agentPod waits for the DaemonSet's one pod, other than not, to run.
func (c *cluster) agentPod(t testing.TB, not string) *corev1.Pod {
	t.Helper()
	var name string
	eventually(t, 120*time.Second, "the agent's pod", func() error {
		l, err := c.client.CoreV1().Pods(releaseNS).List(context.Background(), metav1.ListOptions{LabelSelector: "app.kubernetes.io/name=" + agentName})
		if err != nil {
			return err
		}
		for _, p := range l.Items {
			if p.Name != not && p.DeletionTimestamp == nil {
				name = p.Name
				return nil
			}
		}
		return fmt.Errorf("%d pods, none new", len(l.Items))
	})
	return c.waitRunning(t, releaseNS, name)
}

// waitGone waits until the pod is gone from the API (kubelet has stopped
// it).
func (c *cluster) waitGone(t testing.TB, ns, name string) {
	t.Helper()
	eventually(t, 90*time.Second, "pod "+ns+"/"+name+" gone", func() error {
		_, err := c.client.CoreV1().Pods(ns).Get(context.Background(), name, metav1.GetOptions{})
		if apierrors.IsNotFound(err) {
			return nil
		}
		if err == nil {
			err = fmt.Errorf("still there")
		}
		return err
	})
}

func mustResolve(t testing.TB, path string) host.Cgroup {
	t.Helper()
	cg, err := host.ResolveCgroup(path)
	if err != nil {
		t.Fatalf("pod cgroup: %v", err)
	}
	return cg
}

// pidIn is a process in the cgroup tree at path called comm, or any if
// comm is empty (for a pod: its sandbox or a container; they share the
// network namespace).
func pidIn(t testing.TB, path, comm string) int {
	t.Helper()
	pid := 0
	filepath.WalkDir(path, func(p string, d os.DirEntry, err error) error {
		if err != nil || d.IsDir() || d.Name() != "cgroup.procs" {
			return nil
		}
		procs, _ := os.ReadFile(p)
		for _, f := range strings.Fields(string(procs)) {
			name, _ := os.ReadFile("/proc/" + f + "/comm")
			if comm == "" || strings.TrimSpace(string(name)) == comm {
				pid, _ = strconv.Atoi(f)
				return filepath.SkipAll
			}
		}
		return nil
	})
	if pid == 0 {
		t.Fatalf("no process %q in %s", comm, path)
	}
	return pid
}

// startKubeletNode brings up the control plane with kube-scheduler,
// kube-proxy (nftables), containerd and kubelet with driver (and systemd
// as the node's init for the systemd driver), installs the chart as
// written with the image built here, and waits for the agent's pod.
func startKubeletNode(t testing.TB, driver kube.Driver) (c *cluster, k *realKubelet, pin string, agent *corev1.Pod) {
	t.Helper()
	// Its cleanup runs after kubelet's has stopped the agent.
	pin = bypasstest.MustPinDir(t)
	c = startCluster(t, testenv.MustNetNS(t), "daemonset", "garbagecollector", "root-ca-cert-publisher")
	c.start(t, "kube-scheduler", bin("kube-scheduler"), "--kubeconfig", c.kubeconfig(t, "scheduler.kubeconfig", adminToken),
		"--leader-elect=false", "--bind-address", "127.0.0.1", "--secure-port", "10259")
	root := nodeCgroupRoot(t)
	if driver == kube.Systemd {
		startSystemd(t, c, root)
	}
	rt := startContainerd(t, c, driver)
	k = startKubelet(t, c, rt, root, driver)
	c.startProxy(t, "nftables")

	// The agent's pod sees the cgroup trees as kubelet does: with
	// systemd, the root's hierarchy from the node's cgroup namespace.
	agentRoot := k.root.Path
	if driver == kube.Systemd {
		agentRoot = filepath.Dir(agentRoot)
	}
	c.helmInstall(t, map[string]any{
		"image":   map[string]any{"repository": agentRepo, "tag": agentTag, "pullPolicy": "Never"},
		"kubelet": map[string]any{"cgroupRoot": agentRoot, "driver": string(driver)},
		"pinDir":  pin,
	})
	start := time.Now()
	agent = c.agentPod(t, "")
	t.Logf("the agent's pod %s running %v after helm install", agent.Name, time.Since(start).Round(time.Millisecond))
	c.createNamespace(t, podNamespace)
	return c, k, pin, agent
}

// TestKubelet runs the node with kubelet and containerd, under each
// cgroup driver: the chart installed as written, the agent running as its
// DaemonSet's pod from an image built here, the workloads as containers;
// then a rollout of the agent and `helm uninstall`, as an operator would.
func TestKubelet(t *testing.T) {
	testenv.RequireRoot(t)
	requireBuilt(t)
	for _, driver := range []kube.Driver{kube.Cgroupfs, kube.Systemd} {
		t.Run(string(driver), func(t *testing.T) { testKubelet(t, driver) })
	}
}

func testKubelet(t *testing.T, driver kube.Driver) {
	c, k, pin, agent := startKubeletNode(t, driver)
	c.createNamespace(t, podNamespace)

	body := make([]byte, 4<<20)
	rand.NewChaCha8([32]byte{'k'}).Read(body)
	www := t.TempDir()
	must(t, os.WriteFile(filepath.Join(www, "blob"), body, 0o644))
	must(t, os.WriteFile(filepath.Join(www, "ready"), nil, 0o644))
	web := k.runContainerPod(t, c, "web", map[string]string{"app": "web"}, true, corev1.PodSpec{
		Containers: []corev1.Container{{Name: "web", Image: webImage, ImagePullPolicy: corev1.PullNever,
			Args: []string{"-dir", "/www", "-addr", ":8080"}, VolumeMounts: []corev1.VolumeMount{{Name: "www", MountPath: "/www"}}}},
		Volumes: []corev1.Volume{{Name: "www", VolumeSource: corev1.VolumeSource{HostPath: &corev1.HostPathVolumeSource{Path: www}}}},
	})
	// The client runs web too, for `web get`: a Go program that resolves
	// names with the pod's /etc/resolv.conf.
	client := k.runContainerPod(t, c, "client", map[string]string{"app": "client"}, true, corev1.PodSpec{
		Containers: []corev1.Container{{Name: "web", Image: webImage, ImagePullPolicy: corev1.PullNever, Args: []string{"-dir", "/none"}}},
	})
	other := k.runContainerPod(t, c, "other", map[string]string{"app": "other"}, false, idlePod)
	t.Logf("the %s driver's pod cgroups, as the agent finds them: %s", driver, strings.TrimPrefix(web.cg.Path, k.root.Path))
	svc := c.service(t, "web", 80, 8080)
	t.Cleanup(func() {
		if t.Failed() {
			c.logState(t)
		}
	})

	in := waitEnabled(t, pin, web.cg.Path, client.cg.Path)
	if slices.Contains(enabledPaths(t, in), other.cg.Path) {
		t.Fatalf("the agent enabled %s, a pod without the annotation", other.name)
	}
	eventually(t, 60*time.Second, "the Service", func() error {
		_, err := other.run(t, "curl", "-sSf", "-o", "/dev/null", "--max-time", "2", "http://"+svc+"/ready")
		return err
	})
	checkTraffic(t, in, web, client, other, svc, body)

	// A headless Service by its name, as a pod in its namespace asks for
	// it: the cluster DNS answers with web's address, no translation.
	t.Run("pod to headless Service by name", func(t *testing.T) {
		if _, err := c.client.CoreV1().Services(podNamespace).Create(context.Background(), &corev1.Service{
			ObjectMeta: metav1.ObjectMeta{Name: "web-headless", Namespace: podNamespace},
			Spec: corev1.ServiceSpec{ClusterIP: corev1.ClusterIPNone, Selector: map[string]string{"app": "web"},
				Ports: []corev1.ServicePort{{Port: 8080, Protocol: corev1.ProtocolTCP}}},
		}, metav1.CreateOptions{}); err != nil {
			t.Fatal(err)
		}
		// Its own file system (the web image, kubelet's resolv.conf), its
		// network namespace and its cgroup.
		pid := strconv.Itoa(pidIn(t, client.cg.Path, "web"))
		inContainer := &pod{name: client.name, cg: client.cg, enter: []string{"nsenter", "--target", pid, "--net", "--mount", "--"}}
		resolv, err := os.ReadFile("/proc/" + pid + "/root/etc/resolv.conf")
		if err != nil || !strings.Contains(string(resolv), "nameserver "+nodeIP) || !strings.Contains(string(resolv), podNamespace+".svc.cluster.local") {
			t.Fatalf("the client's resolv.conf does not name the cluster DNS and the namespace's domain (%v):\n%s", err, resolv)
		}
		get := func() error {
			out, err := inContainer.run(t, "/web", "get", "http://web-headless:8080/blob")
			if err == nil && !bytes.Equal([]byte(out), body) {
				err = fmt.Errorf("%d bytes, sha256 %x, want %d bytes, %x", len(out), sha256.Sum256([]byte(out)), len(body), sha256.Sum256(body))
			}
			return err
		}
		// The name resolves once CoreDNS has seen the Service's endpoints.
		eventually(t, 30*time.Second, "web-headless by name", get)
		const n = 5
		before := counters(t, in)
		for i := range n {
			if err := get(); err != nil {
				t.Fatalf("download %d: %v", i, err)
			}
		}
		after := counters(t, in)
		paired, translated := after.Paired-before.Paired, after.Translated-before.Translated
		t.Logf("%d downloads of %d bytes intact; %d connections paired, %d through translation", n, len(body), paired, translated)
		if paired != n || translated != 0 {
			t.Errorf("%d connections paired, %d through translation; want %d and 0", paired, translated, n)
		}
	})

	// kubectl rollout restart: the DaemonSet replaces the agent's pod
	// while a download is under way.
	t.Run("agent rollout", func(t *testing.T) {
		before := counters(t, in)
		done := make(chan error, 1)
		go func() { done <- download(t, client, "http://"+svc+"/blob", body, "--limit-rate", "1M") }()
		time.Sleep(500 * time.Millisecond)
		patch := fmt.Sprintf(`{"spec":{"template":{"metadata":{"annotations":{"kubectl.kubernetes.io/restartedAt":%q}}}}}`, time.Now().Format(time.RFC3339))
		if _, err := c.client.AppsV1().DaemonSets(releaseNS).Patch(context.Background(), agentName, types.StrategicMergePatchType, []byte(patch), metav1.PatchOptions{}); err != nil {
			t.Fatal(err)
		}
		c.waitGone(t, releaseNS, agent.Name)
		if got := enabledPaths(t, in); !slices.Contains(got, client.cg.Path) {
			t.Errorf("with the old agent gone, enabled: %v", got)
		}
		agent = c.agentPod(t, agent.Name)
		if err := <-done; err != nil {
			t.Fatalf("the download across the rollout: %v", err)
		}
		if err := download(t, client, "http://"+svc+"/blob", body); err != nil {
			t.Fatalf("after the rollout: %v", err)
		}
		if paired := counters(t, in).Paired - before.Paired; paired != 2 {
			t.Errorf("%d connections paired across and after the rollout, want 2", paired)
		}
	})

	// Prometheus finds each agent through the chart's headless Service.
	t.Run("metrics through the Service", func(t *testing.T) {
		eventually(t, 60*time.Second, "the agent's metrics", func() error {
			addr, err := c.endpoint(agentName+"-metrics", agent.Name)
			if err != nil {
				return err
			}
			return c.checkMetrics("http://"+net.JoinHostPort(addr, "9464")+"/metrics", 2)
		})
	})

	// helm uninstall: the garbage collector deletes the DaemonSet's pod,
	// kubelet stops it, and the agent, finding its DaemonSet gone, takes
	// shunt off the node.
	t.Run("helm uninstall", func(t *testing.T) {
		c.helmUninstall(t)
		c.waitGone(t, releaseNS, agent.Name)
		checkRemoved(t, pin, web, client)
	})
}

// endpoint is the address of pod among the endpoints of the Service.
func (c *cluster) endpoint(service, pod string) (string, error) {
	l, err := c.client.DiscoveryV1().EndpointSlices(releaseNS).List(context.Background(), metav1.ListOptions{LabelSelector: "kubernetes.io/service-name=" + service})
	if err != nil {
		return "", err
	}
	for _, s := range l.Items {
		for _, e := range s.Endpoints {
			if e.TargetRef != nil && e.TargetRef.Name == pod && len(e.Addresses) > 0 {
				return e.Addresses[0], nil
			}
		}
	}
	return "", fmt.Errorf("service %s has no endpoint for pod %s", service, pod)
}
