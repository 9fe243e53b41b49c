package bench

import (
	"context"
	"encoding/binary"
	"fmt"
	"io"
	"math"
	"math/bits"
	"net/netip"
	"time"

	"golang.org/x/sys/unix"

	"github.com/shunt-project/shunt/fanout"
	"github.com/shunt-project/shunt/internal/lab"
)

// FanoutConfig is the Kylin talk's measurement: a source stamps each message
// with its send time, every subscriber takes the delivery latency.
type FanoutConfig struct {
	Sizes       []int // message bytes (at least 16: sequence and stamp)
	Rates       []int // messages per second
	Subscribers []int
	Paths       []fanout.Path
	// Slow lists how many extra subscribers connect and never read (one
	// run per value, interleaved): what they cost the others.
	Slow     []int
	Duration time.Duration // sending time per run
	Rounds   int
	Progress io.Writer
}

// FanoutResult is one path at one size, rate and subscriber count, over
// all rounds.
type FanoutResult struct {
	Path        string `json:"path"`
	Size        int    `json:"size"`
	Rate        int    `json:"rate"`
	Subscribers int    `json:"subscribers"` // reading ones
	Slow        int    `json:"slow"`        // extra ones that never read
	Sent        uint64 `json:"sent"`
	Delivered   uint64 `json:"delivered"` // messages read by subscribers
	// Undelivered: sent times subscribers, minus what was read by the end
	// of the run (at most 2 s after the source stopped): lost to full
	// queues or still queued because the path could not keep up.
	Undelivered uint64  `json:"undelivered"`
	Latency     Dist    `json:"latency"` // send to read, over every delivery
	CPUPerGB    float64 `json:"cpu_s_per_gb"`
	Stalled     bool    `json:"stalled"`
}

// CPUs: the relay loop on CPU 0; the source and all subscribers' reading on
// CPU 1, the same for every path.
const (
	fanoutRelayCPU  = 0
	fanoutClientCPU = 1
)

// RunFanout measures every cell, paths interleaved within each round.
func RunFanout(ctx context.Context, cfg FanoutConfig) ([]FanoutResult, error) {
	ns, err := lab.NewNetNS(lab.Name("shunt-test-fanout-"))
	if err != nil {
		return nil, err
	}
	defer ns.Close()
	type key struct {
		path                   fanout.Path
		size, rate, subs, slow int
	}
	slows := cfg.Slow
	if len(slows) == 0 {
		slows = []int{0}
	}
	acc := map[key]*fanoutAcc{}
	var order []key
	for round := 0; round < cfg.Rounds; round++ {
		for _, size := range cfg.Sizes {
			for _, rate := range cfg.Rates {
				for _, n := range cfg.Subscribers {
					for _, slow := range slows {
						for _, p := range cfg.Paths {
							if err := ctx.Err(); err != nil {
								return nil, err
							}
							k := key{p, size, rate, n, slow}
							if acc[k] == nil {
								acc[k] = &fanoutAcc{}
								order = append(order, k)
							}
							if cfg.Progress != nil {
								fmt.Fprintf(cfg.Progress, "fanout round %d: %s, %d B at %d/s to %d subscribers (+%d not reading)\n", round+1, p, size, rate, n, slow)
							}
							if err := fanoutRun(ctx, ns, cfg.Duration, p, size, rate, n, slow, acc[k]); err != nil {
								return nil, err
							}
						}
					}
				}
			}
		}
	}
	var out []FanoutResult
	for _, k := range order {
		a := acc[k]
		r := FanoutResult{Path: k.path.String(), Size: k.size, Rate: k.rate, Subscribers: k.subs, Slow: k.slow,
			Sent: a.sent, Delivered: a.delivered, Undelivered: a.undelivered, Latency: a.hist.dist()}
		if a.bytes > 0 {
			r.CPUPerGB = a.cpu.Seconds() / (float64(a.bytes) / 1e9)
		}
		r.Stalled = stalled(r.Latency)
		out = append(out, r)
	}
	return out, nil
}

type fanoutAcc struct {
	sent, delivered, undelivered, bytes uint64
	cpu                                 time.Duration
	hist                                histogram
}

