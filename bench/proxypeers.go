package bench

import (
	"errors"
	"fmt"
	"net"
	"os"
	"strings"
	"sync"
	"time"

	"golang.org/x/sys/unix"

	"github.com/shunt-project/shunt/internal/lab"
)

// upstream is the server behind the proxies: an echo port for
// request/response and a sink port for bulk transfers, served on peerCPU.
type upstream struct {
	echo, sink         net.Listener
	echoPort, sinkPort int
	sunk               chan bulkResult // one per sink connection that got bytes
	wg                 sync.WaitGroup
}

type bulkResult struct {
	bytes   int64
	elapsed time.Duration // first byte to EOF
	maxGap  time.Duration // longest wait between two reads
	gaps    int           // waits over StallLimit
}

func startUpstream(ns *lab.NetNS) (*upstream, error) {
	u := &upstream{sunk: make(chan bulkResult, 4)}
	err := ns.Do(func() error {
		var err error
		if u.echo, err = net.Listen("tcp", "127.0.0.1:0"); err != nil {
			return err
		}
		u.sink, err = net.Listen("tcp", "127.0.0.1:0")
		return err
	})
	if err != nil {
		if u.echo != nil {
			u.echo.Close()
		}
		return nil, err
	}
	u.echoPort = u.echo.Addr().(*net.TCPAddr).Port
	u.sinkPort = u.sink.Addr().(*net.TCPAddr).Port
	u.serve(u.echo, echoConn)
	u.serve(u.sink, func(fd int) {
		if r := sinkConn(fd); r.bytes > 0 {
			u.sunk <- r
		}
	})
	return u, nil
}

func (u *upstream) close() {
	u.echo.Close()
	u.sink.Close()
	u.wg.Wait()
}

// serve hands each connection, as a blocking descriptor, to fn on a thread
// pinned to peerCPU.
func (u *upstream) serve(ln net.Listener, fn func(fd int)) {
	u.wg.Add(1)
	go func() {
		defer u.wg.Done()
		for {
			c, err := ln.Accept()
			if err != nil {
				return
			}
			f, err := c.(*net.TCPConn).File()
			c.Close()
			if err != nil {
				continue
			}
			u.wg.Add(1)
			go func() {
				defer u.wg.Done()
				defer f.Close()
				if unpin, err := pinThread(peerCPU); err == nil {
					defer unpin()
				}
				fn(int(f.Fd()))
			}()
		}
	}()
}

// The peers' reads go through readSome: a blocking read of a socket bypass
// holds can still end in EAGAIN (shunt-shortcut's install trusts readers, and
// a reader woken by bytes that came by TCP while it waited for redirected
// ones gets EAGAIN on 6.18), which an event loop takes as "wait for more".
func echoConn(fd int) {
	buf := make([]byte, 256<<10)
	for {
		n, err := readSome(fd, buf)
		if err != nil || n == 0 || writeFull(fd, buf[:n]) != nil {
			return
		}
	}
}

func sinkConn(fd int) bulkResult {
	buf := make([]byte, 1<<20)
	var r bulkResult
	var first, last time.Time
	for {
		n, err := readSome(fd, buf)
		if err != nil || n == 0 {
			break
		}
		now := time.Now()
		if r.bytes == 0 {
			first = now
		} else if gap := now.Sub(last); gap > r.maxGap {
			r.maxGap = gap
		}
		if r.bytes > 0 && now.Sub(last) > StallLimit {
			r.gaps++
		}
		last = now
		r.bytes += int64(n)
	}
	r.elapsed = last.Sub(first)
	return r
}

// dialBlocking connects from ns and returns a blocking descriptor.
func dialBlocking(ns *lab.NetNS, addr string) (*os.File, error) {
	var c net.Conn
	err := ns.Do(func() error {
		var err error
		c, err = net.DialTimeout("tcp", addr, 5*time.Second)
		return err
	})
	if err != nil {
		return nil, err
	}
	defer c.Close()
	_ = c.(*net.TCPConn).SetNoDelay(true)
	return c.(*net.TCPConn).File()
}

// requestResponse sends size-byte requests one at a time and times each echo.
func requestResponse(ns *lab.NetNS, addr string, size, count int, maxTime time.Duration) ([]time.Duration, error) {
	f, err := dialBlocking(ns, addr)
	if err != nil {
		return nil, err
	}
	defer f.Close()
	unpin, err := pinThread(peerCPU)
	if err != nil {
		return nil, err
	}
	defer unpin()
	fd := int(f.Fd())
	req, resp := make([]byte, size), make([]byte, size)
	samples := make([]time.Duration, 0, count)
	end := time.Now().Add(maxTime)
	for i := 0; i < count && time.Now().Before(end); i++ {
		t0 := time.Now()
		if err := writeFull(fd, req); err != nil {
			return nil, err
		}
		if err := readFull(fd, resp); err != nil {
			return nil, err
		}
		samples = append(samples, time.Since(t0))
	}
	if len(samples) == 0 {
		return nil, errors.New("no round trip completed")
	}
	return samples, nil
}

// bulk writes block-sized writes for d, closes, and returns what the sink saw.
func bulk(ns *lab.NetNS, u *upstream, addr string, block int, d time.Duration) (bulkResult, error) {
	f, err := dialBlocking(ns, addr)
	if err != nil {
		return bulkResult{}, err
	}
	unpin, err := pinThread(peerCPU)
	if err != nil {
		f.Close()
		return bulkResult{}, err
	}
	fd := int(f.Fd())
	buf := make([]byte, block)
	end := time.Now().Add(d)
	for time.Now().Before(end) {
		if err := writeFull(fd, buf); err != nil {
			unpin()
			f.Close()
			return bulkResult{}, err
		}
	}
	_ = unix.Shutdown(fd, unix.SHUT_WR)
	unpin()
	defer f.Close()
	select {
	case r := <-u.sunk:
		return r, nil
	case <-time.After(d + 30*time.Second):
		return bulkResult{}, fmt.Errorf("the upstream never saw the end of the transfer")
	}
}

// lockedWriter collects a subprocess's output from two pipes.
type lockedWriter struct {
	mu sync.Mutex
	b  *strings.Builder
}

func (w *lockedWriter) Write(p []byte) (int, error) {
	w.mu.Lock()
	defer w.mu.Unlock()
	return w.b.Write(p)
}
