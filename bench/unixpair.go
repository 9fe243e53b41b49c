package bench

import (
	"context"
	"errors"
	"fmt"
	"io"
	"net"
	"os"
	"slices"
	"sync"
	"time"

	"golang.org/x/sys/unix"

	"github.com/shunt-project/shunt/internal/lab"
	"github.com/shunt-project/shunt/splice"
)

// UnixConfig measures a unix stream socket joined with a TCP one (a
// sidecar: its application on the unix socket, its connection out on TCP)
// by splice.Splicer against the copy loop a sidecar runs.
type UnixConfig struct {
	Sizes    []int    // request and response bytes
	Modes    []string // "kernel", "copy"
	Requests int      // round trips per request/response run
	BulkTime time.Duration
	Rounds   int
	Progress io.Writer
}

// UnixModes are the middles UnixConfig can measure.
var UnixModes = []string{"kernel", "copy"}

// UnixResult is one mode at one size over all rounds.
type UnixResult struct {
	Mode      string `json:"mode"`
	Size      int    `json:"size"`
	RoundTrip Dist   `json:"round_trip"` // request/response, pooled over rounds
	// Bulk: the TCP server sends to the application for BulkTime; medians
	// over rounds.
	Gbps        float64 `json:"bulk_gbit_s"`
	CPUPerGB    float64 `json:"machine_cpu_s_per_gb"`
	KernelShare float64 `json:"bulk_kernel_share"` // of the bulk bytes, moved by the kernel
}

// Check says what is wrong with cfg, if anything.
func (cfg UnixConfig) Check() error {
	for _, m := range cfg.Modes {
		if !slices.Contains(UnixModes, m) {
			return fmt.Errorf("mode %q: want kernel or copy", m)
		}
	}
	for _, s := range cfg.Sizes {
		if s < 1 || s > 16<<20 {
			return fmt.Errorf("size %d: want 1 byte to 16 MiB", s)
		}
	}
	if len(cfg.Sizes) == 0 || len(cfg.Modes) == 0 || cfg.Rounds < 1 || cfg.Requests < 1 || cfg.BulkTime <= 0 {
		return errors.New("sizes, modes, rounds, requests and bulk time must be given")
	}
	return nil
}

// RunUnix measures every size in every mode, modes interleaved in each round.
// The application and the TCP server run on CPU 1. The middle's goroutines
// are left to Go's scheduler in both modes: the Splicer's own (which copy
// unix to TCP, and TCP to unix while flow control holds that direction in
// user space) cannot be pinned from here, so the copy loop is not either.
func RunUnix(ctx context.Context, cfg UnixConfig) ([]UnixResult, error) {
	if err := cfg.Check(); err != nil {
		return nil, err
	}
	ns, err := lab.NewNetNS(lab.Name("shunt-test-unix-"))
	if err != nil {
		return nil, err
	}
	defer ns.Close()
	type acc struct {
		hist              histogram
		gbps, cpu, kshare []float64
	}
	accs := map[cell]*acc{}
	order, err := sweepCells(ctx, "unix", cfg.Rounds, cfg.Sizes, cfg.Modes, cfg.Progress, func(c cell) error {
		a := accs[c]
		if a == nil {
			a = &acc{}
			accs[c] = a
		}
		r, err := unixRun(ns, cfg, c.mode, c.size, &a.hist)
		if err != nil {
			return err
		}
		gb := float64(r.bytes) / 1e9
		a.gbps = append(a.gbps, gb*8/r.wall.Seconds())
		if gb > 0 {
			a.cpu = append(a.cpu, r.cpu.Seconds()/gb)
			a.kshare = append(a.kshare, float64(r.kernel)/float64(r.bytes))
		}
		return nil
	})
	if err != nil {
		return nil, err
	}
	var out []UnixResult
	for _, k := range order {
		a := accs[k]
		out = append(out, UnixResult{Mode: k.mode, Size: k.size, RoundTrip: a.hist.dist(),
			Gbps: median(a.gbps), CPUPerGB: median(a.cpu), KernelShare: median(a.kshare)})
	}
	return out, nil
}

type unixRunResult struct {
	bytes, kernel uint64
	wall, cpu     time.Duration
}

