package bench

import (
	"net"
	"os"
	"strings"
	"testing"
	"time"
)

func TestParseSockperf(t *testing.T) {
	out := []byte(`sockperf: [Total Run] RunTime=1.001 sec; Warm up time=400 msec; SentMessages=11100; ReceivedMessages=11099
sockperf: ====> avg-latency=42.278 (std-dev=20.696)
sockperf: Total 6499 observations; each percentile contains 64.99 observations
sockperf: ---> <MAX> observation =  961.715
sockperf: ---> percentile 99.999 =  961.715
sockperf: ---> percentile 99.900 =  166.381
sockperf: ---> percentile 99.000 =   72.202
sockperf: ---> percentile 50.000 =   40.955
sockperf: ---> <MIN> observation =   13.299
`)
	d, err := parseSockperf(out)
	if err != nil {
		t.Fatal(err)
	}
	us := func(f float64) time.Duration { return time.Duration(f * float64(time.Microsecond)) }
	want := Dist{Count: 6499, P50: us(40.955), P99: us(72.202), P999: us(166.381), Max: us(961.715)}
	if d != want {
		t.Errorf("got %+v, want %+v", d, want)
	}
	if _, err := parseSockperf([]byte("sockperf: ERROR: connect failed")); err == nil {
		t.Error("no percentiles parsed as a result")
	}
}

func TestBaseline(t *testing.T) {
	for mode, want := range map[string]string{ModeShunt: ModeTCP, ModeUnix: ModeTCP, ModeSockperfShunt: ModeSockperfTCP, ModeIperfTCP: ModeIperfTCP} {
		if got := baseline(mode); got != want {
			t.Errorf("baseline(%s) = %s, want %s", mode, got, want)
		}
	}
}

// listening finds a listening socket by port in a process's namespace, once
// the process runs the named program, and nothing else.
func TestListening(t *testing.T) {
	ln, err := net.Listen("tcp", "127.0.0.1:0")
	if err != nil {
		t.Fatal(err)
	}
	port := ln.Addr().(*net.TCPAddr).Port
	comm, err := os.ReadFile("/proc/self/comm")
	if err != nil {
		t.Fatal(err)
	}
	self := strings.TrimSpace(string(comm))
	if !listening(os.Getpid(), self, port) {
		t.Errorf("port %d of %s not found listening", port, self)
	}
	if listening(os.Getpid(), "someone-else", port) {
		t.Error("found listening under another program's name")
	}
	c, err := net.Dial("tcp", ln.Addr().String())
	if err != nil {
		t.Fatal(err)
	}
	defer c.Close()
	if local := c.LocalAddr().(*net.TCPAddr).Port; listening(os.Getpid(), self, local) {
		t.Errorf("a connected socket (port %d) taken for a listener", local)
	}
	ln.Close()
	if listening(os.Getpid(), self, port) {
		t.Errorf("port %d still found listening after close", port)
	}
}
