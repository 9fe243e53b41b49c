package kube_test

import (
	"encoding/json"
	"net/http"
	"net/http/httptest"
	"sync"
	"testing"
	"time"

	corev1 "k8s.io/api/core/v1"
	"k8s.io/client-go/rest"

	"github.com/shunt-project/shunt/kube"
)

// apiServer answers the two requests the watcher makes of a real API
// server, as the server does: GET /api/v1/pods (a PodList) and the same
// with watch=true (a stream of events). It records the field selectors.
type apiServer struct {
	list, added *corev1.Pod
	mu          sync.Mutex
	selectors   []string
}

func (a *apiServer) ServeHTTP(w http.ResponseWriter, r *http.Request) {
	if r.URL.Path != "/api/v1/pods" {
		http.NotFound(w, r)
		return
	}
	a.mu.Lock()
	a.selectors = append(a.selectors, r.URL.Query().Get("fieldSelector"))
	a.mu.Unlock()
	w.Header().Set("Content-Type", "application/json")
	typed := func(p *corev1.Pod) *corev1.Pod {
		p = p.DeepCopy()
		p.Kind, p.APIVersion = "Pod", "v1"
		return p
	}
	if r.URL.Query().Get("watch") != "true" {
		l := corev1.PodList{Items: []corev1.Pod{*typed(a.list)}}
		l.Kind, l.APIVersion, l.ResourceVersion = "PodList", "v1", "1"
		json.NewEncoder(w).Encode(l)
		return
	}
	json.NewEncoder(w).Encode(map[string]any{"type": "ADDED", "object": typed(a.added)})
	w.(http.Flusher).Flush()
	<-r.Context().Done()
}

// PodClientFor's core/v1-only REST client lists and watches pods as a
// real API server serves them, asking for this node's pods only.
func TestPodClientForTalksToTheAPIServer(t *testing.T) {
	web := map[string]string{"app": "web"}
	api := &apiServer{
		list:  pod("shop", "web-1", "node-a", "uid-1", corev1.PodQOSBurstable, web),
		added: pod("shop", "web-2", "node-a", "uid-2", corev1.PodQOSBestEffort, web),
	}
	srv := httptest.NewServer(api)
	t.Cleanup(srv.Close) // after the watcher's cleanup: Close waits for the watch to end
	pods, err := kube.PodClientFor(&rest.Config{Host: srv.URL})
	if err != nil {
		t.Fatal(err)
	}
	w := kube.NewWatcher(pods, "node-a", kube.Selector{Labels: web}, func() {})
	runWatcher(t, w)
	deadline := time.Now().Add(10 * time.Second)
	for {
		got, synced := w.Pods()
		if synced && len(got) == 2 && got[0].UID == "uid-1" && got[1].UID == "uid-2" && got[1].QOS == corev1.PodQOSBestEffort {
			break
		}
		if time.Now().After(deadline) {
			t.Fatalf("selected %+v (synced %v), want the listed uid-1 and the watched uid-2", got, synced)
		}
		time.Sleep(10 * time.Millisecond)
	}
	api.mu.Lock()
	defer api.mu.Unlock()
	for _, s := range api.selectors {
		if s != "spec.nodeName=node-a" {
			t.Errorf("asked with field selector %q, want spec.nodeName=node-a", s)
		}
	}
}
