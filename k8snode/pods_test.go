//go:build k8snode

package k8snode_test

import (
	"context"
	"fmt"
	"os"
	"os/exec"
	"slices"
	"strings"
	"syscall"
	"testing"
	"time"

	corev1 "k8s.io/api/core/v1"
	apierrors "k8s.io/apimachinery/pkg/api/errors"
	metav1 "k8s.io/apimachinery/pkg/apis/meta/v1"
	"k8s.io/apimachinery/pkg/util/intstr"

	"github.com/shunt-project/shunt/host"
	"github.com/shunt-project/shunt/internal/testenv"
	"github.com/shunt-project/shunt/kube"
)

const podNamespace = "shop"

// pod is a pod created through the API and made as kubelet would make it
// with the cgroupfs driver and a point-to-point CNI: its cgroup under the
// QoS class's, its own network namespace with a veth to the node, routed
// by the node, and its status (address, Running, Ready) written back.
type pod struct {
	name  string
	ip    string
	enter []string // the command that runs another in its network namespace
	cg    host.Cgroup
}

// kubelet is what stands in for kubelet on this node: the cgroup tree it
// would make, and the links a CNI plugin would.
type kubelet struct {
	root host.Cgroup // kubelet's cgroup root (--cgroup-root)
	qos  host.Cgroup // kubepods/besteffort
	link int         // the next pod link's subnet, 10.link.0.0/24
}

func newKubelet(t testing.TB) *kubelet {
	t.Helper()
	root := testenv.MustCgroup(t)
	pods := testenv.MustChildCgroup(t, root, "kubepods")
	testenv.MustChildCgroup(t, pods, "burstable")
	return &kubelet{root: root, qos: testenv.MustChildCgroup(t, pods, "besteffort"), link: 201}
}

// createPod creates a pod of this node through the API, as a controller or
// a user would (kubelet is not told: it is not there).
func (c *cluster) createPod(t testing.TB, name string, labels map[string]string, annotated bool) *corev1.Pod {
	t.Helper()
	ctx := context.Background()
	obj := &corev1.Pod{
		ObjectMeta: metav1.ObjectMeta{Name: name, Namespace: podNamespace, Labels: labels},
		Spec: corev1.PodSpec{
			NodeName:                     nodeName,
			AutomountServiceAccountToken: new(bool),
			// Never pulled: no kubelet runs it; the test starts its
			// programs in the pod's namespace and cgroup.
			Containers: []corev1.Container{{Name: "main", Image: "shunt-test.invalid/none:0"}},
		},
	}
	if annotated {
		obj.Annotations = map[string]string{"shunt.dev/bypass": "true"}
	}
	var created *corev1.Pod
	// The namespace's default service account comes from the controller
	// manager a moment after the namespace.
	eventually(t, 30*time.Second, "create pod "+name, func() error {
		var err error
		created, err = c.client.CoreV1().Pods(podNamespace).Create(ctx, obj, metav1.CreateOptions{})
		return err
	})
	if created.Status.QOSClass != corev1.PodQOSBestEffort {
		t.Fatalf("pod %s: QoS class %q, want BestEffort (the API server sets it)", name, created.Status.QOSClass)
	}
	t.Cleanup(func() {
		c.client.CoreV1().Pods(podNamespace).Delete(context.Background(), name, metav1.DeleteOptions{GracePeriodSeconds: new(int64)})
	})
	return created
}

// podCgroup makes the pod's cgroup where kube.PodCgroup says kubelet puts
// it, removed when the test ends.
func (k *kubelet) podCgroup(t testing.TB, created *corev1.Pod) host.Cgroup {
	t.Helper()
	want := kube.PodCgroup(k.root.Path, kube.Cgroupfs, created.Status.QOSClass, created.UID)
	cg := testenv.MustChildCgroup(t, k.qos, "pod"+string(created.UID))
	if cg.Path != want {
		t.Fatalf("pod cgroup %s, kube.PodCgroup says %s", cg.Path, want)
	}
	return cg
}

