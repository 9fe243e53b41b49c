package bench

import (
	"context"
	"errors"
	"fmt"
	"io"
	"net"
	"os"
	"os/exec"
	"path/filepath"
	"slices"
	"strconv"
	"strings"
	"syscall"
	"time"

	"github.com/shunt-project/shunt/internal/lab"
)

// Proxies `shunt bench proxy` compares: shunt's three modes and the real ones.
const (
	ProxyKernel = "shunt-kernel"
	// ProxyShortcut is shunt-kernel with client, proxy and upstream in a
	// cgroup bypass is enabled for: both legs paired, and their peers
	// reach each other straight, passing the join by (shunt proxy
	// --shortcuts).
	ProxyShortcut = "shunt-shortcut"
	ProxyCopy     = "shunt-copy"
	ProxyPipe     = "shunt-pipe"
	ProxyHAProxy  = "haproxy" // splice on (option splice-auto)
	ProxyNginx    = "nginx"   // stream module
	ProxySocat    = "socat"
	// ProxyDirect is no proxy: the client connects to the upstream itself,
	// the floor a proxy that joins sockets in the kernel can approach.
	ProxyDirect = "direct"
)

// nginxStream is where Debian's libnginx-mod-stream puts the module.
const nginxStream = "/usr/lib/nginx/modules/ngx_stream_module.so"

// ProxyModes lists every proxy the benchmark knows.
var ProxyModes = []string{ProxyKernel, ProxyShortcut, ProxyCopy, ProxyPipe, ProxyHAProxy, ProxyNginx, ProxySocat, ProxyDirect}

// CPU placement: the proxy on one CPU, client and upstream on the other,
// the same for every proxy. Kernel work runs where the kernel puts it
// (softirq on the sending CPU, kworkers), which is why CPU is measured for
// the whole machine.
const (
	proxyCPU = 0
	peerCPU  = 1
)

// ProxyConfig says what to measure.
type ProxyConfig struct {
	Modes    []string
	Sizes    []int         // request/response sizes
	Blocks   []int         // bulk write sizes
	Rounds   int           // modes interleaved in each round
	Requests int           // request/response round trips per run (at most)
	BulkTime time.Duration // bulk transfer time per run
	MaxTime  time.Duration // a request/response run stops after this long
	// Shunt is the shunt binary for the shunt modes.
	Shunt string

	shortcutPin string // the bypass install shunt-shortcut's proxy uses
}

// ProxyResult is one proxy in one test over all rounds.
type ProxyResult struct {
	Mode string `json:"mode"`
	Test string `json:"test"` // "rr" (request/response) or "bulk"
	Size int    `json:"size"` // request or block size
	// Request/response: latency of every round trip, pooled over rounds.
	Dist     Dist `json:"latency,omitempty"`
	Over10ms int  `json:"over_10ms"` // round trips, or bulk read gaps, over 10 ms
	// Bulk: medians over rounds.
	Gbps      float64       `json:"gbit_per_s,omitempty"`
	RoundGbps []float64     `json:"round_gbit_per_s,omitempty"`
	MaxGap    time.Duration `json:"max_read_gap_ns,omitempty"`
	// Shunt proxies: the share of bytes the kernel forwarded (the rest
	// went through user space while flow control held the direction).
	KernelShare      float64   `json:"kernel_share,omitempty"`
	RoundKernelShare []float64 `json:"round_kernel_share,omitempty"`
	// CPU seconds per GB moved (both directions for rr): the whole
	// machine's, and the proxy processes' own (kernel-mode forwarding runs
	// in softirq and kworkers, outside any process).
	MachineCPUPerGB float64 `json:"machine_cpu_s_per_gb"`
	ProxyCPUPerGB   float64 `json:"proxy_cpu_s_per_gb"`
}