// fanoutRun is one forwarder, n subscribers, one sending period.
func fanoutRun(ctx context.Context, ns *lab.NetNS, dur time.Duration, path fanout.Path, size, rate, n, slow int, acc *fanoutAcc) (err error) {
	var f *fanout.Forwarder
	cfg := fanout.Config{
		Source: netip.MustParseAddrPort("127.0.0.1:0"), Listen: netip.MustParseAddrPort("127.0.0.1:0"),
		Framing: fanout.FramingU32, Queue: fanout.DefaultQueue, Path: path, PinCPU: true, CPU: fanoutRelayCPU,
	}
	if err := ns.Do(func() (err error) { f, err = fanout.New(cfg); return err }); err != nil {
		return err
	}
	defer f.Close()
	runCtx, stop := context.WithCancel(ctx)
	done := make(chan error, 1)
	go func() { done <- f.Run(runCtx) }()
	// Run ends with nil once the context is done; an error it met before
	// spoils the run.
	defer func() {
		stop()
		if runErr := <-done; runErr != nil && err == nil {
			err = fmt.Errorf("fan-out forwarder: %w", runErr)
		}
	}()

	var subs, stalled []int
	defer func() { closeAll(subs); closeAll(stalled) }()
	var src int
	err = ns.Do(func() error {
		for i := 0; i < n; i++ {
			fd, err := dialTCP(f.ListenAddr())
			if err != nil {
				return err
			}
			subs = append(subs, fd)
		}
		for i := 0; i < slow; i++ {
			fd, err := dialTCP(f.ListenAddr())
			if err != nil {
				return err
			}
			// A small buffer fills at once: from then on the forwarder
			// queues and drops for it.
			_ = unix.SetsockoptInt(fd, unix.SOL_SOCKET, unix.SO_RCVBUF, 4096)
			stalled = append(stalled, fd)
		}
		var err error
		src, err = unix.Socket(unix.AF_INET, unix.SOCK_DGRAM|unix.SOCK_CLOEXEC, 0)
		if err != nil {
			return err
		}
		a := f.SourceAddr().Addr().As4()
		return unix.Connect(src, &unix.SockaddrInet4{Port: int(f.SourceAddr().Port()), Addr: a})
	})
	if err != nil {
		return fmt.Errorf("fanout bench set-up: %w", err)
	}
	defer unix.Close(src)
	// Let the forwarder accept them all before the clock starts.
	time.Sleep(20*time.Millisecond + time.Duration(n+slow)*20*time.Microsecond)

	unpin, err := pinThread(fanoutClientCPU)
	if err != nil {
		return err
	}
	defer unpin()
	rd, err := newFanoutReader(subs)
	if err != nil {
		return err
	}
	defer rd.close()

	clock, err := startCPU()
	if err != nil {
		return err
	}
	msg := make([]byte, size)
	start := time.Now()
	var sent uint64
	// Send what is due at the rate, reading whatever arrives in between;
	// waits are epoll timeouts (1 ms), so the rate holds on average and a
	// burst is at most a few milliseconds' worth.
	for {
		el := time.Since(start)
		if el >= dur {
			break
		}
		for due := uint64(el.Seconds() * float64(rate)); sent < due; {
			binary.LittleEndian.PutUint64(msg, sent)
			binary.LittleEndian.PutUint64(msg[8:], uint64(monotonicNs()))
			if _, err := unix.Write(src, msg); err != nil {
				break
			}
			sent++
		}
		if _, err := rd.poll(1, &acc.hist); err != nil {
			return err
		}
	}
	// Drain: stop when every subscriber has all it will get, nothing came
	// for 0.5 s, or after 2 s (a path that fell far behind would take long).
	want := sent * uint64(n)
	drainEnd := time.Now().Add(2 * time.Second)
	for quiet := time.Now(); rd.delivered < want && time.Since(quiet) < 500*time.Millisecond && time.Now().Before(drainEnd); {
		got, err := rd.poll(10, &acc.hist)
		if err != nil {
			return err
		}
		if got > 0 {
			quiet = time.Now()
		}
	}
	cpu, err := clock.elapsed()
	if err != nil {
		return err
	}
	acc.cpu += cpu
	acc.sent += sent
	acc.delivered += rd.delivered
	acc.bytes += rd.bytes
	acc.undelivered += want - min(want, rd.delivered)
	return nil
}

func dialTCP(ap netip.AddrPort) (int, error) {
	fd, err := unix.Socket(unix.AF_INET, unix.SOCK_STREAM|unix.SOCK_CLOEXEC, 0)
	if err != nil {
		return -1, err
	}
	if err := unix.Connect(fd, &unix.SockaddrInet4{Port: int(ap.Port()), Addr: ap.Addr().As4()}); err != nil {
		unix.Close(fd)
		return -1, err
	}
	if err := unix.SetNonblock(fd, true); err != nil {
		unix.Close(fd)
		return -1, err
	}
	return fd, nil
}

func monotonicNs() int64 {
	var ts unix.Timespec
	_ = unix.ClockGettime(unix.CLOCK_MONOTONIC, &ts)
	return ts.Nano()
}

