package policy_test

import (
	"strings"
	"testing"

	"github.com/shunt-project/shunt/policy"
)

// FuzzParse: any ruleset file is refused in one line or parsed into a
// ruleset that `policy show` prints back (Marshal) and that parses again to
// one printed the same. `go test` runs the seeds; `make fuzz` searches.
func FuzzParse(f *testing.F) {
	for _, seed := range []string{
		"",
		"scopes: []",
		"scopes: [{cgroup: /sys/fs/cgroup/app}]",
		"scopes: [{cgroup: /sys/fs/cgroup/app, egress_default: deny, egress: [{action: allow, cidr: 10.0.0.0/8, port: 80-90, proto: tcp}]}]",
		"scopes:\n  - cgroup: /sys/fs/cgroup/db\n    ingress_default: deny\n    ingress:\n      - {action: allow, peer_cgroup: /sys/fs/cgroup/web, port: 5432}\n      - {action: deny, cidr: \"::1/128\", proto: udp}\n",
		"scopes: [{cgroup: /a, egress: [{action: deny, cidr: 0.0.0.0/0}, {action: allow, cidr: ::ffff:10.1.2.3/128, port: 53, proto: udp}]}]",
		"---\nscopes: []\n---\n",
		"scopes: [{cgroup: /a, ingress: [{action: deny, cidr: fe80::1%lo/128}]}]",
		"scopes: [{cgroup: /a, egress: [{action: allow, cidr: 10.0.0.0/8, port: 70000}]}]",
	} {
		f.Add([]byte(seed))
	}
	f.Fuzz(func(t *testing.T, b []byte) {
		rs, err := policy.Parse(b)
		if err != nil {
			if strings.Contains(err.Error(), "\n") {
				t.Fatalf("refused in more than one line: %q", err)
			}
			return
		}
		out, err := rs.Marshal()
		if err != nil {
			t.Fatalf("a parsed ruleset does not marshal: %v", err)
		}
		again, err := policy.Parse(out)
		if err != nil {
			t.Fatalf("the ruleset as printed does not parse: %v\n%s", err, out)
		}
		// Compared as printed: an absent list and an empty one are alike.
		if out2, err := again.Marshal(); err != nil || string(out2) != string(out) {
			t.Fatalf("printed and parsed again it changed (%v):\n%s\n%s", err, out, out2)
		}
	})
}