func (cfg ProxyConfig) validate() error {
	for _, m := range cfg.Modes {
		switch m {
		case ProxyKernel, ProxyShortcut, ProxyCopy, ProxyPipe:
			if cfg.Shunt == "" {
				return errors.New("the shunt modes need the shunt binary")
			}
		case ProxyDirect:
		case ProxyHAProxy, ProxyNginx, ProxySocat:
			if _, err := exec.LookPath(m); err != nil {
				return fmt.Errorf("%s is not installed (apt-get install %s, or leave it out of --modes)", m, m)
			}
			if _, err := os.Stat(nginxStream); m == ProxyNginx && err != nil {
				return fmt.Errorf("nginx has no stream module at %s (apt-get install libnginx-mod-stream, or leave nginx out of --modes)", nginxStream)
			}
		default:
			return fmt.Errorf("unknown proxy %q (choose from %s)", m, strings.Join(ProxyModes, ", "))
		}
	}
	if cfg.Rounds < 1 || len(cfg.Modes) == 0 || len(cfg.Sizes)+len(cfg.Blocks) == 0 {
		return errors.New("need at least one round, one proxy and one size")
	}
	return nil
}

// RunProxy runs every proxy through every test, modes interleaved within each
// round (the order rotating between rounds), in a namespace of its own.
func RunProxy(ctx context.Context, cfg ProxyConfig, progress io.Writer) ([]ProxyResult, error) {
	if err := cfg.validate(); err != nil {
		return nil, err
	}
	ns, err := lab.NewNetNS(lab.Name("shunt-bench-proxy-"))
	if err != nil {
		return nil, err
	}
	defer ns.Close()
	up, err := startUpstream(ns)
	if err != nil {
		return nil, err
	}
	defer up.close()
	var sc *shortcutSetup
	if slices.Contains(cfg.Modes, ProxyShortcut) {
		if sc, err = newShortcutSetup(ns); err != nil {
			return nil, fmt.Errorf("%s: %w", ProxyShortcut, err)
		}
		defer sc.close()
		cfg.shortcutPin = sc.pin
	}
	// through runs fn through proxy m in front of the upstream port that
	// port picks, with the upstream m uses.
	through := func(m string, port func(*upstream) int, fn func(u *upstream, addr string) (int64, error)) (proxyRun, error) {
		if m != ProxyShortcut {
			return withProxy(ctx, ns, cfg, m, port(up), func(addr string) (int64, error) { return fn(up, addr) })
		}
		var run proxyRun
		err := sc.run(func() error {
			var err error
			run, err = withProxy(ctx, ns, cfg, m, port(sc.up), func(addr string) (int64, error) { return fn(sc.up, addr) })
			return err
		})
		return run, err
	}

	type key struct {
		mode, test string
		size       int
	}
	acc := map[key]*ProxyResult{}
	samples := map[key][]time.Duration{}
	cpu := map[key][][2]float64{}
	var order []key
	get := func(k key) *ProxyResult {
		if acc[k] == nil {
			acc[k] = &ProxyResult{Mode: k.mode, Test: k.test, Size: k.size}
			order = append(order, k)
		}
		return acc[k]
	}
	for round := range cfg.Rounds {
		modes := append(cfg.Modes[round%len(cfg.Modes):], cfg.Modes[:round%len(cfg.Modes)]...)
		for _, size := range cfg.Sizes {
			for _, m := range modes {
				if err := ctx.Err(); err != nil {
					return nil, err
				}
				k := key{m, "rr", size}
				get(k)
				var s []time.Duration
				run, err := through(m, func(u *upstream) int { return u.echoPort }, func(_ *upstream, addr string) (int64, error) {
					var err error
					s, err = requestResponse(ns, addr, size, cfg.Requests, cfg.MaxTime)
					return int64(len(s)) * 2 * int64(size), err
				})
				if err != nil {
					return nil, fmt.Errorf("%s request/response %d B: %w", m, size, err)
				}
				samples[k] = append(samples[k], s...)
				cpu[k] = append(cpu[k], run.perGB())
				fmt.Fprintf(progress, "round %d: %-13s rr   %7d B  p50 %v\n", round+1, m, size, distOf(s).P50)
			}
		}
		for _, block := range cfg.Blocks {
			for _, m := range modes {
				if err := ctx.Err(); err != nil {
					return nil, err
				}
				k := key{m, "bulk", block}
				r := get(k)
				var b bulkResult
				run, err := through(m, func(u *upstream) int { return u.sinkPort }, func(u *upstream, addr string) (int64, error) {
					var err error
					b, err = bulk(ns, u, addr, block, cfg.BulkTime)
					return b.bytes, err
				})
				if err != nil {
					return nil, fmt.Errorf("%s bulk %d B: %w", m, block, err)
				}
				gbps := float64(b.bytes) * 8 / b.elapsed.Seconds() / 1e9
				r.RoundGbps = append(r.RoundGbps, gbps)
				r.MaxGap = max(r.MaxGap, b.maxGap)
				r.Over10ms += b.gaps
				cpu[k] = append(cpu[k], run.perGB())
				if run.kernelShare >= 0 {
					r.RoundKernelShare = append(r.RoundKernelShare, run.kernelShare)
				}
				fmt.Fprintf(progress, "round %d: %-13s bulk %7d B  %.2f Gbit/s, max read gap %v%s\n", round+1, m, block, gbps, b.maxGap, run.describeShare())
			}
		}
	}
	var out []ProxyResult
	for _, k := range order {
		r := acc[k]
		if k.test == "rr" {
			r.Dist = distOf(samples[k])
			for _, s := range samples[k] {
				if s > StallLimit {
					r.Over10ms++
				}
			}
		} else {
			r.Gbps = median(r.RoundGbps)
			r.KernelShare = median(r.RoundKernelShare)
		}
		var m, p []float64
		for _, c := range cpu[k] {
			m, p = append(m, c[0]), append(p, c[1])
		}
		r.MachineCPUPerGB, r.ProxyCPUPerGB = median(m), median(p)
		out = append(out, *r)
	}
	return out, nil
}

