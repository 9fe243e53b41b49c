package agent

import (
	"context"
	"errors"
	"fmt"
	"io"
	"net"
	"os"
	"os/signal"
	"path/filepath"
	"reflect"
	"sort"
	"strings"
	"sync"
	"syscall"
	"time"

	"github.com/fsnotify/fsnotify"
	"k8s.io/client-go/rest"
	"k8s.io/client-go/tools/clientcmd"

	"github.com/shunt-project/shunt/bypass"
	"github.com/shunt-project/shunt/guard"
	"github.com/shunt-project/shunt/host"
	"github.com/shunt-project/shunt/internal/runlock"
	"github.com/shunt-project/shunt/kube"
	"github.com/shunt-project/shunt/metrics"
	"github.com/shunt-project/shunt/policy"
	"github.com/shunt-project/shunt/sockindex"
)

// Options are what the agent is given besides its configuration.
type Options struct {
	ConfigPath string
	// NodeName is kubernetes.node_name's default (the DaemonSet's
	// NODE_NAME, read by the command line).
	NodeName  string
	PinDir    string
	IndexDir  string
	PolicyDir string
	Version   string
	Features  host.Features
	Log       io.Writer // one line per change it makes or problem it meets
	// KubePods lists and watches pods (a clientset's CoreV1().Pods(""));
	// nil: a client made from the configuration (kubeconfig, or the
	// in-cluster service account).
	KubePods kube.PodClient
	// OwnerGone says whether the configuration's kubernetes.daemonset is
	// gone; nil: asked of the API server, with KubePods' credentials.
	OwnerGone kube.OwnerGone

	// checkGuard is guard.Check unless a test sets it.
	checkGuard func(*bypass.Install) error
}

// resync reconciles even without an event, in case one was missed.
const resync = 30 * time.Second

// Agent holds the machine to its configuration.
type Agent struct {
	opts    Options
	root    string // where cgroup v2 is mounted
	cfg     *Config
	stats   *stats
	watcher *fsnotify.Watcher
	watched map[string]bool

	guardStop func() // nil while no guard runs in the agent
	guardDone chan struct{}

	metricsCfg  MetricsConfig // what the metrics server was started with
	metricsStop func()

	policyApplied []byte // the ruleset last applied, as marshalled
	policyErr     string // the policy file's last error, logged once

	kick     chan struct{}     // something changed: reconcile
	kube     *kube.Watcher     // nil without a kubernetes section
	kubeCfg  *KubernetesConfig // what kube was started with
	kubeStop func()
	// ownerGone is set when the configuration names the agent's
	// DaemonSet: asked when the agent stops.
	ownerGone kube.OwnerGone
}

// New reads the configuration; an error there is the caller's to report
// (nothing has been changed).
func New(opts Options) (*Agent, error) {
	root, err := host.Cgroup2Root()
	if err != nil {
		return nil, err
	}
	cfg, err := CheckConfig(opts.ConfigPath, ConfigEnv{CgroupRoot: root, NodeName: opts.NodeName})
	if err != nil {
		return nil, err
	}
	if opts.PolicyDir == "" {
		opts.PolicyDir = policy.DefaultPinDir
	}
	if opts.Log == nil {
		opts.Log = io.Discard
	}
	return &Agent{opts: opts, root: root, cfg: cfg, stats: &stats{}, watched: map[string]bool{}, kick: make(chan struct{}, 1)}, nil
}

func (a *Agent) logf(format string, args ...any) {
	fmt.Fprintf(a.opts.Log, "shunt agent: "+format+"\n", args...)
}

