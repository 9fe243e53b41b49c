package main

import (
	"bytes"
	"fmt"
	"io"
	"net"
	"net/http"
	"os"
	"path/filepath"
	"slices"
	"strconv"
	"strings"
	"syscall"
	"testing"
	"time"

	"golang.org/x/sys/unix"

	"github.com/shunt-project/shunt/bench"
	"github.com/shunt-project/shunt/bypass/bypasstest"
	"github.com/shunt-project/shunt/internal/testenv"
)

// BenchmarkAgentWithManyConnections runs `shunt agent` as its own process,
// with SHUNT_BENCH_CONNS (default 10,000) bypassed connections open in the
// cgroup it enabled, and measures a /metrics scrape (median and max of b.N)
// and the agent's resident memory (VmRSS after the scrapes, and its peak,
// VmHWM).
//
//	sudo go test -run '^$' -bench AgentWithManyConnections -benchtime 20x ./cmd/shunt
func BenchmarkAgentWithManyConnections(b *testing.B) {
	testenv.RequireRoot(b)
	n := 10_000
	if v := os.Getenv("SHUNT_BENCH_CONNS"); v != "" {
		n, _ = strconv.Atoi(v)
	}
	raiseFileLimit(b, n+1000)
	pin := bypasstest.MustPinDir(b)
	cg := testenv.MustCgroup(b)
	port := freePort(b)
	config := filepath.Join(b.TempDir(), "config.yaml")
	os.WriteFile(config, []byte(fmt.Sprintf("bypass:\n  cgroups: [%q]\nmetrics:\n  address: \"127.0.0.1:%d\"\n", cg.Path, port)), 0o644)

	var log bytes.Buffer
	agent := selfCommand("agent", "--config", config, "--pin-dir", pin, "--index-dir", filepath.Join(b.TempDir(), "none"))
	agent.Stderr = &log
	if err := agent.Start(); err != nil {
		b.Fatal(err)
	}
	b.Cleanup(func() {
		agent.Process.Signal(syscall.SIGTERM)
		agent.Wait()
	})
	url := fmt.Sprintf("http://127.0.0.1:%d/metrics", port)
	for start := time.Now(); ; time.Sleep(20 * time.Millisecond) {
		if _, err := scrapeOnce(url); err == nil {
			break
		}
		if time.Since(start) > 10*time.Second {
			b.Fatalf("the agent serves no metrics: %s", log.String())
		}
	}

	// n connections between two sockets of the enabled cgroup: the
	// clients in helper processes (a process may hold 20,000 descriptors
	// here), the servers here.
	ns := testenv.MustNetNS(b)
	side := testenv.Side{NS: ns, CG: cg}
	ln := testenv.Listen(b, side, "tcp4", "127.0.0.1:0")
	accepted := make(chan []net.Conn, 1)
	go func() {
		var all []net.Conn
		for range n {
			c, err := ln.Accept()
			if err != nil {
				break
			}
			all = append(all, c)
		}
		accepted <- all
	}()
	stop, err := bench.HoldConnections("tcp", ln.Addr().(*net.TCPAddr).Port, cg.Path, ns.Name, n)
	if err != nil {
		b.Fatal(err)
	}
	b.Cleanup(stop)
	servers := <-accepted
	b.Cleanup(func() {
		for _, c := range servers {
			c.Close()
		}
	})
	body, err := scrapeOnce(url)
	if err != nil {
		b.Fatal(err)
	}
	want := fmt.Sprintf("shunt_bypass_map_entries{map=\"sock_hash\"} %d", 2*n)
	if !strings.Contains(body, want+"\n") {
		b.Fatalf("the scrape lacks %q: %d connections not all bypassed", want, n)
	}

	var took []time.Duration
	b.ResetTimer()
	for range b.N {
		start := time.Now()
		if _, err := scrapeOnce(url); err != nil {
			b.Fatal(err)
		}
		took = append(took, time.Since(start))
	}
	b.StopTimer()
	slices.Sort(took)
	rss, hwm := memoryOf(b, agent.Process.Pid)
	b.ReportMetric(float64(took[len(took)/2].Microseconds())/1000, "scrape-ms-median")
	b.ReportMetric(float64(took[len(took)-1].Microseconds())/1000, "scrape-ms-max")
	b.ReportMetric(rss, "rss-MB")
	b.ReportMetric(hwm, "peak-rss-MB")
	b.ReportMetric(float64(n), "connections")
}

func scrapeOnce(url string) (string, error) {
	resp, err := http.Get(url)
	if err != nil {
		return "", err
	}
	defer resp.Body.Close()
	body, err := io.ReadAll(resp.Body)
	if resp.StatusCode != 200 {
		return "", fmt.Errorf("GET %s: %s", url, resp.Status)
	}
	return string(body), err
}

// memoryOf reads a process's VmRSS and VmHWM in MB.
func memoryOf(t testing.TB, pid int) (rss, hwm float64) {
	b, err := os.ReadFile(fmt.Sprintf("/proc/%d/status", pid))
	if err != nil {
		t.Fatal(err)
	}
	for _, line := range strings.Split(string(b), "\n") {
		var kb float64
		if _, err := fmt.Sscanf(line, "VmRSS: %f kB", &kb); err == nil {
			rss = kb / 1024
		}
		if _, err := fmt.Sscanf(line, "VmHWM: %f kB", &kb); err == nil {
			hwm = kb / 1024
		}
	}
	return rss, hwm
}

func freePort(t testing.TB) int {
	ln, err := net.Listen("tcp", "127.0.0.1:0")
	if err != nil {
		t.Fatal(err)
	}
	defer ln.Close()
	return ln.Addr().(*net.TCPAddr).Port
}

func raiseFileLimit(t testing.TB, n int) {
	var lim unix.Rlimit
	if err := unix.Getrlimit(unix.RLIMIT_NOFILE, &lim); err != nil {
		t.Fatal(err)
	}
	if lim.Cur >= uint64(n) {
		return
	}
	lim.Cur = max(lim.Cur, uint64(n))
	lim.Max = max(lim.Max, lim.Cur)
	if err := unix.Setrlimit(unix.RLIMIT_NOFILE, &lim); err != nil {
		t.Fatalf("raise the open files limit to %d: %v", n, err)
	}
}