// perGB is machine and proxy CPU seconds per GB moved.
func (r proxyRun) perGB() [2]float64 {
	if r.bytes == 0 {
		return [2]float64{}
	}
	gb := float64(r.bytes) / 1e9
	return [2]float64{r.machine.Seconds() / gb, r.proxy.Seconds() / gb}
}

// withProxy starts proxy m in front of the upstream port and runs fn against
// it; it returns the machine's and the proxy's CPU time over fn and the bytes
// fn says it moved.
func withProxy(ctx context.Context, ns *lab.NetNS, cfg ProxyConfig, m string, upstream int, fn func(addr string) (int64, error)) (r proxyRun, err error) {
	if m == ProxyDirect {
		return direct(upstream, fn)
	}
	port := freePort()
	p, err := startProxy(ctx, ns, cfg, m, port, upstream)
	if err != nil {
		return r, err
	}
	stopped := false
	defer func() {
		if !stopped {
			p.stop()
		}
	}()
	addr := net.JoinHostPort("127.0.0.1", strconv.Itoa(port))
	if err := waitListening(ns, addr); err != nil {
		return r, fmt.Errorf("%w (proxy said: %s)", err, p.log())
	}
	clock, err := startCPU()
	if err != nil {
		return r, err
	}
	p0, err := procTreeCPU(p.cmd.Process.Pid)
	if err != nil {
		return r, fmt.Errorf("%w (before the run; proxy said: %s)", err, p.log())
	}
	r.bytes, err = fn(addr)
	if err != nil {
		return r, fmt.Errorf("%w (proxy said: %s)", err, p.log())
	}
	if r.machine, err = clock.elapsed(); err != nil {
		return r, err
	}
	p1, err := procTreeCPU(p.cmd.Process.Pid)
	if err != nil {
		return r, fmt.Errorf("%w (after the run; proxy said: %s)", err, p.log())
	}
	r.proxy = p1 - p0
	p.stop()
	stopped = true
	r.kernelShare = -1
	var up, down, kernel int64
	if m != ProxyKernel && m != ProxyShortcut {
		return r, nil
	}
	if _, err := fmt.Sscanf(p.summary(), "%d bytes up, %d down, %d of them moved by the kernel", &up, &down, &kernel); err != nil || up+down == 0 {
		return r, fmt.Errorf("shunt proxy printed no totals (last line %q)", p.log())
	}
	r.kernelShare = float64(kernel) / float64(up+down)
	return r, nil
}

