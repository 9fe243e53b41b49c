package kube_test

import (
	"os"
	"strings"
	"testing"

	appsv1 "k8s.io/api/apps/v1"
	corev1 "k8s.io/api/core/v1"
	rbacv1 "k8s.io/api/rbac/v1"
	kjson "sigs.k8s.io/json"
	"sigs.k8s.io/yaml"

	"github.com/shunt-project/shunt/agent"
)

// deploy/kubernetes/shunt.yaml decodes strictly (no unknown field) into the
// Kubernetes API types, and holds together: the DaemonSet runs as the
// service account the role is bound to, the role lets it watch pods, the
// agent's configuration in the ConfigMap parses, the mounts the agent needs
// are there, and the Service selects the DaemonSet's pods.
func TestManifestsDecodeStrictly(t *testing.T) {
	b, err := os.ReadFile("../deploy/kubernetes/shunt.yaml")
	if err != nil {
		t.Fatal(err)
	}
	var (
		ds   appsv1.DaemonSet
		sa   corev1.ServiceAccount
		cm   corev1.ConfigMap
		svc  corev1.Service
		role rbacv1.ClusterRole
		bind rbacv1.ClusterRoleBinding
		ns   corev1.Namespace
	)
	into := map[string]any{"DaemonSet": &ds, "ServiceAccount": &sa, "ConfigMap": &cm, "Service": &svc,
		"ClusterRole": &role, "ClusterRoleBinding": &bind, "Namespace": &ns}
	seen := map[string]bool{}
	for _, doc := range strings.Split(string(b), "\n---\n") {
		var head struct{ Kind string }
		if err := yaml.Unmarshal([]byte(doc), &head); err != nil {
			t.Fatal(err)
		}
		obj, ok := into[head.Kind]
		if !ok || seen[head.Kind] {
			t.Fatalf("unexpected object %q", head.Kind)
		}
		seen[head.Kind] = true
		// As the API server decodes: field names case-sensitive, unknown
		// and duplicate fields errors (encoding/json would take hostPid
		// for hostPID).
		js, err := yaml.YAMLToJSON([]byte(doc))
		if err != nil {
			t.Fatal(err)
		}
		strict, err := kjson.UnmarshalStrict(js, obj)
		if err != nil {
			t.Errorf("%s: %v", head.Kind, err)
		}
		for _, e := range strict {
			t.Errorf("%s: %v", head.Kind, e)
		}
	}
	if len(seen) != len(into) {
		t.Fatalf("objects %v, want %d kinds", seen, len(into))
	}

	pod := ds.Spec.Template.Spec
	if pod.ServiceAccountName != sa.Name || bind.Subjects[0].Name != sa.Name || bind.Subjects[0].Namespace != sa.Namespace || bind.RoleRef.Name != role.Name {
		t.Error("the DaemonSet, its service account and the role binding do not name each other")
	}
	verbs := strings.Join(role.Rules[0].Verbs, ",")
	if role.Rules[0].Resources[0] != "pods" || verbs != "get,list,watch" {
		t.Errorf("role grants %v on %v; the agent needs get, list, watch on pods and nothing more", verbs, role.Rules[0].Resources)
	}
	if !pod.HostPID {
		t.Error("no hostPID: the guard and the index reach sockets through /proc")
	}
	c := pod.Containers[0]
	mounts := map[string]corev1.VolumeMount{}
	for _, m := range c.VolumeMounts {
		mounts[m.MountPath] = m
	}
	if m, ok := mounts["/sys/fs/bpf"]; !ok || m.MountPropagation == nil || *m.MountPropagation != corev1.MountPropagationBidirectional {
		t.Error("bpffs is not mounted with Bidirectional propagation: pins would not reach the host")
	}
	for _, p := range []string{"/sys/fs/cgroup", "/run/shunt", "/etc/shunt"} {
		if _, ok := mounts[p]; !ok {
			t.Errorf("%s is not mounted", p)
		}
	}
	if c.Env[0].Name != "NODE_NAME" || c.Env[0].ValueFrom.FieldRef.FieldPath != "spec.nodeName" {
		t.Error("NODE_NAME does not come from spec.nodeName")
	}
	t.Setenv("NODE_NAME", "node-a")
	cfg, err := agent.ParseConfig([]byte(cm.Data["config.yaml"]), "/sys/fs/cgroup")
	if err != nil {
		t.Fatalf("the ConfigMap's config.yaml: %v", err)
	}
	if cfg.Kubernetes == nil || cfg.Kubernetes.NodeName != "node-a" || cfg.Metrics.Address == "" {
		t.Errorf("the ConfigMap's configuration: %+v", cfg)
	}
	for k, v := range svc.Spec.Selector {
		if ds.Spec.Template.Labels[k] != v {
			t.Errorf("the metrics Service selects %s=%s, which the DaemonSet's pods do not carry", k, v)
		}
	}
	if svc.Spec.Ports[0].TargetPort.StrVal != c.Ports[0].Name {
		t.Error("the metrics Service does not target the container's metrics port")
	}
}
