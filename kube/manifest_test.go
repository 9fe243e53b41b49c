package kube_test

import (
	"os"
	"slices"
	"strconv"
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
// Kubernetes API types, and holds together (checkManifests).
func TestManifestsDecodeStrictly(t *testing.T) {
	b, err := os.ReadFile("../deploy/kubernetes/shunt.yaml")
	if err != nil {
		t.Fatal(err)
	}
	m := decodeManifests(t, b)
	if m.ns == nil {
		t.Fatal("no Namespace: kubectl apply -f would fail on the first namespaced object")
	}
	checkManifests(t, m, true)
}

// manifests are the objects of one rendering of the chart.
type manifests struct {
	ds   *appsv1.DaemonSet
	sa   *corev1.ServiceAccount
	cm   *corev1.ConfigMap
	svc  *corev1.Service // nil: metrics.service false
	role *rbacv1.ClusterRole
	bind *rbacv1.ClusterRoleBinding
	own  *rbacv1.Role // reading its own DaemonSet
	ownB *rbacv1.RoleBinding
	ns   *corev1.Namespace // only in the plain manifests
}

// decodeManifests decodes a multi-document YAML stream as the API server
// decodes each object: field names case-sensitive, unknown and duplicate
// fields errors (encoding/json would take hostPid for hostPID).
func decodeManifests(t *testing.T, b []byte) manifests {
	t.Helper()
	var m manifests
	seen := map[string]bool{}
	for _, doc := range strings.Split(string(b), "\n---\n") {
		var head struct{ Kind string }
		if err := yaml.Unmarshal([]byte(doc), &head); err != nil {
			t.Fatal(err)
		}
		if head.Kind == "" {
			continue // comments only
		}
		if seen[head.Kind] {
			t.Fatalf("two objects of kind %s", head.Kind)
		}
		seen[head.Kind] = true
		var obj any
		switch head.Kind {
		case "DaemonSet":
			m.ds = new(appsv1.DaemonSet)
			obj = m.ds
		case "ServiceAccount":
			m.sa = new(corev1.ServiceAccount)
			obj = m.sa
		case "ConfigMap":
			m.cm = new(corev1.ConfigMap)
			obj = m.cm
		case "Service":
			m.svc = new(corev1.Service)
			obj = m.svc
		case "ClusterRole":
			m.role = new(rbacv1.ClusterRole)
			obj = m.role
		case "ClusterRoleBinding":
			m.bind = new(rbacv1.ClusterRoleBinding)
			obj = m.bind
		case "Role":
			m.own = new(rbacv1.Role)
			obj = m.own
		case "RoleBinding":
			m.ownB = new(rbacv1.RoleBinding)
			obj = m.ownB
		case "Namespace":
			m.ns = new(corev1.Namespace)
			obj = m.ns
		default:
			t.Fatalf("unexpected object %q", head.Kind)
		}
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
	if m.ds == nil || m.sa == nil || m.cm == nil || m.role == nil || m.bind == nil || m.own == nil || m.ownB == nil {
		t.Fatalf("objects %v: want a DaemonSet, ServiceAccount, ConfigMap, ClusterRole, ClusterRoleBinding, Role and RoleBinding", seen)
	}
	return m
}

// checkManifests checks that the objects hold together: the DaemonSet runs
// as the service account the role is bound to, the role lets it watch pods
// and nothing more, the mounts the agent needs are there (bpffs propagating
// to the host if privileged), the agent's configuration in the ConfigMap
// parses, and the Service selects the DaemonSet's pods. It returns the
// parsed configuration.
func checkManifests(t *testing.T, m manifests, privileged bool) *agent.Config {
	t.Helper()
	pod := m.ds.Spec.Template.Spec
	if pod.ServiceAccountName != m.sa.Name || m.bind.Subjects[0].Name != m.sa.Name || m.bind.Subjects[0].Namespace != m.sa.Namespace || m.bind.RoleRef.Name != m.role.Name {
		t.Error("the DaemonSet, its service account and the role binding do not name each other")
	}
	if m.ns != nil && (m.sa.Namespace != m.ns.Name || m.ds.Namespace != m.ns.Name || m.cm.Namespace != m.ns.Name) {
		t.Errorf("objects are not in the Namespace %s that the manifests make", m.ns.Name)
	}
	verbs := strings.Join(m.role.Rules[0].Verbs, ",")
	if len(m.role.Rules) != 1 || m.role.Rules[0].Resources[0] != "pods" || verbs != "get,list,watch" {
		t.Errorf("role grants %v on %v; the agent needs get, list, watch on pods and nothing more", verbs, m.role.Rules[0].Resources)
	}
	// The Role lets it read its own DaemonSet, in its namespace, and no
	// other object; the configuration names that DaemonSet.
	if m.ownB.Subjects[0].Name != m.sa.Name || m.ownB.RoleRef.Name != m.own.Name || m.ownB.Namespace != m.ds.Namespace || m.own.Namespace != m.ds.Namespace {
		t.Error("the Role binding does not bind the Role to the agent's service account in the DaemonSet's namespace")
	}
	if r := m.own.Rules; len(r) != 1 || strings.Join(r[0].Verbs, ",") != "get" || strings.Join(r[0].Resources, ",") != "daemonsets" || strings.Join(r[0].ResourceNames, ",") != m.ds.Name {
		t.Errorf("the Role grants %+v; the agent needs get on its own DaemonSet and nothing more", r)
	}
	if !pod.HostPID {
		t.Error("no hostPID: the guard and the index reach sockets through /proc")
	}
	c := pod.Containers[0]
	mounts := map[string]corev1.VolumeMount{}
	for _, vm := range c.VolumeMounts {
		mounts[vm.MountPath] = vm
	}
	bpffs, ok := mounts["/sys/fs/bpf"]
	bidirectional := ok && bpffs.MountPropagation != nil && *bpffs.MountPropagation == corev1.MountPropagationBidirectional
	sc := c.SecurityContext
	switch {
	case !ok:
		t.Error("bpffs is not mounted")
	case privileged && (!bidirectional || sc == nil || sc.Privileged == nil || !*sc.Privileged):
		t.Error("privileged, but bpffs is not mounted with Bidirectional propagation: pins would not reach the host")
	case !privileged && bidirectional:
		t.Error("Bidirectional propagation without a privileged container: the API server refuses the pod")
	case !privileged && (sc == nil || sc.Capabilities == nil || !slices.Contains(sc.Capabilities.Add, "BPF") || !slices.Contains(sc.Capabilities.Drop, "ALL")):
		t.Errorf("unprivileged, but the capabilities are not ALL dropped and BPF added: %+v", sc)
	}
	for _, p := range []string{"/sys/fs/cgroup", "/run/shunt", "/etc/shunt"} {
		if _, ok := mounts[p]; !ok {
			t.Errorf("%s is not mounted", p)
		}
	}
	if c.Env[0].Name != "NODE_NAME" || c.Env[0].ValueFrom.FieldRef.FieldPath != "spec.nodeName" {
		t.Error("NODE_NAME does not come from spec.nodeName")
	}
	cfg, err := agent.ParseConfig([]byte(m.cm.Data["config.yaml"]), agent.ConfigEnv{CgroupRoot: "/sys/fs/cgroup", NodeName: "node-a"})
	if err != nil {
		t.Fatalf("the ConfigMap's config.yaml: %v", err)
	}
	if cfg.Kubernetes == nil || cfg.Kubernetes.NodeName != "node-a" || cfg.Metrics.Address == "" {
		t.Errorf("the ConfigMap's configuration: %+v", cfg)
	}
	if want := m.ds.Namespace + "/" + m.ds.Name; cfg.Kubernetes != nil && cfg.Kubernetes.DaemonSet != want {
		t.Errorf("the configuration names DaemonSet %q, the chart's is %s", cfg.Kubernetes.DaemonSet, want)
	}
	if _, port, _ := strings.Cut(cfg.Metrics.Address, ":"); port != strconv.Itoa(int(c.Ports[0].ContainerPort)) {
		t.Errorf("the agent serves metrics on %s, the container's metrics port is %d", cfg.Metrics.Address, c.Ports[0].ContainerPort)
	}
	if m.svc != nil {
		for k, v := range m.svc.Spec.Selector {
			if m.ds.Spec.Template.Labels[k] != v {
				t.Errorf("the metrics Service selects %s=%s, which the DaemonSet's pods do not carry", k, v)
			}
		}
		if m.svc.Spec.Ports[0].TargetPort.StrVal != c.Ports[0].Name {
			t.Error("the metrics Service does not target the container's metrics port")
		}
	}
	return cfg
}
