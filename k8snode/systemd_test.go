//go:build k8snode

package k8snode_test

import (
	"fmt"
	"os"
	"os/exec"
	"path/filepath"
	"strconv"
	"strings"
	"syscall"
	"testing"
	"time"

	"github.com/shunt-project/shunt/host"
	"github.com/shunt-project/shunt/internal/testenv"
)

// systemdUnits are the units of the node's systemd: nothing but the
// system bus (kubelet's and runc's systemd drivers ask systemd for slices
// and scopes over D-Bus). Every unit it would read of this host's is
// hidden from it, so it starts none of the host's services.
var systemdUnits = map[string]string{
	"default.target": "[Unit]\nDefaultDependencies=no\nRequires=dbus.socket\n",
	"dbus.socket":    "[Socket]\nListenStream=/run/dbus/system_bus_socket\n",
	"dbus.service": `[Unit]
Requires=dbus.socket
[Service]
Type=notify
NotifyAccess=main
ExecStart=/usr/bin/dbus-daemon --system --address=systemd: --nofork --nopidfile --systemd-activation --syslog-only
`,
}

// The targets systemd's own units and transient slices and scopes depend
// on, empty.
var systemdTargets = []string{"sysinit", "basic", "shutdown", "sockets", "timers", "paths", "slices", "local-fs", "umount", "final"}

// systemdBoot is run by sh as PID 1 of the new PID and mount namespace,
// with the units' directory, an empty one and the v1 hierarchies' names as
// arguments; it hides from systemd what would have it change the host's
// own mounts and cgroups, then becomes systemd.
const systemdBoot = `set -e
units=$1 empty=$2; shift 2
# A tmpfs of its own at /sys/fs/cgroup (systemd remounts it read-only and
# makes links in it), each hierarchy mounted again in it: from the cgroup
# namespace, so its root is the node's.
mount -t tmpfs -o mode=755 tmpfs /sys/fs/cgroup
for h in "$@"; do
	mkdir "/sys/fs/cgroup/$h"
	case $h in
	unified) mount -t cgroup2 cgroup2 "/sys/fs/cgroup/$h" ;;
	systemd) mount -t cgroup -o none,name=systemd cgroup "/sys/fs/cgroup/$h" ;;
	*) mount -t cgroup -o "$h" cgroup "/sys/fs/cgroup/$h" ;;
	esac
done
# Only the controllers that have a v1 hierarchy: systemd mounts a new one
# for every other controller /proc/cgroups names, which takes it from the
# host's v2 tree.
awk 'NR == 1 || $2 != 0' /proc/cgroups > "$units/.cgroups"
mount --bind "$units/.cgroups" /proc/cgroups
mount -t tmpfs -o mode=755 tmpfs /run
mount --bind "$units" /usr/lib/systemd/system
mount --bind "$empty" /etc/systemd/system
mount --bind "$empty" /usr/lib/systemd/system-generators
# Shared, as systemd makes them on a host (not in a container): the
# agent's bpffs mount is Bidirectional.
mount --make-rshared /
export container=shunt-test
exec /lib/systemd/systemd --system --log-target=kmsg --log-level=notice
`

