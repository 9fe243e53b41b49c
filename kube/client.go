package kube

import (
	"context"
	"fmt"

	corev1 "k8s.io/api/core/v1"
	metav1 "k8s.io/apimachinery/pkg/apis/meta/v1"
	"k8s.io/apimachinery/pkg/fields"
	"k8s.io/apimachinery/pkg/runtime"
	"k8s.io/apimachinery/pkg/runtime/serializer"
	"k8s.io/apimachinery/pkg/watch"
	"k8s.io/client-go/rest"
	"k8s.io/client-go/tools/cache"
)

// PodClient lists and watches pods: what the watcher needs of the API
// server. client-go's typed clientset gives one (Clientset.CoreV1().Pods),
// so does PodClientFor.
type PodClient interface {
	List(ctx context.Context, opts metav1.ListOptions) (*corev1.PodList, error)
	Watch(ctx context.Context, opts metav1.ListOptions) (watch.Interface, error)
}

// PodClientFor talks to the API server of cfg with a REST client that knows
// only core/v1. The typed clientset would link every API group's types into
// shunt and register them all at start: some 10 MB more resident memory
// for an agent that reads pods only (docs/BENCHMARKS.md, "The agent").
func PodClientFor(cfg *rest.Config) (PodClient, error) {
	c, err := coreConfig(cfg)
	if err != nil {
		return nil, err
	}
	c.GroupVersion = &corev1.SchemeGroupVersion
	c.APIPath = "/api"
	rc, err := rest.RESTClientFor(c)
	if err != nil {
		return nil, fmt.Errorf("kubernetes: %w", err)
	}
	return restPods{rc}, nil
}

// restPods is the pods of every namespace through a core/v1 REST client.
type restPods struct{ rc rest.Interface }

func (r restPods) List(ctx context.Context, opts metav1.ListOptions) (*corev1.PodList, error) {
	var l corev1.PodList
	err := r.rc.Get().Resource("pods").VersionedParams(&opts, metav1.ParameterCodec).Do(ctx).Into(&l)
	return &l, err
}

func (r restPods) Watch(ctx context.Context, opts metav1.ListOptions) (watch.Interface, error) {
	opts.Watch = true
	return r.rc.Get().Resource("pods").VersionedParams(&opts, metav1.ParameterCodec).Watch(ctx)
}

// podsOfNode lists and watches node's pods: the API server filters by
// node (the watcher checks the node too, for servers that do not). The
// informer passes its own context, which ends when it stops.
func podsOfNode(pods PodClient, node string) cache.ListerWatcher {
	sel := fields.OneTermEqualSelector("spec.nodeName", node).String()
	return &cache.ListWatch{
		ListWithContextFunc: func(ctx context.Context, o metav1.ListOptions) (runtime.Object, error) {
			o.FieldSelector = sel
			return pods.List(ctx, o)
		},
		WatchFuncWithContext: func(ctx context.Context, o metav1.ListOptions) (watch.Interface, error) {
			o.FieldSelector = sel
			return pods.Watch(ctx, o)
		},
	}
}

// coreConfig is cfg with a codec for core/v1 (and metav1's Status, which
// errors come in) and the agent's user agent: the one API group shunt links.
func coreConfig(cfg *rest.Config) (*rest.Config, error) {
	scheme := runtime.NewScheme()
	if err := corev1.AddToScheme(scheme); err != nil {
		return nil, err
	}
	c := rest.CopyConfig(cfg)
	c.NegotiatedSerializer = serializer.NewCodecFactory(scheme).WithoutConversion()
	if c.UserAgent == "" {
		c.UserAgent = "shunt-agent"
	}
	return c, nil
}
