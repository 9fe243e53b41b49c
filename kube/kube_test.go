package kube_test

import (
	"context"
	"sync/atomic"
	"testing"
	"time"

	corev1 "k8s.io/api/core/v1"
	metav1 "k8s.io/apimachinery/pkg/apis/meta/v1"
	"k8s.io/apimachinery/pkg/types"
	"k8s.io/client-go/kubernetes/fake"

	"github.com/shunt-project/shunt/kube"
)

// The paths kubelet makes, as kubelet's own cgroup naming gives them.
func TestPodCgroup(t *testing.T) {
	uid := types.UID("0e6a6b2c-8a4e-4a1f-9c7e-3f1d2b3c4d5e")
	for _, tc := range []struct {
		d    kube.Driver
		qos  corev1.PodQOSClass
		want string
	}{
		{kube.Systemd, corev1.PodQOSGuaranteed, "/cg/kubepods.slice/kubepods-pod0e6a6b2c_8a4e_4a1f_9c7e_3f1d2b3c4d5e.slice"},
		{kube.Systemd, corev1.PodQOSBurstable, "/cg/kubepods.slice/kubepods-burstable.slice/kubepods-burstable-pod0e6a6b2c_8a4e_4a1f_9c7e_3f1d2b3c4d5e.slice"},
		{kube.Systemd, corev1.PodQOSBestEffort, "/cg/kubepods.slice/kubepods-besteffort.slice/kubepods-besteffort-pod0e6a6b2c_8a4e_4a1f_9c7e_3f1d2b3c4d5e.slice"},
		{kube.Cgroupfs, corev1.PodQOSGuaranteed, "/cg/kubepods/pod0e6a6b2c-8a4e-4a1f-9c7e-3f1d2b3c4d5e"},
		{kube.Cgroupfs, corev1.PodQOSBurstable, "/cg/kubepods/burstable/pod0e6a6b2c-8a4e-4a1f-9c7e-3f1d2b3c4d5e"},
		{kube.Cgroupfs, corev1.PodQOSBestEffort, "/cg/kubepods/besteffort/pod0e6a6b2c-8a4e-4a1f-9c7e-3f1d2b3c4d5e"},
	} {
		if got := kube.PodCgroup("/cg", tc.d, tc.qos, uid); got != tc.want {
			t.Errorf("%s %s: %s, want %s", tc.d, tc.qos, got, tc.want)
		}
	}
}

func TestSelector(t *testing.T) {
	pod := &corev1.Pod{ObjectMeta: metav1.ObjectMeta{Namespace: "shop", Labels: map[string]string{"app": "web", "tier": "front"},
		Annotations: map[string]string{"shunt.dev/bypass": "true"}}}
	for _, tc := range []struct {
		sel  kube.Selector
		want bool
	}{
		{kube.Selector{}, true},
		{kube.Selector{Namespaces: []string{"shop"}}, true},
		{kube.Selector{Namespaces: []string{"other"}}, false},
		{kube.Selector{Labels: map[string]string{"app": "web"}}, true},
		{kube.Selector{Labels: map[string]string{"app": "web", "tier": "back"}}, false},
		{kube.Selector{Annotation: "shunt.dev/bypass"}, true},
		{kube.Selector{Annotation: "shunt.dev/other"}, false},
		{kube.Selector{Namespaces: []string{"shop"}, Labels: map[string]string{"app": "db"}}, false},
	} {
		if got := tc.sel.Selects(pod); got != tc.want {
			t.Errorf("%+v selects: %v, want %v", tc.sel, got, tc.want)
		}
	}
}

func pod(ns, name, node, uid string, qos corev1.PodQOSClass, lbl map[string]string) *corev1.Pod {
	return &corev1.Pod{
		ObjectMeta: metav1.ObjectMeta{Namespace: ns, Name: name, UID: types.UID(uid), Labels: lbl},
		Spec:       corev1.PodSpec{NodeName: node},
		Status:     corev1.PodStatus{Phase: corev1.PodRunning, QOSClass: qos},
	}
}

// The watcher keeps this node's selected pods, as the API server adds,
// changes and deletes them (client-go's fake clientset).
func TestWatcherFollowsPods(t *testing.T) {
	web := map[string]string{"app": "web"}
	client := fake.NewClientset(
		pod("shop", "web-1", "node-a", "uid-1", corev1.PodQOSBurstable, web),
		pod("shop", "db-1", "node-a", "uid-2", corev1.PodQOSGuaranteed, map[string]string{"app": "db"}),
		pod("shop", "web-2", "node-b", "uid-3", corev1.PodQOSBurstable, web), // another node
	)
	var changes atomic.Int32
	w := kube.NewWatcher(client.CoreV1().Pods(""), "node-a", kube.Selector{Labels: web}, func() { changes.Add(1) })
	ctx := runWatcher(t, w)
	want := func(uids ...string) {
		t.Helper()
		deadline := time.Now().Add(10 * time.Second)
		for {
			pods, synced := w.Pods()
			var got []string
			for _, p := range pods {
				got = append(got, string(p.UID))
			}
			if synced && equal(got, uids) {
				return
			}
			if time.Now().After(deadline) {
				t.Fatalf("selected %v (synced %v), want %v", got, synced, uids)
			}
			time.Sleep(10 * time.Millisecond)
		}
	}
	want("uid-1")
	pods := client.CoreV1().Pods("shop")
	if _, err := pods.Create(ctx, pod("shop", "web-3", "node-a", "uid-4", corev1.PodQOSBestEffort, web), metav1.CreateOptions{}); err != nil {
		t.Fatal(err)
	}
	want("uid-1", "uid-4")
	done1 := pod("shop", "web-1", "node-a", "uid-1", corev1.PodQOSBurstable, web)
	done1.Status.Phase = corev1.PodSucceeded
	if _, err := pods.Update(ctx, done1, metav1.UpdateOptions{}); err != nil {
		t.Fatal(err)
	}
	want("uid-4")
	if err := pods.Delete(ctx, "web-3", metav1.DeleteOptions{}); err != nil {
		t.Fatal(err)
	}
	want()
	if changes.Load() < 4 {
		t.Errorf("%d change notices for 4 changes", changes.Load())
	}
}

func equal(a, b []string) bool {
	if len(a) != len(b) {
		return false
	}
	for i := range a {
		if a[i] != b[i] {
			return false
		}
	}
	return true
}

// runWatcher runs w until the test ends, failing it if Run fails; the
// context is the watch's.
func runWatcher(t *testing.T, w *kube.Watcher) context.Context {
	ctx, cancel := context.WithCancel(context.Background())
	done := make(chan error, 1)
	go func() { done <- w.Run(ctx) }()
	t.Cleanup(func() {
		cancel()
		if err := <-done; err != nil {
			t.Error(err)
		}
	})
	return ctx
}