// Run reconciles now, then on SIGHUP, on a change of the configuration
// file, when cgroups appear or go under the patterns' directories, and
// every 30 s, until ctx ends. It leaves bypass as it stands when it returns.
func (a *Agent) Run(ctx context.Context) error {
	var err error
	if a.watcher, err = fsnotify.NewWatcher(); err != nil {
		return fmt.Errorf("watch cgroups: %w", err)
	}
	defer a.watcher.Close()
	// Editors replace a file: watch its directory, not the file.
	if err := a.watcher.Add(filepath.Dir(a.opts.ConfigPath)); err != nil {
		return fmt.Errorf("watch %s: %w", a.opts.ConfigPath, err)
	}
	a.watchPolicyFile()
	hup := make(chan os.Signal, 1)
	signal.Notify(hup, syscall.SIGHUP)
	defer signal.Stop(hup)
	defer a.stopGuard()
	defer a.stopMetrics()
	defer a.stopKube()

	if err := a.startKube(ctx); err != nil {
		return err
	}
	a.watchCgroups()
	a.reconcile(ctx)
	if err := a.serveMetrics(); err != nil {
		return err
	}
	tick := time.NewTicker(resync)
	defer tick.Stop()
	for {
		select {
		case <-ctx.Done():
			a.leaveIfUninstalled()
			return nil
		case <-hup:
			a.reload(ctx, "SIGHUP")
		case <-tick.C:
			a.reconcile(ctx)
		case <-a.kick:
			a.watchCgroups()
			a.reconcile(ctx)
		case err := <-a.watcher.Errors:
			// An overflow loses events; the resync catches up.
			a.logf("watching: %v", err)
		case ev := <-a.watcher.Events:
			if filepath.Clean(ev.Name) == filepath.Clean(a.opts.ConfigPath) {
				if ev.Has(fsnotify.Write) || ev.Has(fsnotify.Create) || ev.Has(fsnotify.Rename) {
					a.reload(ctx, "a change of "+a.opts.ConfigPath)
				}
				continue
			}
			if f := a.cfg.Policy.File; f != "" && filepath.Clean(ev.Name) == filepath.Clean(f) {
				a.reconcilePolicy(ctx)
				continue
			}
			if !ev.Has(fsnotify.Create) && !ev.Has(fsnotify.Remove) {
				continue
			}
			if ev.Has(fsnotify.Remove) {
				// The kernel dropped its watch: watch it again if it comes back.
				delete(a.watched, filepath.Clean(ev.Name))
			}
			if ev.Has(fsnotify.Create) {
				a.watchCgroups() // a new directory may hold matches deeper down
			}
			a.reconcile(ctx)
		}
	}
}

// reload reads the configuration again; a bad one is reported and the
// previous one kept.
func (a *Agent) reload(ctx context.Context, why string) {
	cfg, err := LoadConfig(a.opts.ConfigPath, ConfigEnv{CgroupRoot: a.root, NodeName: a.opts.NodeName})
	if err != nil {
		a.stats.reloads("failed")
		a.logf("%v: keeping the previous configuration", err)
		return
	}
	a.stats.reloads("ok")
	a.logf("configuration reloaded (%s)", why)
	a.cfg = cfg
	a.watchPolicyFile()
	if !reflect.DeepEqual(cfg.Kubernetes, a.kubeCfg) {
		a.stopKube()
		if err := a.startKube(ctx); err != nil {
			a.logf("%v", err)
		}
	}
	a.watchCgroups()
	a.reconcile(ctx)
	if cfg.Metrics != a.metricsCfg {
		a.stopMetrics()
		if err := a.serveMetrics(); err != nil {
			a.logf("%v", err)
		}
	}
}

// desired lists the cgroups the configuration asks for, by id, and
// whether the list is whole: until the first list of pods is in, the pods'
// cgroups are unknown, and nothing may be disabled for their absence.
func (a *Agent) desired() (map[uint64]string, bool, error) {
	want := map[uint64]string{}
	whole := true
	if a.kube != nil {
		pods, synced := a.kube.Pods()
		whole = synced
		k := a.cfg.Kubernetes
		driver := kube.Driver(k.Driver)
		if driver == "" {
			driver, _ = kube.DetectDriver(k.CgroupRoot)
		}
		for _, p := range pods {
			if driver == "" {
				break // no kubelet tree yet: its creation is watched
			}
			path := kube.PodCgroup(k.CgroupRoot, driver, p.QOS, p.UID)
			if a.excluded(path) {
				continue
			}
			cg, err := host.ResolveCgroup(path)
			if err != nil {
				continue // kubelet has not made it yet: its creation is watched
			}
			want[cg.ID] = cg.Path
		}
	}
	for _, p := range a.cfg.Bypass.Cgroups {
		matches, err := filepath.Glob(p)
		if err != nil {
			return nil, false, err
		}
		for _, m := range matches {
			if a.excluded(m) {
				continue
			}
			cg, err := host.ResolveCgroup(m)
			if err != nil {
				continue // a file of the hierarchy, or gone since
			}
			want[cg.ID] = cg.Path
		}
	}
	return want, whole, nil
}

func (a *Agent) excluded(p string) bool {
	for _, x := range a.cfg.Bypass.Exclude {
		if ok, _ := filepath.Match(x, p); ok {
			return true
		}
	}
	return false
}

