//go:build k8snode

package k8snode_test

import (
	"context"
	"crypto/ecdsa"
	"crypto/elliptic"
	"crypto/rand"
	"crypto/x509"
	"crypto/x509/pkix"
	"encoding/pem"
	"fmt"
	"math/big"
	"net"
	"os"
	"os/exec"
	"path/filepath"
	"strings"
	"testing"
	"time"

	"k8s.io/client-go/kubernetes"
	"k8s.io/client-go/rest"

	"github.com/shunt-project/shunt/internal/testenv"
)

// The node's addresses: its own on loopback (the API server
// advertises it, kube-proxy finds it in the Node object), the Services' and
// the pods' (each pod a link of its own, 10.201-10.203).
const (
	nodeName    = "shunt-test-node"
	nodeIP      = "10.199.0.1"
	serviceCIDR = "10.96.0.0/16"
	clusterCIDR = "10.200.0.0/14" // the pods' links: 10.201-10.203
	adminToken  = "shunt-test-admin"
)

// cluster is a control plane running in the node's namespace: etcd, the
// API server, the controller manager's endpoint slice and service account
// controllers, and kube-proxy. No kubelet: the test makes what it would
// (pod cgroups and namespaces, pod status).
type cluster struct {
	node   *testenv.NetNS
	mnt    string    // the node's mount namespace (a bind mount of it), if it has one
	init   *nodeInit // the node's systemd, if it has one
	dir    string
	config *rest.Config // the admin's
	client *kubernetes.Clientset
	ca     []byte
}

// start runs a program of the node until the test ends (or it is
// stopped); its output is logged when the test failed.
func (c *cluster) start(t testing.TB, name string, argv ...string) *testenv.Process {
	t.Helper()
	// nsenter, not ip netns exec: that remounts /sys for the namespace,
	// which hides bpffs and the cgroup hierarchy from the agent.
	enter := []string{"--net=/run/netns/" + c.node.Name}
	if c.mnt != "" {
		enter = append(enter, "--mount="+c.mnt)
	}
	if c.init != nil {
		return c.init.start(t, name, enter, argv)
	}
	return testenv.Start(t, name, exec.Command("nsenter", append(append(enter, "--"), argv...)...))
}

func tail(b []byte, n int) []byte {
	if len(b) > n {
		return b[len(b)-n:]
	}
	return b
}

// startCluster brings the control plane up in node and waits until the API
// server answers. The controller manager runs the service account and
// endpoint slice controllers, and those named.
func startCluster(t testing.TB, node *testenv.NetNS, controllers ...string) *cluster {
	t.Helper()
	c := &cluster{node: node, dir: t.TempDir()}
	// The node routes between its pods' links, as a CNI plugin has it do.
	if out, err := exec.Command("ip", "netns", "exec", node.Name, "sysctl", "-qw",
		"net.ipv4.ip_forward=1", "net.ipv6.conf.all.forwarding=1").CombinedOutput(); err != nil {
		t.Fatalf("forwarding on the node: %v: %s", err, out)
	}
	node.IP(t, "addr", "add", nodeIP+"/32", "dev", "lo")
	c.writePKI(t)
	tokens := filepath.Join(c.dir, "tokens.csv")
	must(t, os.WriteFile(tokens, []byte(adminToken+",admin,admin,system:masters\n"), 0o600))
	kubeconfig := c.kubeconfig(t, "admin.kubeconfig", adminToken)

	c.start(t, "etcd", bin("etcd"), "--data-dir", filepath.Join(c.dir, "etcd"),
		"--listen-client-urls", "http://127.0.0.1:2379", "--advertise-client-urls", "http://127.0.0.1:2379",
		"--listen-peer-urls", "http://127.0.0.1:2380", "--initial-advertise-peer-urls", "http://127.0.0.1:2380",
		"--initial-cluster", "default=http://127.0.0.1:2380", "--log-level", "warn")
	c.start(t, "kube-apiserver", bin("kube-apiserver"),
		"--etcd-servers", "http://127.0.0.1:2379",
		"--bind-address", "0.0.0.0", "--secure-port", "6443", "--advertise-address", nodeIP,
		"--tls-cert-file", filepath.Join(c.dir, "apiserver.crt"), "--tls-private-key-file", filepath.Join(c.dir, "apiserver.key"),
		"--token-auth-file", tokens, "--authorization-mode", "RBAC",
		"--service-account-issuer", "https://kubernetes.default.svc",
		"--service-account-key-file", filepath.Join(c.dir, "sa.key"),
		"--service-account-signing-key-file", filepath.Join(c.dir, "sa.key"),
		"--service-cluster-ip-range", serviceCIDR,
		"--allow-privileged")
	c.config = c.restConfig(adminToken)
	cs, err := kubernetes.NewForConfig(c.config)
	if err != nil {
		t.Fatal(err)
	}
	c.client = cs
	c.waitReady(t)
	c.start(t, "kube-controller-manager", bin("kube-controller-manager"),
		"--kubeconfig", kubeconfig, "--leader-elect=false",
		"--controllers", strings.Join(append([]string{"serviceaccount", "endpointslice"}, controllers...), ","),
		"--root-ca-file", filepath.Join(c.dir, "ca.crt"), // the kube-root-ca.crt ConfigMaps
		"--bind-address", "127.0.0.1", "--secure-port", "10257",
		"--cluster-cidr", clusterCIDR, "--service-cluster-ip-range", serviceCIDR)
	return c
}

