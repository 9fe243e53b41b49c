package agent_test

import (
	"strings"
	"testing"

	"go.yaml.in/yaml/v3"

	"github.com/shunt-project/shunt/agent"
)

// FuzzParseConfig: any agent configuration is refused in one line, or
// parsed into one that, printed and parsed again, prints the same.
func FuzzParseConfig(f *testing.F) {
	const root = "/sys/fs/cgroup"
	for _, seed := range []string{
		"",
		"bypass: {cgroups: [\"/sys/fs/cgroup/app-*\"], exclude: [/sys/fs/cgroup/app-db]}\nmetrics: {address: \"127.0.0.1:9464\"}",
		"kubernetes: {node_name: n1, namespaces: [shop], labels: {app: web}, annotation: shunt.io/bypass, driver: systemd}",
		"index: {enabled: true}\npolicy: {file: /etc/shunt/policy.yaml}",
		"metrics: {address: \"[::1]:0\", token_file: /etc/shunt/token}",
		"bypass: {cgroups: [app]}",
		"---\n---\n",
	} {
		f.Add([]byte(seed))
	}
	f.Fuzz(func(t *testing.T, b []byte) {
		cfg, err := agent.ParseConfig(b, agent.ConfigEnv{CgroupRoot: root})
		if err != nil {
			if strings.Contains(err.Error(), "\n") {
				t.Fatalf("refused in more than one line: %q", err)
			}
			return
		}
		out, err := yaml.Marshal(cfg)
		if err != nil {
			t.Fatalf("a parsed configuration does not marshal: %v", err)
		}
		again, err := agent.ParseConfig(out, agent.ConfigEnv{CgroupRoot: root})
		if err != nil {
			t.Fatalf("the configuration as printed does not parse: %v\n%s", err, out)
		}
		if out2, err := yaml.Marshal(again); err != nil || string(out2) != string(out) {
			t.Fatalf("printed and parsed again it changed (%v):\n%s\n%s", err, out, out2)
		}
	})
}
