package main

import (
	"encoding/json"
	"fmt"
	"os"
	"os/exec"
	"strings"
	"syscall"
	"testing"

	"github.com/cilium/ebpf"
	"github.com/cilium/ebpf/link"

	"github.com/shunt-project/shunt/bypass"
	"github.com/shunt-project/shunt/bypass/bypasstest"
	"github.com/shunt-project/shunt/host"
	"github.com/shunt-project/shunt/internal/testenv"
)

// nothingInstalled checks that a failed command left no state behind.
func nothingInstalled(t *testing.T, pin string, cg host.Cgroup) {
	t.Helper()
	for _, dir := range []string{pin, bypass.LearnedDir(pin)} {
		if _, err := os.Stat(dir); !os.IsNotExist(err) {
			t.Errorf("%s exists after a failed command", dir)
		}
	}
	f, err := os.Open(cg.Path)
	if err != nil {
		t.Fatal(err)
	}
	defer f.Close()
	for _, at := range []ebpf.AttachType{ebpf.AttachCGroupSockOps, ebpf.AttachCGroupSetsockopt, ebpf.AttachCGroupGetsockopt} {
		res, err := link.QueryPrograms(link.QueryOptions{Target: int(f.Fd()), Attach: at})
		if err != nil {
			t.Fatal(err)
		}
		if len(res.Programs) != 0 {
			t.Errorf("%d %v program(s) attached to %s after a failed command", len(res.Programs), at, cg.Path)
		}
	}
}

