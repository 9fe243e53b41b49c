package main

import (
	"bytes"
	"encoding/json"
	"net/netip"
	"os"
	"path/filepath"
	"strings"
	"syscall"
	"testing"
	"time"

	"github.com/shunt-project/shunt/bypass/bypasstest"
	"github.com/shunt-project/shunt/internal/testenv"
	"github.com/shunt-project/shunt/policy"
)

// TestPolicyCommands drives add, default, show, delete, apply and clear.
func TestPolicyCommands(t *testing.T) {
	testenv.RequireRoot(t)
	dir := bypasstest.MustPinDir(t)
	cg := testenv.MustCgroup(t)
	must := func(args ...string) string {
		t.Helper()
		out, stderr, code := runShunt(t, nil, append(args, "--policy-dir", dir)...)
		if code != 0 {
			t.Fatalf("shunt %v: exit %d: %s", args, code, stderr)
		}
		return out
	}
	show := func() policy.Report {
		t.Helper()
		var rep policy.Report
		if err := json.Unmarshal([]byte(must("policy", "show", "--json")), &rep); err != nil {
			t.Fatal(err)
		}
		return rep
	}
	if out := must("policy", "show"); !strings.Contains(out, "no policy") {
		t.Errorf("show before any rule: %q", out)
	}
	must("policy", "add", "--cgroup", cg.Path, "--action", "deny", "--cidr", "10.1.0.0/16", "--port", "80-81", "--proto", "tcp")
	must("policy", "add", "--cgroup", cg.Path, "--action", "allow", "--cidr", "fd00::1")
	must("policy", "default", "--cgroup", cg.Path, "deny")
	rep := show()
	if len(rep.Scopes) != 1 || rep.Scopes[0].Cgroup != cg.Path || rep.Scopes[0].Egress.Default != policy.Deny || len(rep.Scopes[0].Egress.Rules) != 2 {
		t.Fatalf("show after add: %+v", rep)
	}
	if r := rep.Scopes[0].Egress.Rules[0]; r.CIDR.String() != "10.1.0.0/16" || r.Ports != (policy.Ports{Lo: 80, Hi: 81}) || r.Proto != policy.TCP || r.Action != policy.Deny {
		t.Errorf("first rule: %+v", r)
	}
	if out := must("policy", "show"); !strings.Contains(out, "10.1.0.0/16") || !strings.Contains(out, "(default)") {
		t.Errorf("show: %q", out)
	}
	must("policy", "delete", "--cgroup", cg.Path, "--action", "deny", "--cidr", "10.1.0.0/16", "--port", "80-81", "--proto", "tcp")
	if rep := show(); len(rep.Scopes[0].Egress.Rules) != 1 || rep.Scopes[0].Egress.Rules[0].CIDR.String() != "fd00::1/128" {
		t.Errorf("show after delete: %+v", rep)
	}

	// apply replaces everything, and a file written from show reads back.
	f := filepath.Join(t.TempDir(), "policy.yaml")
	rs := show().Ruleset()
	rs.Scopes[0].Egress = append(rs.Scopes[0].Egress, policy.Rule{Action: policy.Allow, CIDR: mustPrefix(t, "192.0.2.0/24"), Ports: policy.Ports{Lo: 53, Hi: 53}, Proto: policy.UDP})
	b, err := rs.Marshal()
	if err != nil {
		t.Fatal(err)
	}
	os.WriteFile(f, b, 0o644)
	must("policy", "apply", "-f", f)
	if rep := show(); len(rep.Scopes[0].Egress.Rules) != 2 {
		t.Errorf("show after apply: %+v", rep)
	}

	// A peer rule: shown by its cgroup, and kept when another change
	// rewrites the ruleset from show.
	peer := testenv.MustCgroup(t)
	must("policy", "add", "--cgroup", cg.Path, "--direction", "ingress", "--action", "allow", "--peer-cgroup", peer.Path, "--port", "80")
	must("policy", "add", "--cgroup", cg.Path, "--action", "deny", "--cidr", "10.2.0.0/16")
	if rep := show(); len(rep.Scopes[0].Ingress.Rules) != 1 || rep.Scopes[0].Ingress.Rules[0].Peer != peer.Path {
		t.Errorf("show after adding a peer rule: %+v", rep.Scopes[0].Ingress)
	}
	if out := must("policy", "show"); !strings.Contains(out, "cgroup "+peer.Path) {
		t.Errorf("show: %q", out)
	}
	must("policy", "delete", "--cgroup", cg.Path, "--direction", "ingress", "--action", "allow", "--peer-cgroup", peer.Path, "--port", "80")
	if rep := show(); len(rep.Scopes[0].Ingress.Rules) != 0 {
		t.Errorf("show after deleting the peer rule: %+v", rep.Scopes[0].Ingress)
	}

	must("policy", "clear", "--cgroup", cg.Path)
	if rep := show(); len(rep.Scopes) != 0 {
		t.Errorf("show after clear --cgroup: %+v", rep)
	}
	must("policy", "clear")
	if _, err := os.Stat(dir); !os.IsNotExist(err) {
		t.Errorf("%s is still there after clear", dir)
	}
}

