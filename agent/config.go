// Package agent is shunt's node agent: it holds the machine to a declared
// state (which cgroups are bypassed, whether the socket index runs, where
// metrics are served) and keeps it there as cgroups come and go and the
// configuration changes. State stays pinned in bpffs: stopping the agent
// leaves bypass as it is.
package agent

import (
	"bytes"
	"context"
	"errors"
	"fmt"
	"io"
	"net"
	"net/netip"
	"path"
	"path/filepath"
	"strconv"
	"strings"

	"go.yaml.in/yaml/v3"
	"k8s.io/apimachinery/pkg/labels"
	"k8s.io/apimachinery/pkg/util/validation"

	"github.com/shunt-project/shunt/internal/readlimit"
	"github.com/shunt-project/shunt/metrics"
)

// Config is the agent's configuration file (docs/AGENT.md).
type Config struct {
	Bypass     BypassConfig      `yaml:"bypass"`
	Kubernetes *KubernetesConfig `yaml:"kubernetes"`
	Index      IndexConfig       `yaml:"index"`
	Policy     PolicyConfig      `yaml:"policy"`
	Metrics    MetricsConfig     `yaml:"metrics"`
}

// PolicyConfig names the egress policy the agent holds the machine to.
type PolicyConfig struct {
	// File is a ruleset (docs/POLICY.md), applied whole whenever it or the
	// set of its scopes' cgroups that exist changes. "" leaves the policy
	// as it is: removal is explicit (shunt policy clear).
	File string `yaml:"file"`
}

// KubernetesConfig selects pods of this node, through the API server, whose
// cgroups are bypassed besides bypass.cgroups.
type KubernetesConfig struct {
	NodeName   string            `yaml:"node_name"`   // default: $NODE_NAME (the downward API)
	Kubeconfig string            `yaml:"kubeconfig"`  // default: the in-cluster service account
	Namespaces []string          `yaml:"namespaces"`  // empty: every namespace
	Labels     map[string]string `yaml:"labels"`      // each must match
	Annotation string            `yaml:"annotation"`  // if set: must be "true" on the pod
	CgroupRoot string            `yaml:"cgroup_root"` // where kubelet's cgroups are: default, the cgroup v2 root
	Driver     string            `yaml:"driver"`      // kubelet's cgroup driver: systemd, cgroupfs, or empty to tell from the tree
	// DaemonSet is NAMESPACE/NAME of the DaemonSet the agent runs in: when
	// the agent stops and that DaemonSet is gone (helm uninstall, kubectl
	// delete), it takes shunt off the node; a rollout keeps it. Empty:
	// shunt stays whenever the agent stops.
	DaemonSet string `yaml:"daemonset"`
}

// BypassConfig says which cgroups are bypassed.
type BypassConfig struct {
	// Cgroups are cgroup v2 directories, or shell patterns of them
	// (path.Match: *, ?, [...] within one path component), each absolute.
	Cgroups []string `yaml:"cgroups"`
	// Exclude are patterns of cgroups never enabled, even if Cgroups
	// match them.
	Exclude []string `yaml:"exclude"`
	// Guard runs the guard in the agent (default true): it resets
	// connections of splice readers that would otherwise wait for ever.
	Guard *bool `yaml:"guard"`
}

// IndexConfig says whether the socket index runs.
type IndexConfig struct {
	// Enabled: the agent enables the index (whole host) if it is not.
	// false leaves it as it is: removal is explicit (shunt index disable).
	Enabled bool `yaml:"enabled"`
}

// MetricsConfig says where metrics are served.
type MetricsConfig struct {
	Address string `yaml:"address"` // HOST:PORT; "" serves none
	// TokenFile holds a bearer token every scrape must send (docs/SECURITY.md:
	// the metrics name every policy rule and cgroup path); "" asks none.
	TokenFile string `yaml:"token_file"`
}

// GuardOn says whether the agent runs the guard.
func (c *Config) GuardOn() bool { return c.Bypass.Guard == nil || *c.Bypass.Guard }

