//go:build k8snode

// Package k8snode_test runs shunt's Kubernetes support against a real
// control plane on this machine (`make test-k8s`, docs/KUBERNETES.md): etcd,
// kube-apiserver, kube-controller-manager and kube-proxy built from their Go
// modules by scripts/k8s.sh, the chart installed through Helm's library,
// the agent with the chart's configuration and service account, pods
// created through the API and made as kubelet makes them.
package k8snode_test

import (
	"bytes"
	"context"
	"crypto/sha256"
	"flag"
	"fmt"
	"io"
	"math/rand/v2"
	"net"
	"net/http"
	"os"
	"os/exec"
	"path/filepath"
	"slices"
	"strings"
	"testing"
	"time"

	"github.com/cilium/ebpf"
	"github.com/cilium/ebpf/link"
	authv1 "k8s.io/api/authentication/v1"
	metav1 "k8s.io/apimachinery/pkg/apis/meta/v1"
	"sigs.k8s.io/yaml"

	"github.com/shunt-project/shunt/bypass"
	"github.com/shunt-project/shunt/bypass/bypasstest"
	"github.com/shunt-project/shunt/internal/testenv"
)

var (
	k8sBin   = flag.String("k8s.bin", "/var/cache/shunt-k8s/v1.34.3/bin", "directory of the Kubernetes programs, containerd and the images' programs (scripts/k8s.sh setup)")
	shuntBin = flag.String("shunt", "../bin/shunt", "the shunt binary the agent runs from (make build)")
)

// TestNode brings up a node per kube-proxy mode and checks, for the
// traffic pods make, that every byte arrives and that what
// docs/KUBERNETES.md says is bypassed is, and nothing else.
func TestNode(t *testing.T) {
	testenv.RequireRoot(t)
	requireBuilt(t)
	for _, mode := range []string{"nftables", "iptables"} {
		t.Run(mode, func(t *testing.T) { testNode(t, mode) })
	}
}

// requireBuilt fails the test if the programs it runs are not built.
func requireBuilt(t testing.TB) {
	t.Helper()
	for _, p := range []string{*k8sBin, *shuntBin} {
		if _, err := os.Stat(p); err != nil {
			t.Fatalf("%v (make build; scripts/k8s.sh setup builds the Kubernetes programs)", err)
		}
	}
}

// startNode brings up the control plane (kube-proxy in proxyMode, none if
// empty), installs the chart and starts the agent as the chart has it run,
// with its pins at pin.
func startNode(t testing.TB, proxyMode string) (c *cluster, k *kubelet, pin string, agent *testenv.Process) {
	t.Helper()
	k = newKubelet(t)
	c = startCluster(t, testenv.MustNetNS(t))
	c.registerNode(t)
	if proxyMode != "" {
		c.startProxy(t, proxyMode)
	}
	c.helmInstall(t, map[string]any{"kubelet": map[string]any{"cgroupRoot": k.root.Path, "driver": "cgroupfs"}})
	pin = bypasstest.MustPinDir(t)
	agent = c.startAgent(t, pin)
	c.createNamespace(t, podNamespace)
	return c, k, pin, agent
}

func testNode(t *testing.T, mode string) {
	c, k, pin, agent := startNode(t, mode)
	web := k.runPod(t, c, "web", map[string]string{"app": "web"}, true)
	client := k.runPod(t, c, "client", map[string]string{"app": "client"}, true)
	other := k.runPod(t, c, "other", map[string]string{"app": "other"}, false)
	svc := c.service(t, "web", 80, 8080)

	in := waitEnabled(t, pin, web.cg.Path, client.cg.Path)
	if slices.Contains(enabledPaths(t, in), other.cg.Path) {
		t.Fatalf("the agent enabled %s, a pod without the annotation", other.name)
	}

	body := make([]byte, 4<<20)
	r := rand.NewChaCha8([32]byte{byte(len(mode))})
	r.Read(body)
	web.start(t, "nginx", "-c", nginxConf(t, body))
	// kube-proxy writes the Service's rules once the endpoint slice
	// controller has seen the pod ready.
	t.Cleanup(func() {
		if t.Failed() {
			c.logState(t)
		}
	})
	eventually(t, 60*time.Second, "the Service through "+mode, func() error {
		_, err := other.run(t, "curl", "-sSf", "-o", "/dev/null", "--max-time", "2", "http://"+svc+"/ready")
		return err
	})

	checkTraffic(t, in, web, client, other, svc, body)

	agent = agentRollout(t, c, pin, in, agent, client, "http://"+svc+"/blob", body)

	// The agent's metrics, as Prometheus would scrape them on the node.
	eventually(t, 30*time.Second, "the agent's metrics", func() error {
		return c.checkMetrics("http://127.0.0.1:9464/metrics", 2)
	})

	uninstall(t, c, agent, pin, web, client)
}