// reconcile enables the cgroups the configuration asks for and disables the
// others (the agent owns the set of enabled cgroups), enables the index if
// asked, and runs the guard if asked.
func (a *Agent) reconcile(ctx context.Context) {
	if err := a.reconcileBypass(ctx); err != nil {
		a.stats.reconciles("failed")
		a.logf("%v", err)
	} else {
		a.stats.reconciles("ok")
	}
	if a.cfg.Index.Enabled {
		if _, err := sockindex.Open(a.opts.IndexDir); errors.Is(err, sockindex.ErrNotEnabled) {
			root, err := host.ResolveCgroup("")
			if err == nil {
				var ix *sockindex.Index
				var seeded int
				if ix, seeded, err = sockindex.Create(a.opts.IndexDir, root); err == nil {
					ix.Close()
					a.logf("index enabled (%d sockets connected before)", seeded)
				}
			}
			if err != nil {
				a.logf("enable the index: %v", err)
			}
		}
	}
	a.reconcilePolicy(ctx)
}

// watchPolicyFile watches the policy file's directory (editors replace a
// file).
func (a *Agent) watchPolicyFile() {
	f := a.cfg.Policy.File
	if f == "" || a.watched[filepath.Dir(f)] {
		return
	}
	if err := a.watcher.Add(filepath.Dir(f)); err != nil {
		a.logf("watch %s: %v (its changes are seen at the next resync)", f, err)
		return
	}
	a.watched[filepath.Dir(f)] = true
}

func (a *Agent) reconcileBypass(ctx context.Context) error {
	want, whole, err := a.desired()
	if err != nil {
		return err
	}
	release, err := runlock.Lock("install", a.opts.PinDir, 30*time.Second, nil)
	if err != nil {
		return fmt.Errorf("lock %s: %w", a.opts.PinDir, err)
	}
	defer release()
	in, err := bypass.Open(a.opts.PinDir)
	switch {
	case errors.Is(err, bypass.ErrNotInstalled) && len(want) == 0:
		a.stats.setEnabled(0)
		return nil
	case errors.Is(err, bypass.ErrNotInstalled):
		if err := a.opts.Features.Err(); err != nil {
			return err
		}
		if err := host.EnsureBPFFS(a.opts.PinDir); err != nil {
			return err
		}
		if in, err = bypass.Create(a.opts.PinDir, bypass.Options{}); err != nil {
			return err
		}
		a.logf("bypass installed at %s", a.opts.PinDir)
	case err != nil:
		return err
	}
	defer in.Close()
	have, err := in.CgroupIDs()
	if err != nil {
		return err
	}
	var errs []error
	for _, id := range have {
		if _, ok := want[id]; ok {
			delete(want, id)
			continue
		}
		if !whole {
			continue
		}
		p := host.CgroupPathByID(id) // before the detach: a removed cgroup goes with it
		if _, err := in.Detach(id); err != nil {
			errs = append(errs, fmt.Errorf("disable cgroup %d: %w", id, err))
			continue
		}
		if p == "" {
			a.logf("disabled cgroup %d (removed)", id)
		} else {
			a.logf("disabled %s (the configuration no longer names it)", p)
		}
	}
	paths := make([]string, 0, len(want))
	for _, p := range want {
		paths = append(paths, p)
	}
	sort.Strings(paths)
	for _, p := range paths {
		cg, err := host.ResolveCgroup(p)
		if err != nil {
			continue // gone since
		}
		if _, err := in.Attach(cg); err != nil {
			errs = append(errs, fmt.Errorf("enable %s: %w", p, err))
			continue
		}
		a.logf("enabled %s", p)
	}
	if now, err := in.CgroupIDs(); err == nil {
		a.stats.setEnabled(len(now))
	}
	if a.cfg.GuardOn() {
		a.startGuard(ctx)
	} else {
		a.stopGuard()
	}
	return errors.Join(errs...)
}