// direct runs fn against the upstream itself: no proxy, no proxy CPU.
func direct(upstream int, fn func(addr string) (int64, error)) (r proxyRun, err error) {
	r.kernelShare = -1
	clock, err := startCPU()
	if err != nil {
		return r, err
	}
	if r.bytes, err = fn(net.JoinHostPort("127.0.0.1", strconv.Itoa(upstream))); err != nil {
		return r, err
	}
	r.machine, err = clock.elapsed()
	return r, err
}

// proxyRun is what one run through a proxy cost.
type proxyRun struct {
	machine, proxy time.Duration // CPU
	bytes          int64
	kernelShare    float64 // shunt proxies: share of bytes the kernel moved; -1 otherwise
}

type proxyProc struct {
	cmd    *exec.Cmd
	dir    string
	output *lockedWriter
}

// summary is the byte counts from shunt proxy's "stopped after" line.
func (p *proxyProc) summary() string {
	p.output.mu.Lock()
	out := p.output.b.String()
	p.output.mu.Unlock()
	for _, l := range strings.Split(out, "\n") {
		if _, rest, ok := strings.Cut(l, "proxy: stopped after "); ok {
			if _, counts, ok := strings.Cut(rest, "; "); ok {
				return counts
			}
		}
	}
	return ""
}

// log is the last line the proxy printed.
func (p *proxyProc) log() string {
	p.output.mu.Lock()
	s := strings.TrimSpace(p.output.b.String())
	p.output.mu.Unlock()
	if i := strings.LastIndexByte(s, '\n'); i >= 0 {
		s = s[i+1:]
	}
	return s
}

func (p *proxyProc) stop() {
	_ = p.cmd.Process.Signal(syscall.SIGTERM)
	done := make(chan struct{})
	go func() { _ = p.cmd.Wait(); close(done) }()
	select {
	case <-done:
	case <-time.After(15 * time.Second):
		_ = p.cmd.Process.Kill()
		<-done
	}
	os.RemoveAll(p.dir)
}

// startProxy runs proxy m in ns on proxyCPU, listening on port.
func startProxy(ctx context.Context, ns *lab.NetNS, cfg ProxyConfig, m string, port, upstream int) (*proxyProc, error) {
	dir, err := os.MkdirTemp("", "shunt-bench-proxy-")
	if err != nil {
		return nil, err
	}
	listen := fmt.Sprintf("127.0.0.1:%d", port)
	up := fmt.Sprintf("127.0.0.1:%d", upstream)
	var argv []string
	switch m {
	case ProxyKernel, ProxyCopy, ProxyPipe:
		argv = []string{cfg.Shunt, "proxy", "--listen", listen, "--upstream", up, "--mode", strings.TrimPrefix(m, "shunt-")}
	case ProxyShortcut:
		argv = []string{cfg.Shunt, "proxy", "--listen", listen, "--upstream", up, "--mode", "kernel", "--pin-dir", cfg.shortcutPin}
	case ProxyHAProxy:
		conf := filepath.Join(dir, "haproxy.cfg")
		text := fmt.Sprintf(`global
	nbthread 1
	maxconn 1000
defaults
	mode tcp
	option splice-auto
	timeout connect 5s
	timeout client 60s
	timeout server 60s
listen bench
	bind %s
	server up %s
`, listen, up)
		if err := os.WriteFile(conf, []byte(text), 0o600); err != nil {
			return nil, err
		}
		argv = []string{"haproxy", "-db", "-f", conf}
	case ProxyNginx:
		conf := filepath.Join(dir, "nginx.conf")
		text := fmt.Sprintf(`load_module `+nginxStream+`;
daemon off;
master_process off;
worker_processes 1;
pid %[1]s/nginx.pid;
error_log stderr;
events { worker_connections 1024; }
stream {
	server {
		listen %[2]s;
		proxy_pass %[3]s;
	}
}
`, dir, listen, up)
		if err := os.WriteFile(conf, []byte(text), 0o600); err != nil {
			return nil, err
		}
		argv = []string{"nginx", "-c", conf, "-p", dir, "-e", "stderr"}
	case ProxySocat:
		// nodelay on both sides, as HAProxy and nginx do by default:
		// without it a 16 KiB reply waits for a delayed ACK (44 ms).
		argv = []string{"socat", fmt.Sprintf("TCP-LISTEN:%d,bind=127.0.0.1,fork,reuseaddr,nodelay", port), "TCP:" + up + ",nodelay"}
	}
	pinned := append([]string{"taskset", "-c", strconv.Itoa(proxyCPU)}, argv...)
	cmd := exec.CommandContext(ctx, "ip", append([]string{"netns", "exec", ns.Name}, pinned...)...)
	if m == ProxyShortcut {
		// ip netns exec remounts /sys, and with it hides bpffs, where
		// this proxy finds its install.
		cmd = exec.CommandContext(ctx, "nsenter", append([]string{"--net=/run/netns/" + ns.Name}, pinned...)...)
	}
	out := &lockedWriter{b: &strings.Builder{}}
	cmd.Stdout, cmd.Stderr = out, out
	if err := cmd.Start(); err != nil {
		os.RemoveAll(dir)
		return nil, fmt.Errorf("start %s: %w", m, err)
	}
	return &proxyProc{cmd: cmd, dir: dir, output: out}, nil
}