// Requirement 7: each environment problem gets one line naming the fix, a
// non-zero exit, and nothing installed.
func TestEnableErrors(t *testing.T) {
	testenv.RequireRoot(t)
	pin := bypasstest.MustPinDir(t)
	cg := testenv.MustCgroup(t)
	bin := shuntBinary(t)

	t.Run("not-root", func(t *testing.T) {
		cmd := subprocess(bin, "bypass", "enable", "--cgroup", cg.Path, "--pin-dir", pin)
		cmd.SysProcAttr = &syscall.SysProcAttr{Credential: &syscall.Credential{Uid: 65534, Gid: 65534}}
		out, code := combined(cmd)
		if code != 1 {
			t.Errorf("exit %d, want 1", code)
		}
		oneLine(t, out, "run shunt as root")
		nothingInstalled(t, pin, cg)
	})

	t.Run("no-cgroup-v2", func(t *testing.T) {
		script := fmt.Sprintf("umount -l %s && exec \"$0\" bypass enable --host --pin-dir %s", mustCgroup2Root(t), pin)
		out, code := combined(unshareMount(bin, script))
		if code != 1 {
			t.Errorf("exit %d, want 1", code)
		}
		oneLine(t, out, "no cgroup v2 hierarchy is mounted: mount one with")
		nothingInstalled(t, pin, cg)
	})

	// A cgroup that is not one is the caller's mistake: exit 2, as in
	// policy (it was 1 here and 2 there).
	t.Run("not-a-cgroup", func(t *testing.T) {
		_, stderr, code := runShunt(t, nil, "bypass", "enable", "--cgroup", t.TempDir(), "--pin-dir", pin)
		if code != 2 {
			t.Errorf("exit %d, want 2", code)
		}
		oneLine(t, stderr, "is not a cgroup v2 directory (cgroup v2 is mounted at")
		nothingInstalled(t, pin, cg)
	})

	t.Run("missing-cgroup", func(t *testing.T) {
		_, stderr, code := runShunt(t, nil, "bypass", "enable", "--cgroup", cg.Path+"-nope", "--pin-dir", pin)
		if code != 2 {
			t.Errorf("exit %d, want 2", code)
		}
		oneLine(t, stderr, "does not exist")
		nothingInstalled(t, pin, cg)
	})

	t.Run("bpffs-cannot-be-mounted", func(t *testing.T) {
		// A read-only /sys/fs without bpf/ (cgroup v2 mounted back on it).
		root := mustCgroup2Root(t)
		script := fmt.Sprintf(`mount -t tmpfs none /sys/fs && mkdir -p %[1]s && mount -t cgroup2 none %[1]s &&
mount -o remount,ro /sys/fs && exec "$0" bypass enable --cgroup %[2]s --pin-dir /sys/fs/bpf/%[3]s`,
			root, cg.Path, testenv.Name())
		out, code := combined(unshareMount(bin, script))
		if code != 1 {
			t.Errorf("exit %d, want 1", code)
		}
		oneLine(t, out, "cannot mount bpffs at /sys/fs/bpf")
		oneLine(t, out, "mount -t bpf bpf /sys/fs/bpf")
		nothingInstalled(t, pin, cg)
	})

	t.Run("pin-dir-not-on-bpffs", func(t *testing.T) {
		_, stderr, code := runShunt(t, nil, "bypass", "enable", "--cgroup", cg.Path, "--pin-dir", t.TempDir()+"/shunt")
		if code != 1 {
			t.Errorf("exit %d, want 1", code)
		}
		oneLine(t, stderr, "is not on bpffs")
		nothingInstalled(t, pin, cg)
	})

	t.Run("kernel-without-sockmap", func(t *testing.T) {
		e := defaultEnv()
		e.probe = func() host.Features {
			f := host.Probe()
			f.SockHash, f.SkMsg = false, false
			return f
		}
		_, stderr, code := runShunt(t, e, "bypass", "enable", "--cgroup", cg.Path, "--pin-dir", pin)
		if code != 1 {
			t.Errorf("exit %d, want 1", code)
		}
		oneLine(t, stderr, "cannot run shunt bypass: missing SOCKHASH maps")
		nothingInstalled(t, pin, cg)
	})

	for _, tc := range []struct {
		name    string
		feature func(*host.Features) *bool
		want    string
	}{
		// Neither reader watch: the tracepoint (6.3) nor fexit (which
		// lockdown refuses): the one this kernel has is taken away.
		{"kernel-without-reader-watch", func(f *host.Features) *bool {
			if f.RecvTracepoint {
				f.RecvFexit = false
				return &f.RecvTracepoint
			}
			return &f.RecvFexit
		}, "missing a reader watch: BTF tracepoint programs on sock_recv_length"},
		{"kernel-without-file-iterator", func(f *host.Features) *bool { return &f.FileIterator }, "missing BPF iterators over open files"},
		{"kernel-without-splice-tracepoint", func(f *host.Features) *bool { return &f.SpliceTracepoint }, "missing BTF tracepoint programs on tcp_rcv_space_adjust"},
	} {
		t.Run(tc.name, func(t *testing.T) {
			e := defaultEnv()
			e.probe = func() host.Features {
				f := host.Probe()
				if !*tc.feature(&f) {
					t.Fatalf("this kernel lacks the feature the test takes away: %+v", f)
				}
				*tc.feature(&f) = false
				return f
			}
			_, stderr, code := runShunt(t, e, "bypass", "enable", "--cgroup", cg.Path, "--pin-dir", pin)
			if code != 1 {
				t.Errorf("exit %d, want 1", code)
			}
			oneLine(t, stderr, tc.want)
			nothingInstalled(t, pin, cg)
		})
	}

	for _, tc := range []struct {
		name string
		args []string
		want string
	}{
		{"unknown-flag", []string{"bypass", "enable", "--bogus"}, "unknown flag: --bogus"},
		{"stray-argument", []string{"bypass", "enable", "extra"}, "takes no arguments"},
		{"cgroup-and-all", []string{"bypass", "disable", "--all", "--cgroup", "/x"}, "give either --cgroup PATH, --host (the cgroup v2 root) or --all"},
		{"disable-nothing", []string{"bypass", "disable"}, "give either --cgroup PATH, --host (the cgroup v2 root) or --all"},
		{"no-cgroup-nor-host", []string{"bypass", "enable"}, "--cgroup PATH (a cgroup v2 directory), or --host for every process"},
		{"cgroup-and-host", []string{"bypass", "enable", "--host", "--cgroup", "/x"}, "--cgroup PATH (a cgroup v2 directory), or --host for every process"},
		{"bad-splicer", []string{"bypass", "enable", "--host", "--splicer", "a-name-far-too-long"}, "--splicer: \"a-name-far-too-long\" is not a command name"},
		{"forget-nothing", []string{"bypass", "forget"}, "give one command name or --all"},
		{"unknown-command", []string{"frobnicate"}, "unknown command"},
		{"bad-max-backlog", []string{"bypass", "enable", "--max-backlog", "lots"}, "--max-backlog: want one size"},
		{"empty-splicer", []string{"bypass", "enable", "--host", "--splicer", ""}, `--splicer: "" is not a command name`},
		{"negative-timeout", []string{"bypass", "disable", "--all", "--timeout", "-1s"}, "--timeout -1s: give how long to wait, 0 or more"},
		{"disable-missing-cgroup", []string{"bypass", "disable", "--cgroup", "/sys/fs/cgroup/shunt-test-none"}, "does not exist"},
		{"index-missing-cgroup", []string{"index", "enable", "--cgroup", "/sys/fs/cgroup/shunt-test-none"}, "does not exist"},
		{"completion-unknown-shell", []string{"completion", "tcsh"}, `completion: "tcsh" is not a shell shunt writes a script for: bash, fish, powershell, zsh`},
	} {
		t.Run(tc.name, func(t *testing.T) {
			_, stderr, code := runShunt(t, nil, append(tc.args, "--pin-dir", pin)...)
			if code != 2 {
				t.Errorf("exit %d, want 2", code)
			}
			oneLine(t, stderr, tc.want)
			nothingInstalled(t, pin, cg)
		})
	}
}