// startGuard runs the guard in the agent unless one runs (here or in
// another process).
func (a *Agent) startGuard(ctx context.Context) {
	if a.guardStop != nil {
		select {
		case <-a.guardDone: // the install was removed or replaced; start again
			a.guardStop()
			a.guardStop = nil
		default:
			return
		}
	}
	if guard.Running(a.opts.PinDir) {
		return
	}
	in, err := bypass.Open(a.opts.PinDir)
	if err != nil {
		a.logf("guard: %v", err)
		return
	}
	// Loaded before the lock: a guard that holds it counts as running
	// (status, enable), and one that cannot load would hold it and die.
	// Tried again at the next reconciliation.
	check := a.opts.checkGuard
	if check == nil {
		check = guard.Check
	}
	if err := check(in); err != nil {
		in.Close()
		a.logf("guard: cannot run: %v", err)
		return
	}
	release, err := guard.Lock(a.opts.PinDir)
	if err != nil {
		in.Close()
		if !errors.Is(err, guard.ErrRunning) {
			a.logf("guard: %v", err)
		}
		return
	}
	gctx, cancel := context.WithCancel(ctx)
	done := make(chan struct{})
	var once sync.Once
	a.guardStop = func() {
		once.Do(func() {
			cancel()
			<-done
		})
	}
	a.guardDone = done
	go func() {
		ended := false
		defer func() {
			close(done)
			if ended {
				// Its install was removed or replaced by someone else:
				// reconcile now, not at the next resync, so the
				// declared install and its guard are back at once.
				select {
				case a.kick <- struct{}{}:
				default:
				}
			}
		}()
		defer release()
		defer in.Close()
		err := guard.Run(gctx, in, func(line string) { a.logf("guard: %s", line) })
		if err != nil {
			a.logf("guard: %v", err)
		}
		// Ended by a failure, it is tried again at the next
		// reconciliation, not at once: a kick here would loop.
		ended = gctx.Err() == nil && err == nil
		if ended {
			a.logf("guard: the install at %s was removed or replaced; reconciling", a.opts.PinDir)
		}
	}()
}

func (a *Agent) stopGuard() {
	if a.guardStop != nil {
		a.guardStop()
		a.guardStop = nil
	}
}

// serveMetrics serves metrics at the configured address, if any.
func (a *Agent) serveMetrics() error {
	addr := a.cfg.Metrics.Address
	a.metricsCfg = a.cfg.Metrics
	if addr == "" {
		return nil
	}
	var token string
	if f := a.cfg.Metrics.TokenFile; f != "" {
		var err error
		if token, err = metrics.ReadToken(f); err != nil {
			return fmt.Errorf("metrics.token_file: %w", err)
		}
	}
	ln, err := net.Listen("tcp", addr)
	if err != nil {
		return fmt.Errorf("metrics.address %s: %w", addr, err)
	}
	reg := metrics.Registry(metrics.Source{PinDir: a.opts.PinDir, IndexDir: a.opts.IndexDir, PolicyDir: a.opts.PolicyDir, Version: a.opts.Version, Features: a.opts.Features})
	reg.MustRegister(a.stats)
	ctx, cancel := context.WithCancel(context.Background())
	done := make(chan struct{})
	go func() {
		defer close(done)
		if err := metrics.Serve(ctx, ln, metrics.RequireToken(metrics.Handler(reg, a.opts.Log), token)); err != nil {
			a.logf("metrics: %v", err)
		}
	}()
	a.metricsStop = func() {
		cancel()
		<-done
	}
	a.logf("serving metrics at http://%s/metrics", ln.Addr())
	return nil
}

func (a *Agent) stopMetrics() {
	if a.metricsStop != nil {
		a.metricsStop()
		a.metricsStop = nil
	}
}

// watchCgroups watches every directory under which a pattern's matches may
// appear: from the pattern's fixed head down to the level above its last
// component; and where kubelet makes pod cgroups.
func (a *Agent) watchCgroups() {
	for _, p := range a.cfg.Bypass.Cgroups {
		head, depth := splitPattern(p)
		a.watchDown(head, depth)
	}
	if k := a.cfg.Kubernetes; k != nil {
		a.watchDown(k.CgroupRoot, 1) // kubepods appearing
		for _, d := range []kube.Driver{kube.Systemd, kube.Cgroupfs} {
			if k.Driver != "" && kube.Driver(k.Driver) != d {
				continue
			}
			for _, dir := range kube.QOSDirs(k.CgroupRoot, d) {
				a.watchDown(dir, 1)
			}
		}
	}
}

// startKube starts watching this node's pods if the configuration asks.
func (a *Agent) startKube(ctx context.Context) error {
	k := a.cfg.Kubernetes
	a.kubeCfg = k
	if k == nil {
		return nil
	}
	pods, gone := a.opts.KubePods, a.opts.OwnerGone
	if pods == nil {
		cfg, err := kubeConfig(k.Kubeconfig)
		if err != nil {
			return err
		}
		if pods, err = kube.PodClientFor(cfg); err != nil {
			return err
		}
		if ns, name, ok := strings.Cut(k.DaemonSet, "/"); ok && gone == nil {
			if gone, err = kube.DaemonSetGone(cfg, ns, name); err != nil {
				return err
			}
		}
	}
	a.ownerGone = nil
	if k.DaemonSet != "" {
		a.ownerGone = gone
	}
	sel := kube.Selector{Namespaces: k.Namespaces, Labels: k.Labels, Annotation: k.Annotation}
	w := kube.NewWatcher(pods, k.NodeName, sel, func() {
		select {
		case a.kick <- struct{}{}:
		default:
		}
	})
	kctx, cancel := context.WithCancel(ctx)
	done := make(chan struct{})
	go func() {
		defer close(done)
		if err := w.Run(kctx); err != nil {
			a.logf("%v", err)
		}
	}()
	a.kube = w
	a.kubeStop = func() {
		cancel()
		<-done
	}
	a.logf("watching the pods of node %s", k.NodeName)
	return nil
}

