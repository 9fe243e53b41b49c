package bench

import (
	"bufio"
	"bytes"
	"context"
	"encoding/json"
	"fmt"
	"maps"
	"math/rand/v2"
	"net"
	"os"
	"os/exec"
	"regexp"
	"slices"
	"strconv"
	"strings"
	"time"

	"github.com/shunt-project/shunt/bypass"
	"github.com/shunt-project/shunt/internal/lab"
)

// Modes run by real tools instead of shunt's own loops. The suffix says
// whether bypass is on for the tool's connections. Both tools read with
// blocking calls, which the default install keeps on TCP (a signal would end
// such a read with EAGAIN; docs/TRANSPARENCY.md), so their bypass runs use
// an install made with TrustReaders.
const (
	ModeSockperfTCP   = "sockperf-tcp"
	ModeSockperfShunt = "sockperf-" + ModeTrust
	ModeIperfTCP      = "iperf3-tcp"
	ModeIperfShunt    = "iperf3-" + ModeTrust
)

// baseline names the mode a mode's ratio is taken against: a tool's own
// plain-TCP run, or shunt's tcp mode.
func baseline(mode string) string {
	if tool, _, ok := ExternalMode(mode); ok {
		return tool + "-" + ModeTCP
	}
	return ModeTCP
}

// ExternalMode splits "sockperf-shunt-trust" into the tool and whether
// bypass is on.
func ExternalMode(mode string) (tool string, bypass bool, ok bool) {
	for _, t := range []string{"sockperf", "iperf3"} {
		if rest, found := strings.CutPrefix(mode, t+"-"); found {
			return t, rest == ModeTrust, true
		}
	}
	return "", false, false
}

// toolCmd runs a tool inside a namespace and the lab's cgroup, pinned to cpu
// (unpinned for -1).
func (l *Lab) toolCmd(ctx context.Context, ns *lab.NetNS, cpu int, tool string, args ...string) *exec.Cmd {
	script := `echo $$ > "$1/cgroup.procs" && shift && exec "$@"`
	full := []string{"-c", script, "sh", l.Cgroup.Path, "ip", "netns", "exec", ns.Name}
	if cpu >= 0 {
		full = append(full, "taskset", "-c", strconv.Itoa(cpu))
	}
	full = append(append(full, tool), args...)
	return exec.CommandContext(ctx, "sh", full...)
}

// serve starts a tool's server in the server namespace and waits until it
// listens on port. It looks rather than connects: a probe connection would be
// taken for a client (iperf3 serves one at a time, and a real client arriving
// while it is still busy with the probe is refused).
func (l *Lab) serve(ctx context.Context, cpu int, tool, ip string, port int, args ...string) (*exec.Cmd, error) {
	if _, err := exec.LookPath(tool); err != nil {
		return nil, fmt.Errorf("%s is not installed (apt-get install %s)", tool, tool)
	}
	srv := l.toolCmd(ctx, l.Server, cpu, tool, args...)
	if err := srv.Start(); err != nil {
		return nil, fmt.Errorf("start %s server: %w", tool, err)
	}
	deadline := time.Now().Add(5 * time.Second)
	for !listening(srv.Process.Pid, tool, port) {
		if time.Now().After(deadline) {
			_ = srv.Process.Kill()
			_ = srv.Wait()
			return nil, fmt.Errorf("%s server did not start listening on %s", tool, net.JoinHostPort(ip, strconv.Itoa(port)))
		}
		time.Sleep(20 * time.Millisecond)
	}
	return srv, nil
}

// listening says whether process pid, once it runs tool (the shell and `ip
// netns exec` before it exec into it, after entering the namespace), has a
// TCP socket listening on port in its network namespace.
func listening(pid int, tool string, port int) bool {
	comm, err := os.ReadFile(fmt.Sprintf("/proc/%d/comm", pid))
	if err != nil || strings.TrimSpace(string(comm)) != tool {
		return false
	}
	want := fmt.Sprintf(":%04X ", port)
	for _, table := range []string{"tcp", "tcp6"} {
		b, err := os.ReadFile(fmt.Sprintf("/proc/%d/net/%s", pid, table))
		if err != nil {
			continue
		}
		for _, line := range strings.Split(string(b), "\n") {
			// "sl local_address rem_address st ...": LISTEN is state 0A.
			f := strings.Fields(line)
			if len(f) > 3 && strings.HasSuffix(f[1]+" ", want) && f[3] == "0A" {
				return true
			}
		}
	}
	return false
}

func (l *Lab) serverIP(topology string) (ip string, clientNS *lab.NetNS) {
	if topology == Loopback {
		return "127.0.0.1", l.Server
	}
	return lab.VethIPv4B, l.Client
}

// SockperfMaxMsg is the largest message sockperf sends (its payload limit).
const SockperfMaxMsg = 65506

// checkTools rejects sizes a tool mode cannot run, before anything runs.
func (cfg LatencyConfig) checkTools() error {
	for _, m := range cfg.Modes {
		if tool, _, ok := ExternalMode(m); ok && tool == "sockperf" {
			for _, s := range cfg.Sizes {
				if s > SockperfMaxMsg {
					return fmt.Errorf("sockperf sends messages of at most %d bytes, not %d: leave it out for larger sizes", SockperfMaxMsg, s)
				}
			}
		}
	}
	return nil
}

// freePort picks a listening port below the ephemeral range (32768 and
// up), so that no outgoing connection in the lab's namespaces holds it.
func freePort() int { return 20000 + rand.IntN(12000) }

// pairedCount is how many connections the lab's installs have paired.
func (l *Lab) pairedCount() (uint64, error) {
	var n uint64
	for _, in := range append([]*bypass.Install{l.install}, slices.Collect(maps.Values(l.alt))...) {
		st, err := in.Stats()
		if err != nil {
			return 0, err
		}
		n += st.Counters.Paired
	}
	return n, nil
}