// MaxConfigSize bounds the configuration file: a path to a device or an
// endless file is refused, not read into memory.
const MaxConfigSize = 1 << 20

// ConfigEnv is what a configuration's checks and defaults depend on
// outside the file, resolved once by the caller.
type ConfigEnv struct {
	CgroupRoot string // where cgroup v2 is mounted
	// NodeName is kubernetes.node_name's default: the DaemonSet sets
	// NODE_NAME from spec.nodeName, which the command line passes here.
	NodeName string
}

// LoadConfig reads and checks the configuration at file. Its errors are
// one line naming the file and the field.
func LoadConfig(file string, env ConfigEnv) (*Config, error) {
	b, err := readlimit.File(context.Background(), file, MaxConfigSize)
	if err != nil {
		return nil, fmt.Errorf("config %s: %w", file, err)
	}
	cfg, err := ParseConfig(b, env)
	if err != nil {
		return nil, fmt.Errorf("config %s: %w", file, err)
	}
	return cfg, nil
}

// CheckConfig loads the configuration at file and everything it names that
// start would refuse (the policy file), so that `agent --check` and start
// agree.
func CheckConfig(file string, env ConfigEnv) (*Config, error) {
	cfg, err := LoadConfig(file, env)
	if err != nil {
		return nil, err
	}
	if cfg.Policy.File != "" {
		if _, err := loadPolicy(cfg.Policy.File); err != nil {
			return nil, err
		}
	}
	if f := cfg.Metrics.TokenFile; f != "" {
		if _, err := metrics.ReadToken(f); err != nil {
			return nil, fmt.Errorf("metrics.token_file: %w", err)
		}
	}
	return cfg, nil
}

// ParseConfig parses and checks a configuration. Unknown fields are errors:
// a misspelt key must not silently mean "nothing".
func ParseConfig(b []byte, env ConfigEnv) (*Config, error) {
	cgroupRoot := env.CgroupRoot
	var cfg Config
	dec := yaml.NewDecoder(bytes.NewReader(b))
	dec.KnownFields(true)
	// An empty file asks for nothing (io.EOF).
	if err := dec.Decode(&cfg); err != nil && !errors.Is(err, io.EOF) {
		return nil, errors.New(oneLine(err.Error()))
	}
	// A second document would be ignored: the configuration is one.
	var more yaml.Node
	if err := dec.Decode(&more); err == nil {
		return nil, fmt.Errorf("line %d: a second YAML document (after ---): the configuration is one", more.Line)
	} else if !errors.Is(err, io.EOF) {
		return nil, errors.New(oneLine(err.Error()))
	}
	for i, p := range cfg.Bypass.Cgroups {
		if err := checkPattern(p, cgroupRoot); err != nil {
			return nil, fmt.Errorf("bypass.cgroups[%d]: %w", i, err)
		}
	}
	for i, p := range cfg.Bypass.Exclude {
		if err := checkPattern(p, cgroupRoot); err != nil {
			return nil, fmt.Errorf("bypass.exclude[%d]: %w", i, err)
		}
	}
	if k := cfg.Kubernetes; k != nil {
		if err := checkKubernetes(k, env); err != nil {
			return nil, err
		}
	}
	if f := cfg.Policy.File; f != "" && !filepath.IsAbs(f) {
		return nil, fmt.Errorf("policy.file: %q is not an absolute path", f)
	}
	if a := cfg.Metrics.Address; a != "" {
		if err := checkListenAddress(a); err != nil {
			return nil, fmt.Errorf("metrics.address: %w", err)
		}
	}
	if f := cfg.Metrics.TokenFile; f != "" && !filepath.IsAbs(f) {
		return nil, fmt.Errorf("metrics.token_file: %q is not an absolute path", f)
	}
	return &cfg, nil
}

