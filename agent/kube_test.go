package agent_test

import (
	"context"
	"errors"
	"fmt"
	"os"
	"path/filepath"
	"strings"
	"testing"
	"time"

	corev1 "k8s.io/api/core/v1"
	metav1 "k8s.io/apimachinery/pkg/apis/meta/v1"
	"k8s.io/apimachinery/pkg/types"
	"k8s.io/client-go/kubernetes/fake"

	"github.com/shunt-project/shunt/agent"
	"github.com/shunt-project/shunt/bypass/bypasstest"
	"github.com/shunt-project/shunt/host"
	"github.com/shunt-project/shunt/internal/testenv"
	"github.com/shunt-project/shunt/kube"
)

func kubePod(name, uid string, qos corev1.PodQOSClass, app string) *corev1.Pod {
	return &corev1.Pod{
		ObjectMeta: metav1.ObjectMeta{Namespace: "shop", Name: name, UID: types.UID(uid), Labels: map[string]string{"app": app}},
		Spec:       corev1.PodSpec{NodeName: "node-a"},
		Status:     corev1.PodStatus{Phase: corev1.PodRunning, QOSClass: qos},
	}
}

// mkPodCgroup lays a pod's cgroup out as kubelet does (the QoS level, the
// pod, one container scope in it) under root, and returns the pod's and
// the container's directories.
func mkPodCgroup(t *testing.T, root string, d kube.Driver, p *corev1.Pod) (pod, container string) {
	t.Helper()
	pod = kube.PodCgroup(root, d, p.Status.QOSClass, p.UID)
	var made []string
	for dir := pod; dir != root; dir = filepath.Dir(dir) {
		made = append([]string{dir}, made...)
	}
	container = filepath.Join(pod, "cri-containerd-"+string(p.UID)[:8]+".scope")
	for _, dir := range append(made, container) {
		if err := os.Mkdir(dir, 0o755); err != nil && !os.IsExist(err) {
			t.Fatal(err)
		}
	}
	t.Cleanup(func() {
		for i := len(made); i >= 0; i-- {
			d := container
			if i < len(made) {
				d = made[i]
			}
			os.Remove(d)
		}
	})
	return pod, container
}

// Pods selected through the API server (client-go's fake clientset) have
// their cgroups enabled, under either cgroup driver, as kubelet lays them
// out on the real kernel; a pod that comes later is enabled once kubelet
// makes its cgroup, one that goes is disabled; a connection inside a
// selected pod's container is bypassed.
func TestAgentBypassesSelectedPods(t *testing.T) {
	testenv.RequireRoot(t)
	for _, d := range []kube.Driver{kube.Systemd, kube.Cgroupfs} {
		t.Run(string(d), func(t *testing.T) {
			pin := bypasstest.MustPinDir(t)
			root := testenv.MustCgroup(t).Path
			web := kubePod("web-1", "11111111-aaaa-4bbb-8ccc-000000000001", corev1.PodQOSBurstable, "web")
			db := kubePod("db-1", "22222222-aaaa-4bbb-8ccc-000000000002", corev1.PodQOSGuaranteed, "db")
			webPod, webContainer := mkPodCgroup(t, root, d, web)
			mkPodCgroup(t, root, d, db)
			client := fake.NewClientset(web, db)

			config := filepath.Join(t.TempDir(), "config.yaml")
			writeConfig(t, config, fmt.Sprintf("kubernetes:\n  node_name: node-a\n  labels: {app: web}\n  cgroup_root: %q\nbypass:\n  guard: false\n", root))
			runAgentWith(t, agent.Options{ConfigPath: config, PinDir: pin, Features: host.Probe(), KubePods: client.CoreV1().Pods("")})
			waitEnabled(t, pin, webPod)

			// Traffic in the web pod's container is bypassed.
			side := testenv.Side{NS: testenv.MustNetNS(t), CG: host.Cgroup{Path: webContainer, ID: cgroupID(t, webContainer)}}
			c, s := testenv.ConnPair(t, "tcp4", side, "127.0.0.1:0", side, "127.0.0.1:0")
			testenv.Warm(t, c, s)
			if n := paired(t, pin); n < 1 {
				t.Errorf("%d connections paired in the selected pod", n)
			}
			c.Close()
			s.Close()

			// A new web pod: the API server knows it before kubelet makes
			// its cgroup.
			web2 := kubePod("web-2", "33333333-aaaa-4bbb-8ccc-000000000003", corev1.PodQOSBestEffort, "web")
			if _, err := client.CoreV1().Pods("shop").Create(context.Background(), web2, metav1.CreateOptions{}); err != nil {
				t.Fatal(err)
			}
			time.Sleep(100 * time.Millisecond)
			web2Pod, _ := mkPodCgroup(t, root, d, web2)
			waitEnabled(t, pin, webPod, web2Pod)

			// The first web pod goes.
			if err := client.CoreV1().Pods("shop").Delete(context.Background(), "web-1", metav1.DeleteOptions{}); err != nil {
				t.Fatal(err)
			}
			waitEnabled(t, pin, web2Pod)
		})
	}
}