// checkTraffic downloads web's body by each way pods reach each other
// (web serves it at port 8080 behind the Service at svc, port 80): every
// byte arrives, and the connections between annotated pods are
// bypassed, through address translation where a Service is between them.
func checkTraffic(t *testing.T, in *bypass.Install, web, client, other *pod, svc string, body []byte) {
	for _, tc := range []struct {
		name       string
		from       *pod
		url        string
		paired     bool // each connection bypassed
		translated bool // ... through address translation
	}{
		{"pod to pod", client, "http://" + web.ip + ":8080/blob", true, false},
		{"pod to Service to pod", client, "http://" + svc + "/blob", true, true},
		{"pod to its own Service", web, "http://" + svc + "/blob", true, true},
		{"unselected pod to Service", other, "http://" + svc + "/blob", false, false},
	} {
		t.Run(tc.name, func(t *testing.T) {
			const n = 5
			before := counters(t, in)
			for i := range n {
				if err := download(t, tc.from, tc.url, body); err != nil {
					t.Fatalf("download %d: %v", i, err)
				}
			}
			after := counters(t, in)
			paired, translated := after.Paired-before.Paired, after.Translated-before.Translated
			t.Logf("%d downloads of %d bytes intact; %d connections paired, %d through translation", n, len(body), paired, translated)
			if want := uint64(n) * b2u(tc.paired); paired != want {
				t.Errorf("%d connections paired, want %d", paired, want)
			}
			if want := uint64(n) * b2u(tc.translated); translated != want {
				t.Errorf("%d paired through address translation, want %d", translated, want)
			}
		})
	}
}

// checkMetrics scrapes the agent's metrics at url and checks they say
// enabled cgroups are.
func (c *cluster) checkMetrics(url string, enabled int) error {
	metrics, err := c.scrape(url)
	if err == nil && !strings.Contains(metrics, fmt.Sprintf("shunt_agent_cgroups_enabled %d\n", enabled)) {
		err = fmt.Errorf("they do not say %d cgroups enabled:\n%s", enabled, grep(metrics, "shunt_agent"))
	}
	return err
}

// agentRollout stops the agent while a download is under way and starts a
// new one on the same pins, as a DaemonSet rollout does: the download ends
// intact and bypassed, the pods stay enabled throughout, and the new
// agent's connections are bypassed.
func agentRollout(t testing.TB, c *cluster, pin string, in *bypass.Install, old *testenv.Process, client *pod, url string, body []byte) (agent *testenv.Process) {
	t.Helper()
	before := counters(t, in)
	done := make(chan error, 1)
	go func() {
		done <- download(t, client, url, body, "--limit-rate", "2M")
	}()
	time.Sleep(500 * time.Millisecond)
	old.Stop()
	if got := enabledPaths(t, in); !slices.Contains(got, client.cg.Path) {
		t.Errorf("with the agent stopped, enabled: %v", got)
	}
	agent = c.startAgent(t, pin)
	if err := <-done; err != nil {
		t.Fatalf("the download across the rollout: %v", err)
	}
	if err := download(t, client, url, body); err != nil {
		t.Fatalf("after the rollout: %v", err)
	}
	after := counters(t, in)
	if paired := after.Paired - before.Paired; paired != 2 {
		t.Errorf("%d connections paired across and after the rollout, want 2", paired)
	}
	return agent
}

