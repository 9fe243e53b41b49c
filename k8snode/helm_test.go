//go:build k8snode

package k8snode_test

import (
	"testing"

	"helm.sh/helm/v3/pkg/action"
	"helm.sh/helm/v3/pkg/chart/loader"
	"k8s.io/cli-runtime/pkg/genericclioptions"
	"k8s.io/client-go/rest"
)

const (
	chartDir    = "../deploy/helm/shunt"
	releaseNS   = "shunt-system"
	releaseName = "shunt"
	agentName   = "shunt-agent" // the chart's objects (shunt.name)
)

// helmConfig is what the helm command builds from its flags, reaching the
// API server in the node's namespace.
func (c *cluster) helmConfig(t testing.TB) *action.Configuration {
	t.Helper()
	flags := genericclioptions.NewConfigFlags(false)
	kc := c.kubeconfig(t, "helm.kubeconfig", adminToken)
	ns := releaseNS
	flags.KubeConfig, flags.Namespace = &kc, &ns
	dial := c.restConfig(adminToken).Dial
	flags.WrapConfigFn = func(r *rest.Config) *rest.Config {
		r.Dial = dial
		return r
	}
	cfg := new(action.Configuration)
	if err := cfg.Init(flags, releaseNS, "secret", t.Logf); err != nil {
		t.Fatal(err)
	}
	return cfg
}

// helmInstall installs the chart as `helm install shunt deploy/helm/shunt
// --namespace shunt-system --create-namespace --wait=false` with values.
func (c *cluster) helmInstall(t testing.TB, values map[string]any) {
	t.Helper()
	ch, err := loader.Load(chartDir)
	if err != nil {
		t.Fatal(err)
	}
	in := action.NewInstall(c.helmConfig(t))
	in.ReleaseName, in.Namespace, in.CreateNamespace = releaseName, releaseNS, true
	if _, err := in.Run(ch, values); err != nil {
		t.Fatalf("helm install: %v", err)
	}
}

// helmUninstall is `helm uninstall shunt --namespace shunt-system`.
func (c *cluster) helmUninstall(t testing.TB) {
	t.Helper()
	if _, err := action.NewUninstall(c.helmConfig(t)).Run(releaseName); err != nil {
		t.Fatalf("helm uninstall: %v", err)
	}
}
