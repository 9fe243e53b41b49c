package bench

import (
	"context"
	"fmt"
	"sync"
	"sync/atomic"
	"time"

	"golang.org/x/sys/unix"
)

// BackpressureConfig is the LSF/MM/BPF 2026 talk's test: producers at
// different rates into one consumer that reads slower than they write.
type BackpressureConfig struct {
	Modes        []string      // ModeTCP, ModeBare, ModeShunt
	Topology     string        // Veth or Loopback
	Rounds       int           // interleaved rounds
	Duration     time.Duration // how long producers produce
	ProducerKBps []int         // one producer per rate (KB/s)
	ConsumerKBps int           // what the consumer reads from each producer (KB/s)
	Interval     time.Duration // sampling interval
	Progress     func(string)
}

// BackpressureSample is the state at one moment of a run.
type BackpressureSample struct {
	AtMs int64 `json:"at_ms"`
	// InFlight is what the producers' write() calls accepted and the
	// consumer has not read: what an application cannot take back.
	InFlight int64 `json:"in_flight_bytes"`
	// Queued is the consumer sockets' FIONREAD: bytes waiting to be read.
	Queued int64 `json:"consumer_queued_bytes"`
	// TCPMem is the host's TCP memory above its level at the start.
	TCPMem int64 `json:"tcp_mem_bytes"`
}

// BackpressureResult is one run of one mode.
type BackpressureResult struct {
	Mode         string               `json:"mode"`
	Round        int                  `json:"round"`
	Samples      []BackpressureSample `json:"samples"`
	PeakInFlight int64                `json:"peak_in_flight_bytes"`
	ProducedKBps []float64            `json:"produced_kb_per_s"` // achieved, per producer
	ConsumedKBps float64              `json:"consumed_kb_per_s"` // total
}

// RunBackpressure runs the test for each mode, rounds outermost.
func RunBackpressure(ctx context.Context, l *Lab, cfg BackpressureConfig) ([]BackpressureResult, error) {
	if cfg.Rounds < 1 || cfg.Duration <= 0 || len(cfg.ProducerKBps) == 0 || cfg.ConsumerKBps <= 0 || cfg.Interval <= 0 {
		return nil, fmt.Errorf("need rounds, a duration, producer rates, a consumer rate and an interval above 0")
	}
	var out []BackpressureResult
	for r := 1; r <= cfg.Rounds; r++ {
		for _, mode := range cfg.Modes {
			if err := ctx.Err(); err != nil {
				return nil, err
			}
			if cfg.Progress != nil {
				cfg.Progress(fmt.Sprintf("round %d/%d %s (%v)", r, cfg.Rounds, mode, cfg.Duration))
			}
			res, err := backpressureRun(ctx, l, mode, cfg)
			if err != nil {
				return nil, fmt.Errorf("%s: %w", mode, err)
			}
			res.Round = r
			out = append(out, res)
		}
	}
	return out, nil
}

// paced moves chunk bytes every tick until stop, counting what moved.
func paced(kbps int, tick time.Duration, stop <-chan struct{}, moved *atomic.Int64, move func(n int) (int, error)) error {
	chunk := max(1, kbps*1000*int(tick/time.Millisecond)/1000)
	t := time.NewTicker(tick)
	defer t.Stop()
	for {
		select {
		case <-stop:
			return nil
		case <-t.C:
		}
		for left := chunk; left > 0; {
			n, err := move(left)
			if err != nil {
				select {
				case <-stop: // the run is over: sockets were shut down under us
					return nil
				default:
					return err
				}
			}
			moved.Add(int64(n))
			left -= n
			select {
			case <-stop:
				return nil
			default:
			}
		}
	}
}

func backpressureRun(ctx context.Context, l *Lab, mode string, cfg BackpressureConfig) (BackpressureResult, error) {
	res := BackpressureResult{Mode: mode}
	type pair struct{ c, s int }
	var pairs []pair
	defer func() {
		for _, p := range pairs {
			unix.Close(p.c)
			unix.Close(p.s)
		}
	}()
	for range cfg.ProducerKBps {
		c, s, err := l.connect(mode, cfg.Topology)
		if err != nil {
			return res, err
		}
		pairs = append(pairs, pair{c, s})
		if err := warm(c, s); err != nil {
			return res, err
		}
	}
	const tick = 10 * time.Millisecond
	stop := make(chan struct{})
	produced := make([]atomic.Int64, len(pairs))
	var consumed atomic.Int64
	errs := make(chan error, 2*len(pairs))
	var wg sync.WaitGroup
	for i, p := range pairs {
		wg.Add(2)
		go func() { // producer: writes that wait for room, as an application's would
			defer wg.Done()
			buf := make([]byte, 64<<10)
			errs <- paced(cfg.ProducerKBps[i], tick, stop, &produced[i], func(n int) (int, error) {
				return writeSome(p.c, buf[:min(n, len(buf))])
			})
		}()
		go func() { // consumer of this producer
			defer wg.Done()
			buf := make([]byte, 64<<10)
			errs <- paced(cfg.ConsumerKBps, tick, stop, &consumed, func(n int) (int, error) {
				n = min(n, len(buf))
				return n, readFull(p.s, buf[:n])
			})
		}()
	}

	base, err := tcpMemPages()
	if err != nil {
		return res, err
	}
	start := time.Now()
	var memErr error
	sample := func() {
		var in, q int64
		for i := range pairs {
			in += produced[i].Load()
		}
		in -= consumed.Load()
		for _, p := range pairs {
			if n, err := unix.IoctlGetInt(p.s, unix.SIOCINQ); err == nil {
				q += int64(n)
			}
		}
		mem, err := tcpMemPages()
		if err != nil && memErr == nil {
			memErr = err
		}
		s := BackpressureSample{AtMs: time.Since(start).Milliseconds(), InFlight: in, Queued: q,
			TCPMem: (mem - base) * int64(unix.Getpagesize())}
		res.Samples = append(res.Samples, s)
		res.PeakInFlight = max(res.PeakInFlight, in)
	}
	t := time.NewTicker(cfg.Interval)
	deadline := time.After(cfg.Duration)
loop:
	for {
		select {
		case <-ctx.Done():
			break loop
		case <-deadline:
			break loop
		case <-t.C:
			sample()
		}
	}
	t.Stop()
	sample()
	secs := time.Since(start).Seconds()
	close(stop)
	var notBypassed error
	for _, p := range pairs { // before the shutdowns below end the flows
		if notBypassed == nil {
			notBypassed = l.requireBypassed(mode, p.c)
		}
	}
	// Unblock producers stuck in write and consumers in read.
	for _, p := range pairs {
		_ = unix.Shutdown(p.c, unix.SHUT_RDWR)
		_ = unix.Shutdown(p.s, unix.SHUT_RDWR)
	}
	wg.Wait()
	close(errs)
	for err := range errs {
		if err != nil {
			return res, err
		}
	}
	if notBypassed != nil {
		return res, notBypassed
	}
	if memErr != nil {
		return res, memErr
	}
	for i := range pairs {
		res.ProducedKBps = append(res.ProducedKBps, float64(produced[i].Load())/1000/secs)
	}
	res.ConsumedKBps = float64(consumed.Load()) / 1000 / secs
	return res, ctx.Err()
}
