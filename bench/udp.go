package bench

import (
	"context"
	"errors"
	"fmt"
	"io"
	"net"
	"slices"
	"sync"
	"sync/atomic"
	"time"

	"github.com/shunt-project/shunt/internal/lab"
	"github.com/shunt-project/shunt/internal/sockutil"
	"github.com/shunt-project/shunt/splice"
)

// UDPConfig measures two connected UDP sockets joined in the kernel
// (splice.UDPSplicer) against the user-space relay a UDP proxy runs: a
// goroutine per direction reading one socket and writing the other.
type UDPConfig struct {
	Sizes    []int    // datagram bytes
	Modes    []string // "kernel", "relay"
	Requests int      // round trips per request/response run
	BulkTime time.Duration
	Rounds   int
	Progress io.Writer
}

// UDPModes are the middles UDPConfig can measure.
var UDPModes = []string{"kernel", "relay"}

// UDPResult is one mode at one size over all rounds.
type UDPResult struct {
	Mode      string `json:"mode"`
	Size      int    `json:"size"`
	RoundTrip Dist   `json:"round_trip"` // request/response, pooled over rounds
	Lost      int    `json:"round_trips_lost"`
	// Bulk: the client sends as fast as it can; medians over rounds.
	Sent      uint64  `json:"bulk_sent"`
	Delivered uint64  `json:"bulk_delivered"`
	Gbps      float64 `json:"bulk_gbit_s"`
	CPUPerGB  float64 `json:"machine_cpu_s_per_gb"`
}

// CPUs as in the proxy benchmark: the middle on CPU 0, client and server on
// CPU 1, for every mode.
const (
	udpMiddleCPU = 0
	udpPeerCPU   = 1
)

// Check says what is wrong with cfg, if anything.
func (cfg UDPConfig) Check() error {
	for _, m := range cfg.Modes {
		if !slices.Contains(UDPModes, m) {
			return fmt.Errorf("mode %q: want kernel or relay", m)
		}
	}
	for _, s := range cfg.Sizes {
		if s < 8 || s > 65507 {
			return fmt.Errorf("size %d: want 8 to 65507 bytes", s)
		}
	}
	if cfg.Rounds < 1 || cfg.Requests < 1 || cfg.BulkTime <= 0 {
		return errors.New("rounds, requests and bulk time must be positive")
	}
	return nil
}

// RunUDP measures every size in every mode, modes interleaved in each round.
func RunUDP(ctx context.Context, cfg UDPConfig) ([]UDPResult, error) {
	if err := cfg.Check(); err != nil {
		return nil, err
	}
	ns, err := lab.NewNetNS(lab.Name("shunt-test-udp-"))
	if err != nil {
		return nil, err
	}
	defer ns.Close()
	type acc struct {
		hist            histogram
		lost            int
		sent, delivered []uint64
		gbps, cpu       []float64
	}
	accs := map[cell]*acc{}
	order, err := sweepCells(ctx, "udp", cfg.Rounds, cfg.Sizes, cfg.Modes, cfg.Progress, func(c cell) error {
		a := accs[c]
		if a == nil {
			a = &acc{}
			accs[c] = a
		}
		r, err := udpRun(ns, cfg, c.mode, c.size, &a.hist)
		if err != nil {
			return err
		}
		a.lost += r.lost
		a.sent = append(a.sent, r.sent)
		a.delivered = append(a.delivered, r.delivered)
		gb := float64(r.delivered) * float64(c.size) / 1e9
		a.gbps = append(a.gbps, gb*8/cfg.BulkTime.Seconds())
		if gb > 0 {
			a.cpu = append(a.cpu, r.cpu.Seconds()/gb)
		}
		return nil
	})
	if err != nil {
		return nil, err
	}
	var out []UDPResult
	for _, k := range order {
		a := accs[k]
		out = append(out, UDPResult{Mode: k.mode, Size: k.size, RoundTrip: a.hist.dist(), Lost: a.lost,
			Sent: median(a.sent), Delivered: median(a.delivered), Gbps: median(a.gbps), CPUPerGB: median(a.cpu)})
	}
	return out, nil
}

type udpRunResult struct {
	lost            int
	sent, delivered uint64
	cpu             time.Duration
}