func waitListening(ns *lab.NetNS, addr string) error {
	deadline := time.Now().Add(5 * time.Second)
	for {
		var c net.Conn
		err := ns.Do(func() error {
			var err error
			c, err = net.DialTimeout("tcp", addr, 200*time.Millisecond)
			return err
		})
		if err == nil {
			c.Close()
			return nil
		}
		if time.Now().After(deadline) {
			return fmt.Errorf("not listening on %s after 5 s", addr)
		}
		time.Sleep(20 * time.Millisecond)
	}
}

// procTreeCPU is the CPU time of pid and every process below it. A child
// that ends while it is read is left out (its time is gone with it); any
// other failure is an error, not a plausible number.
func procTreeCPU(pid int) (time.Duration, error) {
	b, err := os.ReadFile(fmt.Sprintf("/proc/%d/stat", pid))
	if err != nil {
		return 0, fmt.Errorf("CPU of pid %d: %w", pid, err)
	}
	hz, err := clockTicks()
	if err != nil {
		return 0, err
	}
	total, err := parsePidStatCPU(string(b), hz)
	if err != nil {
		return 0, fmt.Errorf("CPU of pid %d: %w", pid, err)
	}
	tasks, _ := filepath.Glob(fmt.Sprintf("/proc/%d/task/*/children", pid))
	for _, t := range tasks {
		kids, _ := os.ReadFile(t)
		for _, k := range strings.Fields(string(kids)) {
			c, err := strconv.Atoi(k)
			if err != nil {
				continue
			}
			d, err := procTreeCPU(c)
			// Gone (ENOENT), or exiting as it is read (ESRCH: socat's
			// child for waitListening's probe once failed a run so).
			if errors.Is(err, os.ErrNotExist) || errors.Is(err, syscall.ESRCH) {
				continue
			}
			if err != nil {
				return 0, err
			}
			total += d
		}
	}
	return total, nil
}

// parsePidStatCPU reads utime + stime (fields 14 and 15) of a
// /proc/<pid>/stat line, in ticks of 1/hz s.
func parsePidStatCPU(stat string, hz int64) (time.Duration, error) {
	i := strings.LastIndexByte(stat, ')')
	if i < 0 || i+2 > len(stat) {
		return 0, fmt.Errorf("stat %q has no command", stat)
	}
	f := strings.Fields(stat[i+2:])
	if len(f) < 13 {
		return 0, fmt.Errorf("stat %q is short", stat)
	}
	var ticks int64
	for _, j := range []int{11, 12} { // utime, stime (fields 14, 15)
		n, err := strconv.ParseInt(f[j], 10, 64)
		if err != nil {
			return 0, fmt.Errorf("stat field %d is %q", j+3, f[j])
		}
		ticks += n
	}
	return time.Duration(ticks) * time.Second / time.Duration(hz), nil
}

func (r proxyRun) describeShare() string {
	if r.kernelShare < 0 {
		return ""
	}
	return fmt.Sprintf(", %.0f%% in the kernel", 100*r.kernelShare)
}