// runPod creates the pod through the API on this node and makes it.
func (k *kubelet) runPod(t testing.TB, c *cluster, name string, labels map[string]string, annotated bool) *pod {
	t.Helper()
	created := c.createPod(t, name, labels, annotated)
	p := &pod{name: name, ip: fmt.Sprintf("10.%d.0.2", k.link), cg: k.podCgroup(t, created)}
	ns := testenv.MustNetNS(t)
	p.enter = []string{"ip", "netns", "exec", ns.Name}
	testenv.VethLink(t, c.node, fmt.Sprintf("p%d", k.link), ns, "eth0", k.link)
	ns.IP(t, "route", "add", "default", "via", fmt.Sprintf("10.%d.0.1", k.link))
	k.link++

	now := metav1.Now()
	created.Status.Phase = corev1.PodRunning
	created.Status.HostIP, created.Status.PodIP = nodeIP, p.ip
	created.Status.HostIPs = []corev1.HostIP{{IP: nodeIP}}
	created.Status.PodIPs = []corev1.PodIP{{IP: p.ip}}
	created.Status.StartTime = &now
	for _, ct := range []corev1.PodConditionType{corev1.PodScheduled, corev1.PodInitialized, corev1.ContainersReady, corev1.PodReady} {
		created.Status.Conditions = append(created.Status.Conditions, corev1.PodCondition{Type: ct, Status: corev1.ConditionTrue, LastTransitionTime: now})
	}
	created.Status.ContainerStatuses = []corev1.ContainerStatus{{
		Name: "main", Image: "shunt-test.invalid/none:0", Ready: true,
		State: corev1.ContainerState{Running: &corev1.ContainerStateRunning{StartedAt: now}},
	}}
	if _, err := c.client.CoreV1().Pods(podNamespace).UpdateStatus(context.Background(), created, metav1.UpdateOptions{}); err != nil {
		t.Fatalf("pod %s status: %v", name, err)
	}
	return p
}

// command makes argv run in the pod's namespace and cgroup; done releases
// the cgroup's descriptor once the command has started.
func (p *pod) command(t testing.TB, argv ...string) (cmd *exec.Cmd, done func()) {
	t.Helper()
	cg, err := os.Open(p.cg.Path)
	if err != nil {
		t.Fatal(err)
	}
	argv = append(slices.Clone(p.enter), argv...)
	cmd = exec.Command(argv[0], argv[1:]...)
	cmd.SysProcAttr = &syscall.SysProcAttr{UseCgroupFD: true, CgroupFD: int(cg.Fd())}
	return cmd, func() { cg.Close() }
}

// start runs a program in the pod until the test ends.
func (p *pod) start(t testing.TB, argv ...string) {
	t.Helper()
	cmd, done := p.command(t, argv...)
	defer done()
	testenv.Start(t, argv[0]+" in "+p.name, cmd)
}

// run runs a program in the pod to its end and returns what it printed.
func (p *pod) run(t testing.TB, argv ...string) (string, error) {
	t.Helper()
	cmd, done := p.command(t, argv...)
	var out strings.Builder
	cmd.Stdout, cmd.Stderr = &out, &out
	err := cmd.Start()
	done()
	if err == nil {
		err = cmd.Wait()
	}
	return out.String(), err
}

// service creates a ClusterIP Service in front of the pods labelled
// app=name and returns its address.
func (c *cluster) service(t testing.TB, name string, port, target int32) string {
	t.Helper()
	svc, err := c.client.CoreV1().Services(podNamespace).Create(context.Background(), &corev1.Service{
		ObjectMeta: metav1.ObjectMeta{Name: name, Namespace: podNamespace},
		Spec: corev1.ServiceSpec{
			Selector: map[string]string{"app": name},
			Ports:    []corev1.ServicePort{{Port: port, TargetPort: intstr.FromInt32(target), Protocol: corev1.ProtocolTCP}},
		},
	}, metav1.CreateOptions{})
	if err != nil {
		t.Fatalf("service %s: %v", name, err)
	}
	return svc.Spec.ClusterIP
}

// createNamespace creates the pods' namespace (idempotent).
func (c *cluster) createNamespace(t testing.TB, name string) {
	t.Helper()
	_, err := c.client.CoreV1().Namespaces().Create(context.Background(), &corev1.Namespace{ObjectMeta: metav1.ObjectMeta{Name: name}}, metav1.CreateOptions{})
	if err != nil && !apierrors.IsAlreadyExists(err) {
		t.Fatalf("namespace %s: %v", name, err)
	}
}

// registerNode creates the Node object kubelet would register, with the
// node's address (kube-proxy reads it).
func (c *cluster) registerNode(t testing.TB) {
	t.Helper()
	_, err := c.client.CoreV1().Nodes().Create(context.Background(), &corev1.Node{
		ObjectMeta: metav1.ObjectMeta{Name: nodeName, Labels: map[string]string{"kubernetes.io/hostname": nodeName}},
		Status: corev1.NodeStatus{
			Addresses: []corev1.NodeAddress{{Type: corev1.NodeInternalIP, Address: nodeIP}, {Type: corev1.NodeHostName, Address: nodeName}},
		},
	}, metav1.CreateOptions{})
	if err != nil {
		t.Fatalf("node: %v", err)
	}
}

// eventually retries fn until it succeeds or the time is up.
func eventually(t testing.TB, within time.Duration, what string, fn func() error) {
	t.Helper()
	deadline := time.Now().Add(within)
	for {
		err := fn()
		if err == nil {
			return
		}
		if time.Now().After(deadline) {
			t.Fatalf("%s: still failing after %v: %v", what, within, err)
		}
		time.Sleep(250 * time.Millisecond)
	}
}