// startProxy runs kube-proxy in mode (nftables or iptables) with the
// admin's credentials.
func (c *cluster) startProxy(t testing.TB, mode string) {
	t.Helper()
	cfg := filepath.Join(c.dir, "kube-proxy.yaml")
	must(t, os.WriteFile(cfg, []byte(fmt.Sprintf(`apiVersion: kubeproxy.config.k8s.io/v1alpha1
kind: KubeProxyConfiguration
mode: %s
hostnameOverride: %s
clusterCIDR: %s
clientConnection: {kubeconfig: %s}
# Leave the host's conntrack settings alone: this node is a namespace.
conntrack: {maxPerCore: 0, min: 0, tcpEstablishedTimeout: 0s, tcpCloseWaitTimeout: 0s}
metricsBindAddress: 127.0.0.1:10249
healthzBindAddress: 127.0.0.1:10256
`, mode, nodeName, clusterCIDR, c.kubeconfig(t, "proxy.kubeconfig", adminToken))), 0o600))
	c.start(t, "kube-proxy-"+mode, bin("kube-proxy"), "--config", cfg)
}

func (c *cluster) waitReady(t testing.TB) {
	t.Helper()
	deadline := time.Now().Add(90 * time.Second)
	var err error
	for time.Now().Before(deadline) {
		var b []byte
		b, err = c.client.Discovery().RESTClient().Get().AbsPath("/readyz").DoRaw(context.Background())
		if err == nil && string(b) == "ok" {
			return
		}
		time.Sleep(500 * time.Millisecond)
	}
	t.Fatalf("the API server is not ready after 90 s: %v", err)
}

// restConfig reaches the API server in the node's namespace: its sockets
// are made there, wherever the client runs.
func (c *cluster) restConfig(token string) *rest.Config {
	node := c.node
	return &rest.Config{
		Host:        "https://127.0.0.1:6443",
		BearerToken: token,
		// client-go's default, 5 requests a second, would throttle the
		// benchmark's pod creations.
		QPS: 1000, Burst: 1000,
		TLSClientConfig: rest.TLSClientConfig{CAData: c.ca},
		Dial: func(ctx context.Context, network, addr string) (net.Conn, error) {
			var conn net.Conn
			var err error
			if nerr := node.NetNS.Do(func() error {
				conn, err = (&net.Dialer{}).DialContext(ctx, network, addr)
				return nil
			}); nerr != nil {
				return nil, nerr
			}
			return conn, err
		},
	}
}

