package kube

import (
	"context"
	"fmt"
	"slices"
	"sort"
	"sync"
	"time"

	corev1 "k8s.io/api/core/v1"
	"k8s.io/apimachinery/pkg/labels"
	"k8s.io/apimachinery/pkg/types"
	"k8s.io/client-go/tools/cache"
)

// Selector says which pods are bypassed. Every condition given must hold.
type Selector struct {
	Namespaces []string          // empty: every namespace
	Labels     map[string]string // each must match; empty: any
	// Annotation, if set, must be on the pod with the value "true".
	Annotation string
}

// Selects says whether p is selected.
func (s Selector) Selects(p *corev1.Pod) bool {
	if len(s.Namespaces) > 0 && !slices.Contains(s.Namespaces, p.Namespace) {
		return false
	}
	if !labels.SelectorFromSet(s.Labels).Matches(labels.Set(p.Labels)) {
		return false
	}
	if s.Annotation != "" && p.Annotations[s.Annotation] != "true" {
		return false
	}
	return true
}

// Pod is a selected pod: what its cgroup is named by.
type Pod struct {
	Namespace, Name string
	UID             types.UID
	QOS             corev1.PodQOSClass
}

// Watcher keeps the selected pods of one node, from the API server.
type Watcher struct {
	source   PodClient
	node     string
	sel      Selector
	onChange func()

	mu     sync.Mutex
	pods   map[types.UID]Pod
	synced bool
}

// NewWatcher watches node's pods through pods; onChange is called (from
// the watch's goroutine) whenever the selected set may have changed.
func NewWatcher(pods PodClient, node string, sel Selector, onChange func()) *Watcher {
	return &Watcher{source: pods, node: node, sel: sel, onChange: onChange, pods: map[types.UID]Pod{}}
}

// Run watches until ctx ends. It returns an error if the first list does
// not complete within a minute (no API server, or no right to list pods).
func (w *Watcher) Run(ctx context.Context) error {
	// The informer ends with Run, also when Run gives up on the first list.
	ictx, stop := context.WithCancel(ctx)
	inf := cache.NewSharedIndexInformer(podsOfNode(w.source, w.node), &corev1.Pod{}, 10*time.Minute, cache.Indexers{})
	update := func(obj any) {
		if p, ok := podOf(obj); ok {
			w.set(p)
		}
	}
	if _, err := inf.AddEventHandler(cache.ResourceEventHandlerFuncs{
		AddFunc:    update,
		UpdateFunc: func(_, obj any) { update(obj) },
		DeleteFunc: func(obj any) {
			if d, ok := obj.(cache.DeletedFinalStateUnknown); ok {
				obj = d.Obj
			}
			if p, ok := obj.(*corev1.Pod); ok {
				w.remove(p.UID)
			}
		},
	}); err != nil {
		stop()
		return fmt.Errorf("watch pods: %w", err)
	}
	stopped := make(chan struct{})
	go func() {
		defer close(stopped)
		inf.Run(ictx.Done())
	}()
	defer func() {
		stop()
		<-stopped
	}()
	syncCtx, cancel := context.WithTimeout(ctx, time.Minute)
	defer cancel()
	if !cache.WaitForCacheSync(syncCtx.Done(), inf.HasSynced) {
		if ctx.Err() != nil {
			return nil
		}
		return fmt.Errorf("kubernetes: no list of node %s's pods within a minute (API server reachable? may this service account list pods?)", w.node)
	}
	w.mu.Lock()
	w.synced = true
	w.mu.Unlock()
	w.onChange()
	<-ctx.Done()
	return nil
}

func podOf(obj any) (*corev1.Pod, bool) {
	p, ok := obj.(*corev1.Pod)
	return p, ok
}

// set records p as selected or not; a finished pod is not.
func (w *Watcher) set(p *corev1.Pod) {
	w.mu.Lock()
	_, had := w.pods[p.UID]
	// The field selector asks the API server for this node's pods only;
	// checked here too (a fake clientset, or a proxy, may not apply it).
	want := p.Spec.NodeName == w.node && w.sel.Selects(p) && p.Status.Phase != corev1.PodSucceeded && p.Status.Phase != corev1.PodFailed && p.Status.QOSClass != ""
	if want {
		w.pods[p.UID] = Pod{Namespace: p.Namespace, Name: p.Name, UID: p.UID, QOS: p.Status.QOSClass}
	} else {
		delete(w.pods, p.UID)
	}
	synced := w.synced
	w.mu.Unlock()
	if synced && (want || had) {
		w.onChange()
	}
}

func (w *Watcher) remove(uid types.UID) {
	w.mu.Lock()
	_, had := w.pods[uid]
	delete(w.pods, uid)
	synced := w.synced
	w.mu.Unlock()
	if synced && had {
		w.onChange()
	}
}

// Pods lists the selected pods, and whether the first list is in: until
// then, the set is not to be acted on.
func (w *Watcher) Pods() ([]Pod, bool) {
	w.mu.Lock()
	defer w.mu.Unlock()
	out := make([]Pod, 0, len(w.pods))
	for _, p := range w.pods {
		out = append(out, p)
	}
	sort.Slice(out, func(i, j int) bool { return out[i].UID < out[j].UID })
	return out, w.synced
}