// fanoutReader reads every subscriber's u32-framed stream on one thread and
// records each message's latency. It is on the measured machine, so it is
// kept cheap: buffers indexed by fd, an integer histogram.
type fanoutReader struct {
	ep               int
	bufs             [][]byte // partial frames, by fd
	delivered, bytes uint64
	events           []unix.EpollEvent
	rbuf             []byte
}

func newFanoutReader(fds []int) (*fanoutReader, error) {
	ep, err := unix.EpollCreate1(unix.EPOLL_CLOEXEC)
	if err != nil {
		return nil, err
	}
	maxFD := 0
	for _, fd := range fds {
		maxFD = max(maxFD, fd)
	}
	r := &fanoutReader{ep: ep, bufs: make([][]byte, maxFD+1), events: make([]unix.EpollEvent, 256), rbuf: make([]byte, 1<<18)}
	for _, fd := range fds {
		if err := unix.EpollCtl(ep, unix.EPOLL_CTL_ADD, fd, &unix.EpollEvent{Events: unix.EPOLLIN, Fd: int32(fd)}); err != nil {
			unix.Close(ep)
			return nil, err
		}
	}
	return r, nil
}

func (r *fanoutReader) close() { unix.Close(r.ep) }

// poll reads what is ready, waiting up to ms milliseconds; it returns the
// messages it completed. A subscriber's error or EOF is an error: a count
// that silently stopped would read as a slow path.
func (r *fanoutReader) poll(ms int, h *histogram) (int, error) {
	n, err := unix.EpollWait(r.ep, r.events, ms)
	if err == unix.EINTR {
		return 0, nil
	}
	if err != nil {
		return 0, fmt.Errorf("fan-out reader: epoll: %w", err)
	}
	got := 0
	for _, ev := range r.events[:n] {
		fd := int(ev.Fd)
		k, err := unix.Read(fd, r.rbuf)
		if err == unix.EAGAIN || err == unix.EINTR {
			continue // level-triggered: the rest comes next poll
		}
		if err != nil {
			return got, fmt.Errorf("fan-out reader: subscriber %d: %w", fd, err)
		}
		if k == 0 {
			return got, fmt.Errorf("fan-out reader: subscriber %d was closed by the forwarder", fd)
		}
		now := monotonicNs()
		b := r.rbuf[:k]
		if len(r.bufs[fd]) > 0 {
			b = append(r.bufs[fd], b...)
		}
		for len(b) >= 4 {
			l := int(binary.BigEndian.Uint32(b))
			if l == math.MaxUint32 { // gap marker
				if len(b) < 8 {
					break
				}
				b = b[8:]
				continue
			}
			if len(b) < 4+l {
				break
			}
			if l >= 16 {
				h.add(now - int64(binary.LittleEndian.Uint64(b[4+8:])))
			}
			r.delivered++
			r.bytes += uint64(4 + l)
			got++
			b = b[4+l:]
		}
		r.bufs[fd] = append(r.bufs[fd][:0], b...)
	}
	return got, nil
}

// histogram keeps latencies (ns) in buckets of 1/16 of a power of two, so
// that hundreds of millions of deliveries cost no memory and no logarithm;
// max is exact. Quantiles are bucket midpoints: within 3%.
type histogram struct {
	buckets [64 * 16]uint64
	count   uint64
	max     int64
}

func histBucket(ns int64) int {
	if ns < 16 {
		return int(max(ns, 0))
	}
	e := bits.Len64(uint64(ns)) - 1 // ns in [2^e, 2^(e+1))
	sub := int(ns>>(e-4)) & 15
	return e*16 + sub
}

func histLow(i int) float64 {
	e, sub := i/16, i%16
	if e < 4 {
		return float64(i)
	}
	return float64(uint64(16+sub) << (e - 4))
}

func (h *histogram) add(ns int64) {
	h.buckets[histBucket(ns)]++
	h.count++
	h.max = max(h.max, ns)
}

func (h *histogram) quantile(q float64) time.Duration {
	target := uint64(math.Ceil(q * float64(h.count)))
	var seen uint64
	for i, c := range h.buckets {
		seen += c
		if seen >= target && c > 0 {
			return min(time.Duration((histLow(i)+histLow(i+1))/2), time.Duration(h.max))
		}
	}
	return time.Duration(h.max)
}

func (h *histogram) dist() Dist {
	if h.count == 0 {
		return Dist{}
	}
	return Dist{Count: int(h.count), P50: h.quantile(0.5), P99: h.quantile(0.99), P999: h.quantile(0.999), Max: time.Duration(h.max)}
}