// checkListenAddress refuses what net.Listen would, before the agent has
// changed anything: HOST:PORT, a port of 0 to 65535, the host an IP
// address, "localhost" or empty (every address).
func checkListenAddress(a string) error {
	host, port, err := net.SplitHostPort(a)
	if err != nil {
		return fmt.Errorf("%q is not HOST:PORT (e.g. 127.0.0.1:9464)", a)
	}
	if _, err := strconv.ParseUint(port, 10, 16); err != nil {
		return fmt.Errorf("%q: port %q is not a number from 0 to 65535", a, port)
	}
	if _, err := netip.ParseAddr(host); host != "" && host != "localhost" && err != nil {
		return fmt.Errorf("%q: host %q is not an IP address (give one, or none for every address)", a, host)
	}
	return nil
}

// sections name the Go types yaml's errors mention as the file's sections,
// with the fields each takes.
var sections = strings.NewReplacer(
	"in type agent.Config", "at the top (it takes bypass, kubernetes, index, policy, metrics)",
	"in type agent.PolicyConfig", "in policy (it takes file)",
	"in type agent.BypassConfig", "in bypass (it takes cgroups, exclude, guard)",
	"in type agent.IndexConfig", "in index (it takes enabled)",
	"in type agent.KubernetesConfig", "in kubernetes (it takes node_name, kubeconfig, namespaces, labels, annotation, cgroup_root, driver, daemonset)",
	"in type agent.MetricsConfig", "in metrics (it takes address, token_file)",
)

// oneLine folds yaml's multi-line errors ("yaml: unmarshal errors:\n  line 3: ...").
func oneLine(s string) string {
	s = strings.TrimPrefix(s, "yaml: ")
	s = strings.ReplaceAll(s, "unmarshal errors:\n", "")
	return sections.Replace(strings.Join(strings.Fields(s), " "))
}

// checkPattern: absolute, within the cgroup v2 hierarchy, a valid pattern.
func checkPattern(p, cgroupRoot string) error {
	if !filepath.IsAbs(p) {
		return fmt.Errorf("%q is not an absolute path (cgroup v2 is mounted at %s)", p, cgroupRoot)
	}
	if filepath.Clean(p) != p && filepath.Clean(p)+"/" != p {
		return fmt.Errorf("%q is not a clean path (write %s)", p, filepath.Clean(p))
	}
	if p != cgroupRoot && !strings.HasPrefix(p, cgroupRoot+"/") {
		return fmt.Errorf("%q is outside the cgroup v2 hierarchy, mounted at %s", p, cgroupRoot)
	}
	if _, err := path.Match(p, ""); err != nil {
		return fmt.Errorf("%q is not a valid pattern: %w", p, err)
	}
	return nil
}

func checkKubernetes(k *KubernetesConfig, env ConfigEnv) error {
	cgroupRoot := env.CgroupRoot
	if k.NodeName == "" {
		k.NodeName = env.NodeName
	}
	if k.NodeName == "" {
		return errors.New("kubernetes.node_name: empty, and NODE_NAME is not set (the DaemonSet sets it from spec.nodeName)")
	}
	if k.CgroupRoot == "" {
		k.CgroupRoot = cgroupRoot
	}
	if err := checkPattern(k.CgroupRoot, cgroupRoot); err != nil || hasMeta(k.CgroupRoot) {
		return fmt.Errorf("kubernetes.cgroup_root: %q is not a directory of the cgroup v2 hierarchy (mounted at %s)", k.CgroupRoot, cgroupRoot)
	}
	switch k.Driver {
	case "", "systemd", "cgroupfs":
	default:
		return fmt.Errorf("kubernetes.driver: %q is not systemd, cgroupfs or empty (told from the tree)", k.Driver)
	}
	if _, err := labels.ValidatedSelectorFromSet(k.Labels); err != nil {
		return fmt.Errorf("kubernetes.labels: %w", err)
	}
	if k.DaemonSet != "" {
		ns, name, ok := strings.Cut(k.DaemonSet, "/")
		if !ok || len(validation.IsDNS1123Label(ns)) > 0 || len(validation.IsDNS1123Subdomain(name)) > 0 {
			return fmt.Errorf("kubernetes.daemonset: %q is not NAMESPACE/NAME (e.g. shunt-system/shunt-agent)", k.DaemonSet)
		}
	}
	return nil
}