// TestPolicyBadInput: one line naming the rule and field, exit 2, nothing
// applied.
func TestPolicyBadInput(t *testing.T) {
	testenv.RequireRoot(t)
	dir := bypasstest.MustPinDir(t)
	cg := testenv.MustCgroup(t)
	file := func(text string) string {
		f := filepath.Join(t.TempDir(), "policy.yaml")
		os.WriteFile(f, []byte(strings.ReplaceAll(text, "CG", cg.Path)), 0o644)
		return f
	}
	for _, c := range []struct {
		name string
		args []string
		want string
	}{
		{"malformed cidr flag", []string{"add", "--cgroup", cg.Path, "--action", "deny", "--cidr", "10.0.0.300/8"}, `--cidr: "10.0.0.300/8" is not an address prefix`},
		{"host bits", []string{"add", "--cgroup", cg.Path, "--action", "deny", "--cidr", "10.1.2.3/8"}, "egress rule 1: cidr: 10.1.2.3/8 has bits set past its prefix length: did you mean 10.0.0.0/8?"},
		{"port out of range", []string{"add", "--cgroup", cg.Path, "--action", "deny", "--cidr", "10.0.0.0/8", "--port", "70000"}, `--port: "70000" is not a port or range`},
		{"empty range", []string{"add", "--cgroup", cg.Path, "--action", "deny", "--cidr", "10.0.0.0/8", "--port", "90-80"}, "is an empty range"},
		{"missing cgroup", []string{"add", "--cgroup", cg.Path + "-nope", "--action", "deny", "--cidr", "10.0.0.0/8"}, "--cgroup: cgroup " + cg.Path + "-nope does not exist"},
		{"bad action", []string{"add", "--cgroup", cg.Path, "--action", "drop", "--cidr", "10.0.0.0/8"}, `--action: "drop" is not an action`},
		{"direction", []string{"add", "--cgroup", cg.Path, "--direction", "inbound", "--action", "deny", "--cidr", "10.0.0.0/8"}, `--direction: "inbound" is not a direction: egress or ingress`},
		{"unknown field", []string{"apply", "-f", file("scopes:\n  - cgroup: CG\n    egress: [{action: deny, cidr: 10.0.0.0/8, ports: 80}]\n")}, "field ports not found"},
		{"file: port", []string{"apply", "-f", file("scopes:\n  - cgroup: CG\n    egress:\n      - {action: deny, cidr: 10.0.0.0/8}\n      - {action: deny, cidr: 10.0.0.0/8, port: 0}\n")}, `"0" is not a port or range`},
		{"file: missing cgroup", []string{"apply", "-f", file("scopes:\n  - cgroup: CG\n  - cgroup: CG-nope\n")}, "scope 2: cgroup: cgroup " + cg.Path + "-nope does not exist"},
		{"file: mapped", []string{"apply", "-f", file("scopes:\n  - cgroup: CG\n    egress: [{action: deny, cidr: \"::ffff:10.0.0.0/104\"}]\n")}, "scope 1 (" + cg.Path + ") egress rule 1: cidr: ::ffff:10.0.0.0/104 is IPv4-mapped: write it as IPv4 (10.0.0.0/8)"},
		{"peer egress", []string{"add", "--cgroup", cg.Path, "--action", "allow", "--peer-cgroup", cg.Path}, "--peer-cgroup: only ingress rules name a peer's cgroup"},
		{"peer and cidr", []string{"add", "--cgroup", cg.Path, "--direction", "ingress", "--action", "allow", "--peer-cgroup", cg.Path, "--cidr", "10.0.0.0/8"}, "--peer-cgroup: give --cidr or --peer-cgroup, not both"},
		{"missing peer", []string{"add", "--cgroup", cg.Path, "--direction", "ingress", "--action", "allow", "--peer-cgroup", cg.Path + "-nope"}, "--peer-cgroup: cgroup " + cg.Path + "-nope does not exist"},
		{"file: missing peer", []string{"apply", "-f", file("scopes:\n  - cgroup: CG\n    ingress: [{action: allow, peer_cgroup: CG-nope}]\n")}, "scope 1 (" + cg.Path + ") ingress rule 1: peer_cgroup: cgroup " + cg.Path + "-nope does not exist"},
		{"file: peer egress", []string{"apply", "-f", file("scopes:\n  - cgroup: CG\n    egress: [{action: allow, peer_cgroup: CG}]\n")}, "egress rule 1: peer_cgroup: only ingress rules name a peer's cgroup"},
		{"file: second document", []string{"apply", "-f", file("scopes:\n  - cgroup: CG\n---\nscopes: []\n")}, "line 3: a second YAML document (after ---): a ruleset file holds one"},
		{"file: zone", []string{"apply", "-f", file("scopes:\n  - cgroup: CG\n    egress: [{action: deny, cidr: \"fe80::1%lo\"}]\n")}, `"fe80::1%lo" names an interface (%lo): rules match addresses on every interface; give the address alone`},
		{"file: endless", []string{"apply", "-f", "/dev/zero"}, "-f /dev/zero: more than 8 MiB"},
		{"file: duplicate", []string{"apply", "-f", file("scopes:\n  - cgroup: CG\n    egress: [{action: deny, cidr: 10.0.0.0/8}, {action: deny, cidr: 10.0.0.0/8, port: any}]\n")}, "egress rule 2: same as rule 1"},
	} {
		t.Run(c.name, func(t *testing.T) {
			_, stderr, code := runShunt(t, nil, append(append([]string{"policy"}, c.args...), "--policy-dir", dir)...)
			if code != 2 {
				t.Errorf("exit %d, want 2", code)
			}
			oneLine(t, stderr, c.want)
			if _, err := os.Stat(dir); !os.IsNotExist(err) {
				t.Errorf("%s exists after a refused change", dir)
			}
		})
	}
}

