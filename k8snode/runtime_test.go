//go:build k8snode

package k8snode_test

import (
	"fmt"
	"os"
	"os/exec"
	"path/filepath"
	"sort"
	"strconv"
	"strings"
	"syscall"
	"testing"
	"time"

	"github.com/shunt-project/shunt/internal/testenv"
	"github.com/shunt-project/shunt/kube"
)

// Images imported into containerd (no registry is reachable from here):
// the sandbox's, the workloads' and the agent's, each a static program
// built by scripts/k8s.sh or make build.
const (
	pauseImage = "shunt-test.local/pause:1"
	webImage   = "shunt-test.local/web:1"
	agentRepo  = "shunt-test.local/shunt"
	agentTag   = "test"
	podSubnet  = "10.200.0.0/24" // the CNI bridge's, inside the cluster CIDR
)

// containerd is the node's container runtime, with every directory of its
// own (a short one under /tmp for its sockets: a unix socket's path has
// 108 bytes; not /run, which a node whose init is systemd has its own of).
type containerd struct {
	sock string
	run  string // sockets, state, runc's root, the pods' network namespaces
	root string // images and snapshots
}

// startContainerd runs containerd in the node's namespace with the CNI
// plugins' bridge, Debian's runc (its cgroups made by the driver's way),
// and the images imported; everything it ran is gone when the test ends.
func startContainerd(t testing.TB, c *cluster, driver kube.Driver) *containerd {
	t.Helper()
	run, err := os.MkdirTemp("/tmp", testenv.Name()+"-")
	must(t, err)
	rt := &containerd{sock: filepath.Join(run, "containerd.sock"), run: run, root: t.TempDir()}
	t.Cleanup(func() { rt.sweep(t) })
	if c.mnt == "" {
		// The node's programs get a mount namespace of their own where
		// every mount is shared, as on a systemd host: the agent's bpffs
		// mount is Bidirectional, which kubelet allows only on a shared
		// mount, and this host's are private; what they mount goes with
		// the namespace. (systemd, where it is the node's init, makes its
		// namespace's mounts shared itself.)
		c.mnt = filepath.Join(run, "mnt")
		must(t, os.WriteFile(c.mnt, nil, 0o600))
		if out, err := exec.Command("unshare", "--mount="+c.mnt, "--propagation", "private", "mount", "--make-rshared", "/").CombinedOutput(); err != nil {
			t.Fatalf("the node's mount namespace: %v: %s", err, out)
		}
	}

	cni := filepath.Join(rt.root, "cni")
	must(t, os.MkdirAll(cni, 0o755))
	// hairpinMode: a pod reaches itself through its Service.
	must(t, os.WriteFile(filepath.Join(cni, "10-shunt-test.conflist"), []byte(fmt.Sprintf(`{
  "cniVersion": "1.0.0", "name": "shunt-test",
  "plugins": [{"type": "bridge", "bridge": "cni0", "isGateway": true, "hairpinMode": true,
    "ipam": {"type": "host-local", "ranges": [[{"subnet": %q}]], "routes": [{"dst": "0.0.0.0/0"}], "dataDir": %q}}]
}`, podSubnet, filepath.Join(run, "ipam"))), 0o644))
	cfg := filepath.Join(rt.root, "config.toml")
	// restrict_oom_score_adj: root here lacks CAP_SYS_RESOURCE, so runc
	// cannot lower a sandbox's oom_score_adj to kubelet's -998.
	must(t, os.WriteFile(cfg, []byte(fmt.Sprintf(`version = 3
root = %[1]q
state = %[2]q
disabled_plugins = ["io.containerd.nri.v1.nri"]
[grpc]
  address = %[3]q
[ttrpc]
  address = "%[3]s.ttrpc"
[plugins.'io.containerd.internal.v1.opt']
  path = "%[1]s/opt"
[plugins.'io.containerd.cri.v1.images']
  snapshotter = "overlayfs"
  [plugins.'io.containerd.cri.v1.images'.pinned_images]
    sandbox = %[4]q
[plugins.'io.containerd.cri.v1.runtime']
  restrict_oom_score_adj = true
  netns_mounts_under_state_dir = true
  enable_cdi = false
  [plugins.'io.containerd.cri.v1.runtime'.containerd.runtimes.runc]
    runtime_type = "io.containerd.runc.v2"
    [plugins.'io.containerd.cri.v1.runtime'.containerd.runtimes.runc.options]
      BinaryName = "/usr/sbin/runc"
      Root = "%[2]s/runc"
      SystemdCgroup = %[6]t
  [plugins.'io.containerd.cri.v1.runtime'.cni]
    bin_dirs = ["/usr/lib/cni"]
    conf_dir = %[5]q
`, rt.root, filepath.Join(run, "state"), rt.sock, pauseImage, cni, driver == kube.Systemd)), 0o644))
	// containerd finds its shim on PATH.
	c.start(t, "containerd", "env", "PATH="+*k8sBin+":"+os.Getenv("PATH"), bin("containerd"), "--config", cfg, "--log-level", "warn")
	eventually(t, 30*time.Second, "containerd answers", func() error {
		_, err := rt.ctr("version")
		return err
	})

	images := t.TempDir()
	for _, im := range []struct{ ref, entry, files string }{
		{pauseImage, "/pause", bin("pause") + "=/pause"},
		{webImage, "/web", bin("web") + "=/web"},
		// deploy/Dockerfile's image: the static binary alone.
		{agentRepo + ":" + agentTag, "/usr/bin/shunt", *shuntBin + "=/usr/bin/shunt"},
	} {
		tar := filepath.Join(images, strings.NewReplacer("/", "_", ":", "_").Replace(im.ref)+".tar")
		if out, err := exec.Command(bin("mkimage"), "-o", tar, "-ref", im.ref, "-entrypoint", im.entry, im.files).CombinedOutput(); err != nil {
			t.Fatalf("image %s: %v: %s", im.ref, err, out)
		}
		if out, err := rt.ctr("images", "import", tar); err != nil {
			t.Fatalf("import %s: %v: %s", im.ref, err, out)
		}
	}
	return rt
}