// An agent that stops takes shunt off the node when its DaemonSet is gone
// (helm uninstall), and leaves it for the next agent when the DaemonSet is
// still there (a rollout) or the API server cannot tell.
func TestAgentLeavesWhenItsDaemonSetIsGone(t *testing.T) {
	testenv.RequireRoot(t)
	for _, tc := range []struct {
		name    string
		gone    bool
		err     error
		removed bool
		says    string
	}{
		{"uninstalled", true, nil, true, "is gone (uninstalled): shunt removed from this node"},
		{"rollout", false, nil, false, "is still there (a rollout)"},
		{"API server unreachable", false, errors.New("connection refused"), false, "could not tell whether DaemonSet shunt-system/shunt-agent is gone"},
	} {
		t.Run(tc.name, func(t *testing.T) {
			pin := bypasstest.MustPinDir(t)
			root := testenv.MustCgroup(t).Path
			web := kubePod("web-1", "11111111-aaaa-4bbb-8ccc-000000000001", corev1.PodQOSBurstable, "web")
			webPod, _ := mkPodCgroup(t, root, kube.Cgroupfs, web)
			config := filepath.Join(t.TempDir(), "config.yaml")
			writeConfig(t, config, fmt.Sprintf("kubernetes:\n  node_name: node-a\n  cgroup_root: %q\n  daemonset: shunt-system/shunt-agent\nbypass:\n  guard: false\n", root))
			asked := 0
			log := &testenv.SyncBuffer{}
			a, err := agent.New(agent.Options{ConfigPath: config, PinDir: pin, Features: host.Probe(), Log: log,
				KubePods:  fake.NewClientset(web).CoreV1().Pods(""),
				OwnerGone: func(context.Context) (bool, error) { asked++; return tc.gone, tc.err },
			})
			if err != nil {
				t.Fatal(err)
			}
			ctx, cancel := context.WithCancel(context.Background())
			done := make(chan error, 1)
			go func() { done <- a.Run(ctx) }()
			waitEnabled(t, pin, webPod)
			cancel()
			if err := <-done; err != nil {
				t.Fatal(err)
			}
			t.Logf("agent log:\n%s", log)
			_, statErr := os.Stat(pin)
			if removed := os.IsNotExist(statErr); removed != tc.removed || asked != 1 {
				t.Errorf("pins removed: %v (asked %d times), want %v", removed, asked, tc.removed)
			}
			if !tc.removed && !isEnabled(t, pin, webPod) {
				t.Error("the pod's cgroup was disabled")
			}
			if !strings.Contains(log.String(), tc.says) {
				t.Errorf("the agent did not say %q", tc.says)
			}
		})
	}
}
