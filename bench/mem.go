package bench

import (
	"fmt"
	"os"
	"strconv"
	"strings"
	"time"
)

// tcpMemPages reads the memory the kernel has charged to TCP, in pages: the
// "mem" of the TCP line in /proc/net/sockstat (the whole host, as tcp_mem
// counts it). Bytes redirected by sk_msg into a receive queue are charged
// here too; sk_skb redirect queues are not (kernel-notes.md).
func tcpMemPages() (int64, error) {
	b, err := os.ReadFile("/proc/net/sockstat")
	if err != nil {
		return 0, fmt.Errorf("TCP memory: %w", err)
	}
	return parseSockstatMem(string(b))
}

func parseSockstatMem(text string) (int64, error) {
	for _, line := range strings.Split(text, "\n") {
		fields := strings.Fields(line)
		if len(fields) == 0 || fields[0] != "TCP:" {
			continue
		}
		for i := 1; i+1 < len(fields); i++ {
			if fields[i] == "mem" {
				n, err := strconv.ParseInt(fields[i+1], 10, 64)
				if err != nil {
					return 0, fmt.Errorf("TCP memory: sockstat says mem %q", fields[i+1])
				}
				return n, nil
			}
		}
	}
	return 0, fmt.Errorf("TCP memory: no TCP mem in /proc/net/sockstat")
}

// memPeak samples TCP memory every few milliseconds until stopped and
// reports the peak above where it started, in bytes.
type memPeak struct {
	stop chan struct{}
	done chan memResult
}

func watchTCPMem() (*memPeak, error) {
	base, err := tcpMemPages()
	if err != nil {
		return nil, err
	}
	m := &memPeak{stop: make(chan struct{}), done: make(chan memResult, 1)}
	go func() {
		peak := base
		t := time.NewTicker(5 * time.Millisecond)
		defer t.Stop()
		for {
			select {
			case <-m.stop:
				m.done <- memResult{(peak - base) * int64(os.Getpagesize()), nil}
				return
			case <-t.C:
				n, err := tcpMemPages()
				if err != nil {
					m.done <- memResult{0, err}
					<-m.stop
					return
				}
				peak = max(peak, n)
			}
		}
	}()
	return m, nil
}

type memResult struct {
	peak int64
	err  error
}

// Stop returns the peak in bytes.
func (m *memPeak) Stop() (int64, error) {
	close(m.stop)
	r := <-m.done
	return max(0, r.peak), r.err
}