// uninstall is `helm uninstall`, then the end of the agent's pod (kubelet
// would stop it as the DaemonSet's garbage goes; the test does): the agent
// finds its DaemonSet gone and takes shunt off the node, leaving nothing
// pinned and no program attached to the pods' cgroups.
func uninstall(t testing.TB, c *cluster, agent *testenv.Process, pin string, pods ...*pod) {
	t.Helper()
	c.helmUninstall(t)
	agent.Stop()
	checkRemoved(t, pin, pods...)
}

// checkRemoved checks that shunt is off the node: nothing pinned at pin,
// no program attached to the pods' cgroups.
func checkRemoved(t testing.TB, pin string, pods ...*pod) {
	t.Helper()
	if _, err := os.Stat(pin); !os.IsNotExist(err) {
		t.Errorf("after helm uninstall and the agent's end, %s is still there (%v)", pin, err)
	}
	for _, p := range pods {
		cg, err := os.Open(p.cg.Path)
		if err != nil {
			t.Fatal(err)
		}
		for _, at := range []ebpf.AttachType{ebpf.AttachCGroupSockOps, ebpf.AttachCGroupSetsockopt, ebpf.AttachCGroupGetsockopt} {
			q, err := link.QueryPrograms(link.QueryOptions{Target: int(cg.Fd()), Attach: at})
			if err != nil {
				t.Fatalf("query %s: %v", p.cg.Path, err)
			}
			if len(q.Programs) > 0 {
				t.Errorf("after helm uninstall, pod %s's cgroup still has %d %v program(s)", p.name, len(q.Programs), at)
			}
		}
		cg.Close()
	}
}

func b2u(b bool) uint64 {
	if b {
		return 1
	}
	return 0
}

// startAgent runs `shunt agent` on the node with the configuration the
// chart's ConfigMap holds and the chart's service account's token, as the
// DaemonSet's pod would (NODE_NAME from the downward API; a kubeconfig
// with the token where the pod would have it mounted).
func (c *cluster) startAgent(t testing.TB, pin string) *testenv.Process {
	t.Helper()
	ctx := context.Background()
	cm, err := c.client.CoreV1().ConfigMaps(releaseNS).Get(ctx, agentName, metav1.GetOptions{})
	if err != nil {
		t.Fatalf("the chart's ConfigMap: %v", err)
	}
	var cfg map[string]map[string]any
	if err := yaml.Unmarshal([]byte(cm.Data["config.yaml"]), &cfg); err != nil {
		t.Fatalf("the chart's config.yaml: %v", err)
	}
	tok, err := c.client.CoreV1().ServiceAccounts(releaseNS).CreateToken(ctx, agentName, &authv1.TokenRequest{
		Spec: authv1.TokenRequestSpec{ExpirationSeconds: new(int64(3600))},
	}, metav1.CreateOptions{})
	if err != nil {
		t.Fatalf("a token of the chart's service account: %v", err)
	}
	cfg["kubernetes"]["kubeconfig"] = c.kubeconfig(t, "agent.kubeconfig", tok.Status.Token)
	b, err := yaml.Marshal(cfg)
	if err != nil {
		t.Fatal(err)
	}
	f := filepath.Join(c.dir, "agent.yaml")
	must(t, os.WriteFile(f, b, 0o600))
	return c.start(t, "agent", "env", "NODE_NAME="+nodeName, *shuntBin, "agent", "--config", f, "--pin-dir", pin)
}

// waitEnabled waits until the agent has installed bypass in pin and
// enabled at least the cgroups want.
func waitEnabled(t testing.TB, pin string, want ...string) *bypass.Install {
	t.Helper()
	var in *bypass.Install
	eventually(t, 30*time.Second, "the agent enables the selected pods", func() error {
		if in == nil {
			var err error
			if in, err = bypass.Open(pin); err != nil {
				return err
			}
		}
		got := enabledPaths(t, in)
		for _, w := range want {
			if !slices.Contains(got, w) {
				return fmt.Errorf("%s not enabled (enabled: %v)", w, got)
			}
		}
		return nil
	})
	t.Cleanup(func() { in.Close() })
	return in
}