func (a *Agent) stopKube() {
	if a.kubeStop != nil {
		a.kubeStop()
		a.kubeStop = nil
	}
	a.kube = nil
}

// kubeConfig connects with a kubeconfig file, or as the pod's service
// account where the file is not given.
func kubeConfig(kubeconfig string) (*rest.Config, error) {
	var cfg *rest.Config
	var err error
	if kubeconfig != "" {
		cfg, err = clientcmd.BuildConfigFromFlags("", kubeconfig)
	} else {
		cfg, err = rest.InClusterConfig()
	}
	if err != nil {
		return nil, fmt.Errorf("kubernetes: %w (set kubernetes.kubeconfig outside a cluster)", err)
	}
	return cfg, nil
}

// leaveIfUninstalled takes shunt off the node when the agent stops because
// its DaemonSet was deleted: no agent will come back to manage what it
// left. Connections bypassed keep working (Remove drains them first); if
// readers do not catch up in time, the install stays, draining, as
// `bypass disable --all` leaves it. Where the API server cannot tell, the
// install stays, as for a rollout.
func (a *Agent) leaveIfUninstalled() {
	if a.ownerGone == nil {
		return
	}
	ctx, cancel := context.WithTimeout(context.Background(), 5*time.Second)
	defer cancel()
	gone, err := a.ownerGone(ctx)
	if err != nil {
		a.logf("stopping; could not tell whether DaemonSet %s is gone (%v): shunt stays on this node, as for a rollout", a.kubeCfg.DaemonSet, err)
		return
	}
	if !gone {
		a.logf("stopping; DaemonSet %s is still there (a rollout): shunt stays on this node for the next agent", a.kubeCfg.DaemonSet)
		return
	}
	a.stopGuard()
	release, err := runlock.Lock("install", a.opts.PinDir, 30*time.Second, nil)
	if err != nil {
		a.logf("DaemonSet %s is gone, but shunt could not be removed: lock %s: %v", a.kubeCfg.DaemonSet, a.opts.PinDir, err)
		return
	}
	defer release()
	in, err := bypass.Open(a.opts.PinDir)
	if errors.Is(err, bypass.ErrNotInstalled) {
		return
	}
	if err == nil {
		rctx, rcancel := context.WithTimeout(context.Background(), 10*time.Second)
		defer rcancel()
		err = in.Remove(rctx)
		in.Close()
	}
	if err != nil {
		a.logf("DaemonSet %s is gone; removing shunt from this node: %v", a.kubeCfg.DaemonSet, err)
		return
	}
	// Its guard has stopped, and the install lock is ours.
	if err := runlock.RemoveIfFree("guard", a.opts.PinDir); err != nil {
		a.logf("remove the guard's lock file: %v", err)
	}
	if err := runlock.Remove("install", a.opts.PinDir); err != nil {
		a.logf("remove the install's lock file: %v", err)
	}
	a.logf("DaemonSet %s is gone (uninstalled): shunt removed from this node, nothing pinned at %s", a.kubeCfg.DaemonSet, a.opts.PinDir)
}

func (a *Agent) watchDown(dir string, depth int) {
	if depth <= 0 {
		return
	}
	if !a.watched[dir] {
		if err := a.watcher.Add(dir); err != nil {
			return // not there (yet): its parent's watch sees it come
		}
		a.watched[dir] = true
	}
	if depth == 1 {
		return
	}
	ents, err := os.ReadDir(dir)
	if err != nil {
		return
	}
	for _, e := range ents {
		if e.IsDir() {
			a.watchDown(filepath.Join(dir, e.Name()), depth-1)
		}
	}
}

// splitPattern splits a pattern into its longest directory without
// wildcards and the number of components after it ("/a/b*/c" -> "/a", 2).
func splitPattern(p string) (string, int) {
	dir, depth := p, 0
	for hasMeta(dir) {
		dir = filepath.Dir(dir)
		depth++
	}
	if depth == 0 { // a plain path: watch its parent for it to come and go
		return filepath.Dir(p), 1
	}
	return dir, depth
}

func hasMeta(p string) bool {
	for _, c := range p {
		switch c {
		case '*', '?', '[', '\\':
			return true
		}
	}
	return false
}