func mustPrefix(t *testing.T, s string) netip.Prefix {
	t.Helper()
	p, err := netip.ParsePrefix(s)
	if err != nil {
		t.Fatal(err)
	}
	return p
}

// `policy apply -f FIFO` with nobody writing, or `-f -` with nothing on
// standard input, ends on SIGINT (exit 130) instead of waiting for ever:
// before, every command trapped SIGINT for its whole run and only SIGKILL
// ended it.
func TestPolicyApplyInterruptedWhileReading(t *testing.T) {
	testenv.RequireRoot(t)
	fifo := filepath.Join(t.TempDir(), "fifo")
	if err := syscall.Mkfifo(fifo, 0o600); err != nil {
		t.Fatal(err)
	}
	for name, args := range map[string][]string{"fifo": {"-f", fifo}, "stdin": {"-f", "-"}} {
		t.Run(name, func(t *testing.T) {
			cmd := subprocess(shuntBinary(t), append([]string{"policy", "apply", "--policy-dir", bypasstest.MustPinDir(t)}, args...)...)
			stdin, err := cmd.StdinPipe() // open, never written
			if err != nil {
				t.Fatal(err)
			}
			defer stdin.Close()
			var stderr bytes.Buffer
			cmd.Stderr = &stderr
			if err := cmd.Start(); err != nil {
				t.Fatal(err)
			}
			time.Sleep(300 * time.Millisecond)
			cmd.Process.Signal(os.Interrupt)
			done := make(chan error, 1)
			go func() { done <- cmd.Wait() }()
			select {
			case <-done:
			case <-time.After(5 * time.Second):
				cmd.Process.Kill()
				<-done
				t.Fatalf("still waiting 5 s after SIGINT")
			}
			if code := cmd.ProcessState.ExitCode(); code != 130 {
				t.Errorf("exit %d, want 130; stderr %q", code, stderr.String())
			}
			oneLine(t, stderr.String(), "interrupted")
		})
	}
}