// startSystemd runs systemd as the node's init: PID 1 of a PID, mount and
// cgroup namespace of its own, as in a node that runs in a container
// (kind's): this host's PID 1 is not systemd, systemd manages cgroups only
// as PID 1, and kubelet's systemd driver takes systemd's slices to start
// at the root of each hierarchy. The cgroup namespace's root is the
// node's cgroup root (root, in the v2 tree, and the cgroup of that name in
// every v1 hierarchy); the node's network namespace is its. The node's
// other programs run in its namespaces from then on (c.start), and see
// the cgroup trees from root down, as does the agent's pod through its
// host path. When the test ends systemd is killed, and everything in its
// namespaces with it.
func startSystemd(t testing.TB, c *cluster, root host.Cgroup) {
	t.Helper()
	dir := t.TempDir()
	units, empty := filepath.Join(dir, "units"), filepath.Join(dir, "empty")
	must(t, os.Mkdir(units, 0o755))
	must(t, os.Mkdir(empty, 0o755))
	for name, text := range systemdUnits {
		must(t, os.WriteFile(filepath.Join(units, name), []byte(text), 0o644))
	}
	for _, name := range systemdTargets {
		must(t, os.WriteFile(filepath.Join(units, name+".target"), []byte("[Unit]\nDefaultDependencies=no\n"), 0o644))
	}
	name := filepath.Base(root.Path)
	procs := []string{filepath.Join(root.Path, "cgroup.procs")}
	// This host's layout (docs/KUBERNETES.md); a host of the v2 tree alone
	// would need the script to mount it at /sys/fs/cgroup.
	if v2 := filepath.Dir(root.Path); v2 != "/sys/fs/cgroup/unified" {
		t.Fatalf("the systemd node is written for a hybrid cgroup host (the v2 tree at /sys/fs/cgroup/unified); here it is at %s", v2)
	}
	hierarchies := []string{"unified"}
	for _, h := range v1Hierarchies() {
		procs = append(procs, filepath.Join(h, name, "cgroup.procs"))
		hierarchies = append(hierarchies, filepath.Base(h))
	}
	// sh joins the node's cgroups, then unshare makes the namespaces and
	// the child that becomes systemd (--kill-child: should unshare die,
	// systemd is killed, which ends its PID namespace).
	enter := `for f in "$@"; do echo $$ > "$f"; done; exec unshare --pid --fork --kill-child --mount --cgroup --uts --propagation private --mount-proc sh -c "$0" boot ` +
		shellQuote(units) + " " + shellQuote(empty) + " " + strings.Join(hierarchies, " ")
	p := testenv.Start(t, "systemd", exec.Command("nsenter", append([]string{"--net=/run/netns/" + c.node.Name, "--", "sh", "-c", enter, systemdBoot}, procs...)...))

	var pid int
	eventually(t, 10*time.Second, "systemd started", func() error {
		pid = childOf(p.Pid)
		if pid == 0 {
			return fmt.Errorf("unshare has no child yet")
		}
		if comm, _ := os.ReadFile(fmt.Sprintf("/proc/%d/comm", pid)); strings.TrimSpace(string(comm)) != "systemd" {
			return fmt.Errorf("its child is %q", strings.TrimSpace(string(comm)))
		}
		return nil
	})
	// unshare ignores SIGTERM while its child runs, and systemd takes it
	// for "re-execute": the end is SIGKILL, before the stop's SIGTERM.
	t.Cleanup(func() { syscall.Kill(pid, syscall.SIGKILL) })
	c.init = &nodeInit{pid: pid, procs: procs}
	c.mnt = c.init.ns("mnt")
	eventually(t, 30*time.Second, "systemd's system bus", func() error {
		out, err := exec.Command("nsenter", "--mount="+c.mnt, "--pid="+c.init.ns("pid"), "--", "busctl", "--system", "status", "org.freedesktop.systemd1").CombinedOutput()
		if err != nil {
			return fmt.Errorf("%v: %s", err, out)
		}
		return nil
	})
}

// nodeInit is the node's systemd.
type nodeInit struct {
	pid   int      // in this PID namespace
	procs []string // cgroup.procs of the node's cgroup root, in every hierarchy
}

// ns is the path of its namespace of kind.
func (n *nodeInit) ns(kind string) string { return fmt.Sprintf("/proc/%d/ns/%s", n.pid, kind) }

// start runs argv as a systemd host runs a program: in a scope of its
// own, in the node's PID and cgroup namespace (and those of enter). The
// process joins the node's cgroup root first, from here: a process moves
// only between cgroups below the root of its mover's cgroup namespace
// (systemd's), else ENOENT. nsenter forks: its child is in the PID
// namespace, and in its process group, which is what stopping it signals.
func (n *nodeInit) start(t testing.TB, name string, enter, argv []string) *testenv.Process {
	t.Helper()
	enter = append(enter, "--pid="+n.ns("pid"), "--cgroup="+n.ns("cgroup"), "--")
	scope := []string{"systemd-run", "--scope", "--quiet", "--unit", "shunt-test-" + name, "--"}
	cmd := exec.Command("sh", append(append(append([]string{"-c", `for f in $NODE_CGROUP_PROCS; do echo $$ > "$f"; done; exec "$@"`, "sh", "nsenter"}, enter...), scope...), argv...)...)
	cmd.Env = append(os.Environ(), "NODE_CGROUP_PROCS="+strings.Join(n.procs, " "))
	return testenv.Start(t, name, cmd)
}

// childOf is a child of the process pid, or 0.
func childOf(pid int) int {
	ents, _ := os.ReadDir("/proc")
	for _, e := range ents {
		b, err := os.ReadFile(filepath.Join("/proc", e.Name(), "status"))
		if err != nil {
			continue
		}
		for _, l := range strings.Split(string(b), "\n") {
			if v, ok := strings.CutPrefix(l, "PPid:"); ok && strings.TrimSpace(v) == strconv.Itoa(pid) {
				child, _ := strconv.Atoi(e.Name())
				return child
			}
		}
	}
	return 0
}

// shellQuote quotes s for sh.
func shellQuote(s string) string { return "'" + strings.ReplaceAll(s, "'", `'\''`) + "'" }