// unshareMount runs script in a private mount namespace; $0 is bin.
func unshareMount(bin, script string) *exec.Cmd {
	cmd := exec.Command("unshare", "--mount", "--propagation", "private", "sh", "-ec", script, bin)
	cmd.Env = append(os.Environ(), "SHUNT_TEST_MAIN=1")
	return cmd
}

func combined(cmd *exec.Cmd) (string, int) {
	out, err := cmd.CombinedOutput()
	code := 0
	if ee, ok := err.(*exec.ExitError); ok {
		code = ee.ExitCode()
	} else if err != nil {
		return err.Error(), -1
	}
	return strings.TrimSpace(string(out)) + "\n", code
}

// TestThisKernel: on the kernel the tests run on (the host's, or one of
// `make test-kernels`), bypass either installs and works, with every feature
// named by the mechanism that gives it, or, where the kernel lacks one, enable
// refuses with one line naming what is missing and leaves nothing behind;
// the kernel join and the index do the same, naming the kernel they need.
func TestThisKernel(t *testing.T) {
	testenv.RequireRoot(t)
	pin := bypasstest.MustPinDir(t)
	cg := testenv.MustCgroup(t)
	f := host.Probe()
	t.Logf("kernel %s: %+v", f.Kernel, f)
	stdout, _, code := runShunt(t, nil, "status", "--pin-dir", pin)
	if code != 0 {
		t.Fatalf("status exited %d", code)
	}
	for _, m := range f.Mechanisms() {
		want := m.Via
		if want == "" {
			want = "MISSING"
		}
		if !strings.Contains(stdout, m.Feature+":") || !strings.Contains(stdout, want) {
			t.Errorf("status does not say %q: %q\n%s", m.Feature, want, stdout)
		}
	}
	_, stderr, code := runShunt(t, nil, "bypass", "enable", "--no-guard", "--cgroup", cg.Path, "--pin-dir", pin)
	if missing := f.Err(); missing != nil {
		if code != 1 {
			t.Errorf("enable on a kernel without %v: exit %d, want 1", f.Missing(), code)
		}
		oneLine(t, stderr, missing.Error())
		nothingInstalled(t, pin, cg)
	} else {
		if code != 0 {
			t.Fatalf("enable: exit %d: %s", code, stderr)
		}
		side := testenv.Side{NS: testenv.MustNetNS(t), CG: cg}
		c, s := testenv.ConnPair(t, "tcp4", side, "127.0.0.1:0", side, "127.0.0.1:0")
		testenv.Warm(t, c, s)
		stdout, _, _ := runShunt(t, nil, "status", "--json", "--pin-dir", pin)
		var rep statusReport
		if err := json.Unmarshal([]byte(stdout), &rep); err != nil || rep.Stats == nil || rep.Stats.Counters.Paired == 0 {
			t.Errorf("status after a connection: %v, %s", err, stdout)
		}
		if _, stderr, code := runShunt(t, nil, "bypass", "disable", "--all", "--pin-dir", pin); code != 0 {
			t.Fatalf("disable: exit %d: %s", code, stderr)
		}
	}
	// --refuse-splice needs BPF LSM: refused cleanly where it is missing.
	// (A fresh pin directory: the learned programs outlive disable.)
	pin = bypasstest.MustPinDir(t)
	_, stderr, code = runShunt(t, nil, "bypass", "enable", "--no-guard", "--refuse-splice", "--cgroup", cg.Path, "--pin-dir", pin)
	switch {
	case f.Err() != nil:
		// Refused for the missing features already.
	case !f.LSM:
		if code != 1 {
			t.Errorf("enable --refuse-splice without BPF LSM: exit %d, want 1", code)
		}
		oneLine(t, stderr, bypass.ErrNoSpliceRefusal.Error())
		nothingInstalled(t, pin, cg)
	default:
		if code != 0 {
			t.Fatalf("enable --refuse-splice: exit %d: %s", code, stderr)
		}
		stdout, _, _ := runShunt(t, nil, "status", "--pin-dir", pin)
		if !strings.Contains(stdout, "--refuse-splice") {
			t.Errorf("status does not show --refuse-splice among the options:\n%s", stdout)
		}
		if _, stderr, code := runShunt(t, nil, "bypass", "disable", "--all", "--pin-dir", pin); code != 0 {
			t.Fatalf("disable: exit %d: %s", code, stderr)
		}
	}
}