// unixRun builds app <-> ours (unix) and back <-> server (TCP on loopback in
// ns), joins ours and back by mode, runs the round trips (the server echoes),
// then the bulk send from the server to the application.
func unixRun(ns *lab.NetNS, cfg UnixConfig, mode string, size int, h *histogram) (r unixRunResult, err error) {
	fds, err := unix.Socketpair(unix.AF_UNIX, unix.SOCK_STREAM|unix.SOCK_CLOEXEC, 0)
	if err != nil {
		return r, err
	}
	app, ours := unixFileConn(fds[0]), unixFileConn(fds[1])
	var back, server *net.TCPConn
	err = ns.Do(func() error {
		var e error
		back, server, e = loopbackTCP()
		return e
	})
	if err != nil {
		app.Close()
		ours.Close()
		return r, err
	}
	defer app.Close()
	defer server.Close()
	kernel, stop, err := joinUnix(mode, ours, back)
	if err != nil {
		return r, err
	}
	defer stop()

	// Request/response: the server echoes what it reads.
	echoDone := make(chan error, 1)
	go func() {
		if unpin, err := pinThread(udpPeerCPU); err == nil {
			defer unpin()
		}
		buf := make([]byte, size)
		for i := 0; i < cfg.Requests; i++ {
			if _, err := io.ReadFull(server, buf); err != nil {
				echoDone <- err
				return
			}
			if _, err := server.Write(buf); err != nil {
				echoDone <- err
				return
			}
		}
		echoDone <- nil
	}()
	unpin, err := pinThread(udpPeerCPU)
	if err != nil {
		return r, err
	}
	msg := make([]byte, size)
	buf := make([]byte, size)
	for i := 0; i < cfg.Requests; i++ {
		start := time.Now()
		if _, err := app.Write(msg); err != nil {
			unpin()
			return r, err
		}
		if _, err := io.ReadFull(app, buf); err != nil {
			unpin()
			return r, err
		}
		h.add(int64(time.Since(start)))
	}
	unpin()
	if err := <-echoDone; err != nil {
		return r, err
	}

	// Bulk: the server writes for BulkTime, the application reads all of it.
	k0 := kernel()
	var wg sync.WaitGroup
	wg.Add(1)
	var werr error
	go func() {
		defer wg.Done()
		if unpin, err := pinThread(udpPeerCPU); err == nil {
			defer unpin()
		}
		chunk := make([]byte, 256<<10)
		end := time.Now().Add(cfg.BulkTime)
		for time.Now().Before(end) {
			if _, werr = server.Write(chunk); werr != nil {
				return
			}
		}
		werr = server.CloseWrite()
	}()
	unpin, err = pinThread(udpPeerCPU)
	if err != nil {
		return r, err
	}
	cpu0, t0 := machineCPU(), time.Now()
	rbuf := make([]byte, 256<<10)
	for {
		n, err := app.Read(rbuf)
		r.bytes += uint64(n)
		if err != nil {
			break
		}
	}
	r.wall, r.cpu = time.Since(t0), machineCPU()-cpu0
	unpin()
	wg.Wait()
	r.kernel = kernel() - k0
	return r, werr
}

func unixFileConn(fd int) *net.UnixConn {
	f := os.NewFile(uintptr(fd), "unix")
	defer f.Close()
	c, _ := net.FileConn(f)
	return c.(*net.UnixConn)
}

// loopbackTCP returns a connected pair of TCP sockets on 127.0.0.1.
func loopbackTCP() (c, s *net.TCPConn, err error) {
	ln, err := net.ListenTCP("tcp4", &net.TCPAddr{IP: net.IPv4(127, 0, 0, 1)})
	if err != nil {
		return nil, nil, err
	}
	defer ln.Close()
	if c, err = net.DialTCP("tcp4", nil, ln.Addr().(*net.TCPAddr)); err != nil {
		return nil, nil, err
	}
	if s, err = ln.AcceptTCP(); err != nil {
		c.Close()
		return nil, nil, err
	}
	c.SetNoDelay(true)
	s.SetNoDelay(true)
	return c, s, nil
}

// joinUnix starts the middle between ours and back; kernel reports the bytes
// the kernel has moved towards the application, stop ends the middle and
// closes both sockets.
func joinUnix(mode string, ours *net.UnixConn, back *net.TCPConn) (kernel func() uint64, stop func(), err error) {
	if mode == "kernel" {
		s, err := splice.New(splice.Options{MaxPairs: 1})
		if err != nil {
			ours.Close()
			back.Close()
			return nil, nil, err
		}
		p, err := s.Join(ours, back)
		if err != nil {
			ours.Close()
			back.Close()
			s.Close()
			return nil, nil, err
		}
		kernel = func() uint64 { _, ba := p.Stats(); return ba.Kernel }
		return kernel, func() { s.Close() }, nil
	}
	var wg sync.WaitGroup
	relay := func(from, to interface {
		io.Reader
		io.Writer
		CloseWrite() error
	}) {
		defer wg.Done()
		buf := make([]byte, 256<<10)
		for {
			n, err := from.Read(buf)
			if n > 0 {
				if _, err := to.Write(buf[:n]); err != nil {
					return
				}
			}
			if err != nil {
				to.CloseWrite()
				return
			}
		}
	}
	wg.Add(2)
	go relay(ours, back)
	go relay(back, ours)
	return func() uint64 { return 0 }, func() {
		ours.Close()
		back.Close()
		wg.Wait()
	}, nil
}
