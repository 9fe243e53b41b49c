package bench

import (
	"bufio"
	"os"
	"strconv"
	"strings"
	"time"
)

// tcpMemPages reads the memory the kernel has charged to TCP, in pages: the
// "mem" of the TCP line in /proc/net/sockstat (the whole host, as tcp_mem
// counts it). Bytes redirected by sk_msg into a receive queue are charged
// here too; sk_skb redirect queues are not (kernel-notes.md).
func tcpMemPages() int64 {
	f, err := os.Open("/proc/net/sockstat")
	if err != nil {
		return 0
	}
	defer f.Close()
	sc := bufio.NewScanner(f)
	for sc.Scan() {
		fields := strings.Fields(sc.Text())
		if len(fields) == 0 || fields[0] != "TCP:" {
			continue
		}
		for i := 1; i+1 < len(fields); i++ {
			if fields[i] == "mem" {
				n, _ := strconv.ParseInt(fields[i+1], 10, 64)
				return n
			}
		}
	}
	return 0
}

// memPeak samples TCP memory every few milliseconds until stopped and
// reports the peak above where it started, in bytes.
type memPeak struct {
	stop chan struct{}
	done chan int64
}

func watchTCPMem() *memPeak {
	m := &memPeak{stop: make(chan struct{}), done: make(chan int64, 1)}
	base := tcpMemPages()
	go func() {
		peak := base
		t := time.NewTicker(5 * time.Millisecond)
		defer t.Stop()
		for {
			select {
			case <-m.stop:
				m.done <- (peak - base) * int64(os.Getpagesize())
				return
			case <-t.C:
				peak = max(peak, tcpMemPages())
			}
		}
	}()
	return m
}

// Stop returns the peak in bytes.
func (m *memPeak) Stop() int64 {
	close(m.stop)
	return max(0, <-m.done)
}
