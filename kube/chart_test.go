package kube_test

import (
	"bytes"
	"flag"
	"os"
	"strings"
	"testing"

	"helm.sh/helm/v3/pkg/chart/loader"
	"helm.sh/helm/v3/pkg/chartutil"
	"helm.sh/helm/v3/pkg/engine"
	"helm.sh/helm/v3/pkg/releaseutil"
)

var update = flag.Bool("update", false, "rewrite deploy/kubernetes/shunt.yaml from the chart (make manifests)")

const (
	chartDir      = "../deploy/helm/shunt"
	manifestsFile = "../deploy/kubernetes/shunt.yaml"
)

// manifestsHeader opens deploy/kubernetes/shunt.yaml, with the Namespace
// that `helm install --create-namespace` would otherwise make.
const manifestsHeader = `# shunt on Kubernetes: the node agent as a DaemonSet (docs/KUBERNETES.md).
# Pods annotated shunt.dev/bypass: "true" have their TCP between each other
# on the same node bypassed. kubectl apply -f deploy/kubernetes/shunt.yaml
#
# Made from the Helm chart in deploy/helm/shunt with its default values by
# make manifests: change the chart, not this file.
apiVersion: v1
kind: Namespace
metadata:
  name: shunt-system
`

// renderChart renders the chart as `helm template shunt deploy/helm/shunt
// --namespace shunt-system` does, with values over the chart's defaults, in
// helm's install order.
func renderChart(t *testing.T, values map[string]any) []byte {
	t.Helper()
	ch, err := loader.Load(chartDir)
	if err != nil {
		t.Fatal(err)
	}
	if err := chartutil.ProcessDependencies(ch, values); err != nil {
		t.Fatal(err)
	}
	opts := chartutil.ReleaseOptions{Name: "shunt", Namespace: "shunt-system", Revision: 1, IsInstall: true}
	vals, err := chartutil.ToRenderValues(ch, values, opts, chartutil.DefaultCapabilities)
	if err != nil {
		t.Fatal(err)
	}
	files, err := engine.Render(ch, vals)
	if err != nil {
		t.Fatal(err)
	}
	hooks, ms, err := releaseutil.SortManifests(files, nil, releaseutil.InstallOrder)
	if err != nil {
		t.Fatal(err)
	}
	if len(hooks) > 0 {
		t.Fatalf("the chart has %d hooks; the plain manifests cannot carry them", len(hooks))
	}
	var out bytes.Buffer
	for i, m := range ms {
		if i > 0 {
			out.WriteString("---\n")
		}
		out.WriteString("# Source: " + strings.TrimPrefix(m.Name, ch.Name()+"/") + "\n")
		out.WriteString(strings.TrimSpace(m.Content) + "\n")
	}
	return out.Bytes()
}

// The plain manifests are the chart's default rendering, so the two cannot
// drift apart. go test ./kube -run TestChartRendersTheManifests -update
// (make manifests) rewrites them.
func TestChartRendersTheManifests(t *testing.T) {
	want := append([]byte(manifestsHeader+"---\n"), renderChart(t, nil)...)
	if *update {
		if err := os.WriteFile(manifestsFile, want, 0o644); err != nil {
			t.Fatal(err)
		}
	}
	got, err := os.ReadFile(manifestsFile)
	if err != nil {
		t.Fatal(err)
	}
	if !bytes.Equal(got, want) {
		t.Errorf("deploy/kubernetes/shunt.yaml is not the chart's default rendering: run make manifests\n--- rendered:\n%s", want)
	}
}