// kubeconfig writes a kubeconfig that authenticates with token.
func (c *cluster) kubeconfig(t testing.TB, name, token string) string {
	t.Helper()
	ca := filepath.Join(c.dir, "ca.crt")
	f := filepath.Join(c.dir, name)
	must(t, os.WriteFile(f, []byte(fmt.Sprintf(`apiVersion: v1
kind: Config
clusters: [{name: node, cluster: {server: "https://127.0.0.1:6443", certificate-authority: %s}}]
users: [{name: u, user: {token: %s}}]
contexts: [{name: c, context: {cluster: node, user: u}}]
current-context: c
`, ca, token)), 0o600))
	return f
}

// writePKI makes a CA, the API server's serving certificate (127.0.0.1,
// the node's address and the kubernetes Service's) and the service
// account signing key.
func (c *cluster) writePKI(t testing.TB) {
	t.Helper()
	caKey := newKey(t)
	caTmpl := &x509.Certificate{
		SerialNumber: big.NewInt(1), Subject: pkix.Name{CommonName: "shunt-test-ca"},
		NotBefore: time.Now().Add(-time.Hour), NotAfter: time.Now().Add(24 * time.Hour),
		IsCA: true, BasicConstraintsValid: true, KeyUsage: x509.KeyUsageCertSign,
	}
	caDER, err := x509.CreateCertificate(rand.Reader, caTmpl, caTmpl, &caKey.PublicKey, caKey)
	if err != nil {
		t.Fatal(err)
	}
	caCert, err := x509.ParseCertificate(caDER)
	if err != nil {
		t.Fatal(err)
	}
	c.ca = pem.EncodeToMemory(&pem.Block{Type: "CERTIFICATE", Bytes: caDER})
	must(t, os.WriteFile(filepath.Join(c.dir, "ca.crt"), c.ca, 0o600))

	key := newKey(t)
	tmpl := &x509.Certificate{
		SerialNumber: big.NewInt(2), Subject: pkix.Name{CommonName: "kube-apiserver"},
		NotBefore: time.Now().Add(-time.Hour), NotAfter: time.Now().Add(24 * time.Hour),
		KeyUsage: x509.KeyUsageDigitalSignature, ExtKeyUsage: []x509.ExtKeyUsage{x509.ExtKeyUsageServerAuth},
		IPAddresses: []net.IP{net.ParseIP("127.0.0.1"), net.ParseIP(nodeIP), net.ParseIP("10.96.0.1")},
		DNSNames:    []string{"localhost", "kubernetes", "kubernetes.default.svc"},
	}
	der, err := x509.CreateCertificate(rand.Reader, tmpl, caCert, &key.PublicKey, caKey)
	if err != nil {
		t.Fatal(err)
	}
	must(t, os.WriteFile(filepath.Join(c.dir, "apiserver.crt"), pem.EncodeToMemory(&pem.Block{Type: "CERTIFICATE", Bytes: der}), 0o600))
	writeKey(t, filepath.Join(c.dir, "apiserver.key"), key)
	writeKey(t, filepath.Join(c.dir, "sa.key"), newKey(t))
}

func newKey(t testing.TB) *ecdsa.PrivateKey {
	t.Helper()
	k, err := ecdsa.GenerateKey(elliptic.P256(), rand.Reader)
	if err != nil {
		t.Fatal(err)
	}
	return k
}

func writeKey(t testing.TB, f string, k *ecdsa.PrivateKey) {
	t.Helper()
	der, err := x509.MarshalECPrivateKey(k)
	if err != nil {
		t.Fatal(err)
	}
	must(t, os.WriteFile(f, pem.EncodeToMemory(&pem.Block{Type: "EC PRIVATE KEY", Bytes: der}), 0o600))
}

func must(t testing.TB, err error) {
	t.Helper()
	if err != nil {
		t.Fatal(err)
	}
}

// bin is a Kubernetes program built by scripts/k8s.sh.
func bin(name string) string { return filepath.Join(*k8sBin, name) }