func enabledPaths(t testing.TB, in *bypass.Install) []string {
	t.Helper()
	cgs, err := in.Cgroups()
	if err != nil {
		t.Fatal(err)
	}
	var out []string
	for _, cg := range cgs {
		out = append(out, cg.Path)
	}
	return out
}

func counters(t testing.TB, in *bypass.Install) bypass.Counters {
	t.Helper()
	c, err := in.Counters()
	if err != nil {
		t.Fatal(err)
	}
	return c
}

// download fetches url with curl in the pod and compares it with body.
func download(t testing.TB, p *pod, url string, body []byte, curlArgs ...string) error {
	t.Helper()
	out := filepath.Join(t.TempDir(), "got")
	argv := append([]string{"curl", "-sSf", "--max-time", "30", "-o", out}, curlArgs...)
	if msg, err := p.run(t, append(argv, url)...); err != nil {
		return fmt.Errorf("curl %s from %s: %v: %s", url, p.name, err, msg)
	}
	got, err := os.ReadFile(out)
	if err != nil {
		return err
	}
	if !bytes.Equal(got, body) {
		return fmt.Errorf("%s from %s: %d bytes, sha256 %x, want %d bytes, %x", url, p.name, len(got), sha256.Sum256(got), len(body), sha256.Sum256(body))
	}
	return nil
}

// nginxConf serves body as /blob (and an empty /ready) on port 8080.
func nginxConf(t testing.TB, body []byte) string {
	t.Helper()
	dir := t.TempDir()
	www := filepath.Join(dir, "www")
	must(t, os.MkdirAll(www, 0o755))
	must(t, os.WriteFile(filepath.Join(www, "blob"), body, 0o644))
	must(t, os.WriteFile(filepath.Join(www, "ready"), nil, 0o644))
	conf := filepath.Join(dir, "nginx.conf")
	must(t, os.WriteFile(conf, []byte(fmt.Sprintf(`daemon off;
user root; # the files are in the test's private temporary directory
worker_processes 1;
pid %[1]s/nginx.pid;
error_log %[1]s/error.log;
events {}
http {
	access_log off;
	client_body_temp_path %[1]s/body;
	proxy_temp_path %[1]s/proxy;
	fastcgi_temp_path %[1]s/fastcgi;
	uwsgi_temp_path %[1]s/uwsgi;
	scgi_temp_path %[1]s/scgi;
	server { listen 8080; root %[2]s; }
}
`, dir, www)), 0o644))
	return conf
}

// scrape fetches a URL on the node (its namespace's loopback).
func (c *cluster) scrape(url string) (string, error) {
	dial := c.restConfig("").Dial
	hc := &http.Client{Timeout: 10 * time.Second, Transport: &http.Transport{
		DialContext: func(ctx context.Context, network, addr string) (net.Conn, error) { return dial(ctx, network, addr) },
	}}
	defer hc.CloseIdleConnections()
	resp, err := hc.Get(url)
	if err != nil {
		return "", err
	}
	defer resp.Body.Close()
	b, err := io.ReadAll(resp.Body)
	return string(b), err
}

func grep(s, sub string) string {
	var out []string
	for _, l := range strings.Split(s, "\n") {
		if strings.Contains(l, sub) {
			out = append(out, l)
		}
	}
	return strings.Join(out, "\n")
}

// logState logs what the node holds for a test that failed: the Services'
// endpoint slices and kube-proxy's rules.
func (c *cluster) logState(t testing.TB) {
	slices, err := c.client.DiscoveryV1().EndpointSlices(podNamespace).List(context.Background(), metav1.ListOptions{})
	if err == nil {
		for _, s := range slices.Items {
			t.Logf("endpoint slice %s: %+v", s.Name, s.Endpoints)
		}
	}
	for _, cmd := range [][]string{{"nft", "list", "ruleset"}, {"iptables-save"}} {
		out, _ := exec.Command("ip", append([]string{"netns", "exec", c.node.Name}, cmd...)...).CombinedOutput()
		t.Logf("%s on the node:\n%s", cmd[0], tail(out, 8192))
	}
}