// udpRun builds client <-> front, back <-> server, joins front and back by
// mode, and runs the round trips, then the bulk send.
func udpRun(ns *lab.NetNS, cfg UDPConfig, mode string, size int, h *histogram) (r udpRunResult, err error) {
	var client, front, back, server *net.UDPConn
	err = ns.Do(func() (err error) {
		if client, front, err = connectedUDP(); err == nil {
			back, server, err = connectedUDP()
		}
		return err
	})
	if err != nil {
		return r, err
	}
	defer func() {
		for _, c := range []*net.UDPConn{client, front, back, server} {
			if c != nil {
				c.Close()
			}
		}
	}()
	stop, err := joinUDP(mode, front, back)
	if err != nil {
		return r, err
	}
	defer stop()

	// Request/response: the server echoes on CPU 1, the client too.
	echoDone := make(chan struct{})
	go func() {
		defer close(echoDone)
		if unpin, err := pinThread(udpPeerCPU); err == nil {
			defer unpin()
		}
		buf := make([]byte, 65536)
		for {
			n, err := server.Read(buf)
			if err != nil {
				return
			}
			_, _ = server.Write(buf[:n])
		}
	}()
	unpin, err := pinThread(udpPeerCPU)
	if err != nil {
		return r, err
	}
	msg := make([]byte, size)
	buf := make([]byte, 65536)
	for i := 0; i < cfg.Requests; i++ {
		start := time.Now()
		_, _ = client.Write(msg)
		client.SetReadDeadline(start.Add(time.Second))
		if _, err := client.Read(buf); err != nil {
			r.lost++
			continue
		}
		h.add(int64(time.Since(start)))
	}
	unpin()
	server.SetReadDeadline(time.Now()) // ends the echo
	<-echoDone
	server.SetReadDeadline(time.Time{})
	client.SetReadDeadline(time.Time{})

	// Bulk: the client sends for BulkTime; the server counts what arrives
	// until 200 ms after.
	var delivered atomic.Uint64
	var wg sync.WaitGroup
	wg.Add(1)
	go func() {
		defer wg.Done()
		if unpin, err := pinThread(udpPeerCPU); err == nil {
			defer unpin()
		}
		for {
			if _, err := server.Read(buf); err != nil {
				return
			}
			delivered.Add(1)
		}
	}()
	unpin, err = pinThread(udpPeerCPU)
	if err != nil {
		return r, err
	}
	clock, err := startCPU()
	if err != nil {
		return r, err
	}
	end := time.Now().Add(cfg.BulkTime)
	for time.Now().Before(end) {
		for range 64 {
			if _, err := client.Write(msg); err == nil {
				r.sent++
			}
		}
	}
	time.Sleep(200 * time.Millisecond)
	r.cpu, err = clock.elapsed()
	unpin()
	server.SetReadDeadline(time.Now())
	wg.Wait()
	r.delivered = delivered.Load()
	return r, nil
}

// connectedUDP returns two UDP sockets on 127.0.0.1 connected to each other.
func connectedUDP() (x, y *net.UDPConn, err error) {
	if x, err = net.ListenUDP("udp", &net.UDPAddr{IP: net.IPv4(127, 0, 0, 1)}); err != nil {
		return nil, nil, err
	}
	xa := x.LocalAddr().(*net.UDPAddr)
	if y, err = net.DialUDP("udp", nil, xa); err != nil {
		x.Close()
		return nil, nil, err
	}
	x.Close()
	if x, err = net.DialUDP("udp", xa, y.LocalAddr().(*net.UDPAddr)); err != nil {
		y.Close()
		return nil, nil, err
	}
	for _, c := range []*net.UDPConn{x, y} {
		_ = c.SetReadBuffer(8 << 20)
		_ = c.SetWriteBuffer(8 << 20)
	}
	return x, y, nil
}

// joinUDP starts the middle between front and back; stop ends it.
func joinUDP(mode string, front, back *net.UDPConn) (stop func(), err error) {
	if mode == "kernel" {
		s, err := splice.NewUDP(splice.UDPOptions{MaxPairs: 1})
		if err != nil {
			return nil, err
		}
		// The splicer closes what it joins: give it copies.
		fa, err := sockutil.DupUDP(front)
		if err != nil {
			s.Close()
			return nil, err
		}
		fb, err := sockutil.DupUDP(back)
		if err != nil {
			fa.Close()
			s.Close()
			return nil, err
		}
		if _, err := s.Join(fa, fb); err != nil {
			fa.Close()
			fb.Close()
			s.Close()
			return nil, err
		}
		return func() { s.Close() }, nil
	}
	var wg sync.WaitGroup
	relay := func(from, to *net.UDPConn) {
		defer wg.Done()
		if unpin, err := pinThread(udpMiddleCPU); err == nil {
			defer unpin()
		}
		buf := make([]byte, 65536)
		for {
			n, err := from.Read(buf)
			if err != nil {
				return
			}
			_, _ = to.Write(buf[:n])
		}
	}
	wg.Add(2)
	go relay(front, back)
	go relay(back, front)
	return func() {
		front.SetReadDeadline(time.Now())
		back.SetReadDeadline(time.Now())
		wg.Wait()
	}, nil
}