// The chart's values reach the objects, and every rendering decodes
// strictly and holds together.
func TestChartValuesRenderStrictly(t *testing.T) {
	for _, tc := range []struct {
		name   string
		values map[string]any
		check  func(*testing.T, manifests)
	}{{
		name: "defaults",
		check: func(t *testing.T, m manifests) {
			cfg := checkManifests(t, m, true)
			if cfg.Kubernetes.Annotation != "shunt.dev/bypass" || m.svc == nil {
				t.Errorf("defaults: annotation %q, Service %v", cfg.Kubernetes.Annotation, m.svc != nil)
			}
		},
	}, {
		name: "unprivileged, selected by namespace and labels",
		values: map[string]any{
			"privileged":   false,
			"image":        map[string]any{"repository": "registry.example/shunt", "tag": "1.2.3", "pullPolicy": "IfNotPresent"},
			"select":       map[string]any{"annotation": "", "namespaces": []any{"shop", "cart"}, "labels": map[string]any{"app": "web"}},
			"kubelet":      map[string]any{"driver": "cgroupfs"},
			"bypass":       map[string]any{"cgroups": []any{"/sys/fs/cgroup/app-*"}, "exclude": []any{"/sys/fs/cgroup/app-db"}, "guard": false},
			"metrics":      map[string]any{"port": 9500, "service": false},
			"nodeSelector": map[string]any{"kubernetes.io/os": "linux"},
		},
		check: func(t *testing.T, m manifests) {
			cfg := checkManifests(t, m, false)
			k := cfg.Kubernetes
			if k.Annotation != "" || strings.Join(k.Namespaces, ",") != "shop,cart" || k.Labels["app"] != "web" || k.Driver != "cgroupfs" {
				t.Errorf("pod selection: %+v", k)
			}
			if strings.Join(cfg.Bypass.Cgroups, ",") != "/sys/fs/cgroup/app-*" || strings.Join(cfg.Bypass.Exclude, ",") != "/sys/fs/cgroup/app-db" || cfg.Bypass.Guard == nil || *cfg.Bypass.Guard {
				t.Errorf("bypass: %+v", cfg.Bypass)
			}
			if cfg.Metrics.Address != "0.0.0.0:9500" || m.svc != nil {
				t.Errorf("metrics on %s, Service %v: want 0.0.0.0:9500 and no Service", cfg.Metrics.Address, m.svc != nil)
			}
			pod := m.ds.Spec.Template.Spec
			if c := pod.Containers[0]; c.Image != "registry.example/shunt:1.2.3" || c.ImagePullPolicy != "IfNotPresent" {
				t.Errorf("image %s, pull policy %s", c.Image, c.ImagePullPolicy)
			}
			if pod.NodeSelector["kubernetes.io/os"] != "linux" {
				t.Errorf("node selector %v", pod.NodeSelector)
			}
		},
	}, {
		// The metrics behind a bearer token from a Secret, mounted
		// readable by the agent alone (it refuses a token others may read).
		name:   "metrics token",
		values: map[string]any{"metrics": map[string]any{"tokenSecret": "shunt-metrics-token"}},
		check: func(t *testing.T, m manifests) {
			cfg := checkManifests(t, m, true)
			if cfg.Metrics.TokenFile != "/etc/shunt-token/token" {
				t.Errorf("metrics.token_file %q, want /etc/shunt-token/token", cfg.Metrics.TokenFile)
			}
			pod := m.ds.Spec.Template.Spec
			var mounted bool
			for _, vm := range pod.Containers[0].VolumeMounts {
				mounted = mounted || vm.Name == "metrics-token" && vm.MountPath == "/etc/shunt-token" && vm.ReadOnly
			}
			var secret bool
			for _, v := range pod.Volumes {
				if s := v.Secret; v.Name == "metrics-token" && s != nil {
					secret = s.SecretName == "shunt-metrics-token" && s.DefaultMode != nil && *s.DefaultMode == 0o400 &&
						len(s.Items) == 1 && s.Items[0].Key == "token" && s.Items[0].Path == "token"
				}
			}
			if !mounted || !secret {
				t.Errorf("the token Secret: mounted %v, volume as wanted %v", mounted, secret)
			}
		},
	}, {
		// With no condition the agent still selects pods: all of them.
		name:   "every pod",
		values: map[string]any{"select": map[string]any{"annotation": ""}},
		check: func(t *testing.T, m manifests) {
			cfg := checkManifests(t, m, true)
			if k := cfg.Kubernetes; k.Annotation != "" || len(k.Namespaces) != 0 || len(k.Labels) != 0 {
				t.Errorf("pod selection: %+v", k)
			}
		},
	}} {
		t.Run(tc.name, func(t *testing.T) {
			tc.check(t, decodeManifests(t, renderChart(t, tc.values)))
		})
	}
}