// ctr runs containerd's client on the CRI's namespace and returns what it
// printed (its warnings, on cgroup v1 hosts one per call, only with an
// error).
func (rt *containerd) ctr(args ...string) (string, error) {
	var stderr strings.Builder
	cmd := exec.Command(bin("ctr"), append([]string{"--address", rt.sock, "--namespace", "k8s.io"}, args...)...)
	cmd.Stderr = &stderr
	out, err := cmd.Output()
	if err != nil {
		return string(out) + stderr.String(), err
	}
	return string(out), nil
}

// sweep runs once containerd has stopped (registered before it started):
// a shim outlives containerd, so any left is ended by the socket it names,
// then what was mounted for the containers goes.
func (rt *containerd) sweep(t testing.TB) {
	for _, pid := range pidsNaming(rt.sock) {
		syscall.Kill(pid, syscall.SIGKILL)
	}
	// The node's mount namespace, and anything mounted here by mistake.
	mounts := mountsUnder(rt.run, rt.root)
	for _, m := range mounts {
		if err := syscall.Unmount(m, syscall.MNT_DETACH); err != nil {
			t.Errorf("unmount %s: %v", m, err)
		}
	}
	if err := os.RemoveAll(rt.run); err != nil {
		t.Errorf("remove %s: %v", rt.run, err)
	}
}

// stopContainers ends every container kubelet left running; the shims end
// with their tasks.
func (rt *containerd) stopContainers(t testing.TB) {
	out, err := rt.ctr("tasks", "ls", "-q")
	if err != nil {
		t.Logf("ctr tasks ls: %v: %s", err, out)
		return
	}
	for _, id := range strings.Fields(out) {
		rt.ctr("tasks", "kill", "-s", "SIGKILL", id)
		for deadline := time.Now().Add(10 * time.Second); time.Now().Before(deadline); time.Sleep(100 * time.Millisecond) {
			if _, err := rt.ctr("tasks", "rm", "-f", id); err == nil {
				break
			}
		}
	}
}

// pidsNaming lists the processes whose command line holds s.
func pidsNaming(s string) []int {
	var pids []int
	ents, _ := os.ReadDir("/proc")
	for _, e := range ents {
		pid, err := strconv.Atoi(e.Name())
		if err != nil || pid == os.Getpid() {
			continue
		}
		b, err := os.ReadFile(filepath.Join("/proc", e.Name(), "cmdline"))
		if err == nil && strings.Contains(string(b), s) {
			pids = append(pids, pid)
		}
	}
	return pids
}

// mountsUnder lists the mount points below any of dirs, deepest first.
func mountsUnder(dirs ...string) []string {
	out := mountPoints(func(point, _ string) bool {
		for _, d := range dirs {
			if strings.HasPrefix(point, d+"/") {
				return true
			}
		}
		return false
	})
	sort.Slice(out, func(i, j int) bool { return strings.Count(out[i], "/") > strings.Count(out[j], "/") })
	return out
}

// mountPoints lists this process's mount points for which keep holds.
func mountPoints(keep func(point, fstype string) bool) []string {
	b, err := os.ReadFile("/proc/self/mountinfo")
	if err != nil {
		return nil
	}
	var out []string
	for _, l := range strings.Split(string(b), "\n") {
		// "36 35 98:0 /mnt1 /mnt2 rw,noatime master:1 - ext3 /dev/root rw": the
		// mount point is the fifth field, the type the first after " - ".
		f := strings.Fields(l)
		_, after, ok := strings.Cut(l, " - ")
		t := strings.Fields(after)
		if ok && len(f) > 4 && len(t) > 0 && keep(f[4], t[0]) {
			out = append(out, f[4])
		}
	}
	return out
}