// withTool runs one client run of a tool with bypass set for its mode and
// checks afterwards that a shunt run really was bypassed.
func (l *Lab) withTool(mode string, run func() error) error {
	_, on, _ := ExternalMode(mode)
	setup := ModeTCP
	if on {
		setup = ModeTrust
	}
	if err := l.bypassMode(setup); err != nil {
		return err
	}
	before, err := l.pairedCount()
	if err != nil {
		return err
	}
	if err := run(); err != nil {
		return err
	}
	after, err := l.pairedCount()
	if err != nil {
		return err
	}
	if on && after == before {
		return fmt.Errorf("the tool's connection was not bypassed")
	}
	if !on && after != before {
		return fmt.Errorf("a plain-TCP run was bypassed")
	}
	return nil
}

var sockperfLine = regexp.MustCompile(`---> (?:percentile ([0-9.]+)|<(MAX)> observation) =\s+([0-9.]+)`)

// sockperfRun runs sockperf ping-pong and returns its distribution. sockperf
// reports half round trips (latency = RTT/2); they are kept as reported.
func sockperfRun(l *Lab, c Cell, cfg LatencyConfig) (Dist, error) {
	ctx, cancel := context.WithTimeout(context.Background(), cfg.MaxTime+30*time.Second)
	defer cancel()
	ccpu, scpu := cpusFor(c.Placement)
	ip, clientNS := l.serverIP(cfg.Topology)
	port := freePort()
	var d Dist
	err := l.withTool(c.Mode, func() error {
		srv, err := l.serve(ctx, scpu, "sockperf", ip, port, "sr", "--tcp", "-i", ip, "-p", strconv.Itoa(port))
		if err != nil {
			return err
		}
		defer func() { _ = srv.Process.Kill(); _ = srv.Wait() }()
		secs := max(1, int((cfg.MaxTime+time.Second-1)/time.Second))
		cli := l.toolCmd(ctx, clientNS, ccpu, "sockperf", "pp", "--tcp", "-i", ip, "-p", strconv.Itoa(port),
			"-m", strconv.Itoa(c.Size), "-t", strconv.Itoa(secs))
		out, err := cli.CombinedOutput()
		if err != nil {
			return fmt.Errorf("sockperf client: %v: %s", err, lastLine(out))
		}
		d, err = parseSockperf(out)
		return err
	})
	return d, err
}

func parseSockperf(out []byte) (Dist, error) {
	var d Dist
	sc := bufio.NewScanner(bytes.NewReader(out))
	for sc.Scan() {
		line := sc.Text()
		if i := strings.Index(line, "Total "); i >= 0 && strings.Contains(line, "observations") {
			_, _ = fmt.Sscanf(line[i:], "Total %d observations", &d.Count)
		}
		m := sockperfLine.FindStringSubmatch(line)
		if m == nil {
			continue
		}
		v, _ := strconv.ParseFloat(m[3], 64)
		us := time.Duration(v * float64(time.Microsecond))
		switch {
		case m[2] == "MAX":
			d.Max = us
		case m[1] == "50.000":
			d.P50 = us
		case m[1] == "99.000":
			d.P99 = us
		case m[1] == "99.900":
			d.P999 = us
		}
	}
	if d.P50 == 0 || d.Count == 0 {
		return d, fmt.Errorf("could not read sockperf's percentiles: %s", lastLine(out))
	}
	return d, nil
}

// iperfRun runs an iperf3 client for cfg.Duration and returns bytes received
// and the receiver's duration.
func iperfRun(l *Lab, c Cell, cfg ThroughputConfig) (runOutcome, error) {
	ctx, cancel := context.WithTimeout(context.Background(), cfg.Duration+30*time.Second)
	defer cancel()
	ccpu, scpu := cpusFor(c.Placement)
	ip, clientNS := l.serverIP(cfg.Topology)
	port := freePort()
	var n int64
	var wall, cpu time.Duration
	err := l.withTool(c.Mode, func() error {
		// One client per server: the server is killed after the run.
		srv, err := l.serve(ctx, scpu, "iperf3", ip, port, "-s", "-B", ip, "-p", strconv.Itoa(port))
		if err != nil {
			return err
		}
		defer func() { _ = srv.Process.Kill(); _ = srv.Wait() }()
		secs := max(1, int((cfg.Duration+time.Second-1)/time.Second))
		cli := l.toolCmd(ctx, clientNS, ccpu, "iperf3", "-c", ip, "-p", strconv.Itoa(port), "-t", strconv.Itoa(secs),
			"-l", strconv.Itoa(c.Size), "-J")
		clock, err := startCPU()
		if err != nil {
			return err
		}
		out, err := cli.Output()
		if err == nil {
			cpu, err = clock.elapsed()
		}
		if err != nil {
			return fmt.Errorf("iperf3 client: %v: %s", err, lastLine(out))
		}
		var r struct {
			End struct {
				SumReceived struct {
					Bytes   int64   `json:"bytes"`
					Seconds float64 `json:"seconds"`
				} `json:"sum_received"`
			} `json:"end"`
			Error string `json:"error"`
		}
		if err := json.Unmarshal(out, &r); err != nil || r.Error != "" {
			return fmt.Errorf("iperf3 result: %v %s", err, r.Error)
		}
		n, wall = r.End.SumReceived.Bytes, time.Duration(r.End.SumReceived.Seconds*float64(time.Second))
		return nil
	})
	return runOutcome{bytes: n, wall: wall, cpu: cpu}, err
}

func lastLine(b []byte) string {
	lines := strings.Split(strings.TrimSpace(string(b)), "\n")
	return lines[len(lines)-1]
}
