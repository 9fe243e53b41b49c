package bench

import (
	"cmp"
	"context"
	"fmt"
	"time"

	"golang.org/x/sys/unix"
)

// ThroughputConfig says what to measure; the matrix sizes are write sizes.
type ThroughputConfig struct {
	Matrix
	Duration time.Duration // how long the sender writes, per run
	// Nagle leaves Nagle's algorithm on at the writer, as a program that
	// never sets TCP_NODELAY has it: TCP then gathers small writes into
	// segments while earlier ones are unacknowledged.
	Nagle bool
	// ReadSize is the receiver's buffer, what one read may take (0:
	// DefaultReadSize). A redirect's reader copies under its socket's
	// lock, which the writer's next redirect waits for.
	ReadSize int
}

// DefaultReadSize is the throughput receiver's buffer.
const DefaultReadSize = 256 << 10

// ThroughputResult is one cell over all rounds.
type ThroughputResult struct {
	Topology    string    `json:"topology"`
	Placement   string    `json:"placement"`
	Mode        string    `json:"mode"`
	WriteSize   int       `json:"write_size"`
	ReadSize    int       `json:"read_size,omitempty"` // the receiver's buffer (none for iperf3's modes: its own)
	RoundGbps   []float64 `json:"round_gbit_per_s"`
	MedianGbps  float64   `json:"median_gbit_per_s"`
	CPUSecPerGB float64   `json:"machine_cpu_s_per_gb"`
	// PeakTCPMemMiB is the most memory TCP held above its level at the
	// start of a run (max over rounds): bytes sent but not yet read.
	PeakTCPMemMiB float64 `json:"peak_tcp_mem_mib"`
	RatioToTCP    float64 `json:"ratio_to_tcp,omitempty"`
	// Bypass says how the install treated the rounds' connections; nil
	// for modes without one.
	Bypass *RoundsBypassed `json:"bypass,omitempty"`
}

// RoundsBypassed is what an install did with a cell's connections.
type RoundsBypassed struct {
	// RedirectedShare is the share of the bytes read that the writer sent
	// by redirect, over all rounds; the rest took TCP (flow control, a
	// reader behind, a connection sent back).
	RedirectedShare float64 `json:"redirected_share"`
	// SentBackRuns counts the rounds whose connection a rule sent back to
	// plain TCP (a reader behind its writer, small writes with Nagle's
	// algorithm on), as a user's would be.
	SentBackRuns int `json:"sent_back_runs"`
	// ThrottlesPerRun is the median over rounds of the times flow control
	// moved the stream to TCP (its reader past the bound); each time the
	// stream stays there until the reader has read every TCP byte.
	ThrottlesPerRun float64 `json:"throttles_per_run"`
}

// runOutcome is what one run measured.
type runOutcome struct {
	bytes int64         // the receiver read
	wall  time.Duration // from the first write until the receiver read the last byte
	cpu   time.Duration // the whole machine's, meanwhile
	// redirected of the bytes went by redirect, and the install sent the
	// connection back to TCP (modes with an install).
	redirected int64
	sentBack   bool
	throttles  uint64
}

// RunThroughput streams one way for cfg.Duration per run; throughput counts
// bytes the receiver got until it read the last one.
func RunThroughput(ctx context.Context, l *Lab, cfg ThroughputConfig) ([]ThroughputResult, error) {
	if err := cfg.Validate(); err != nil {
		return nil, err
	}
	type acc struct {
		gbps       []float64
		cpu        time.Duration
		bytes      int64
		peak       int64
		redirected int64
		sentBack   int
		throttles  []float64
	}
	accs := map[Cell]*acc{}
	err := cfg.run(ctx, func(c Cell) error {
		run := throughputRun
		if _, _, ext := ExternalMode(c.Mode); ext {
			run = iperfRun
		}
		mem, err := watchTCPMem()
		if err != nil {
			return err
		}
		o, err := run(l, c, cfg)
		peak, merr := mem.Stop()
		if err != nil {
			return err
		}
		if merr != nil {
			return merr
		}
		a := pool(accs, c)
		a.gbps = append(a.gbps, float64(o.bytes)*8/o.wall.Seconds()/1e9)
		a.cpu += o.cpu
		a.bytes += o.bytes
		a.peak = max(a.peak, peak)
		a.redirected += o.redirected
		a.throttles = append(a.throttles, float64(o.throttles))
		if o.sentBack {
			a.sentBack++
		}
		return nil
	})
	if err != nil {
		return nil, err
	}
	var out []ThroughputResult
	base := map[Cell]float64{}
	for _, c := range cfg.cells() {
		a := accs[c]
		r := ThroughputResult{
			Topology: cfg.Topology, Placement: c.Placement, Mode: c.Mode, WriteSize: c.Size,
			RoundGbps: a.gbps, MedianGbps: median(a.gbps),
			CPUSecPerGB:   a.cpu.Seconds() / (float64(a.bytes) / 1e9),
			PeakTCPMemMiB: float64(a.peak) / (1 << 20),
		}
		if _, _, ext := ExternalMode(c.Mode); !ext {
			r.ReadSize = cmp.Or(cfg.ReadSize, DefaultReadSize)
		}
		if c.Mode == ModeShunt || c.Mode == ModeTrust {
			r.Bypass = &RoundsBypassed{RedirectedShare: float64(a.redirected) / float64(a.bytes), SentBackRuns: a.sentBack, ThrottlesPerRun: median(a.throttles)}
		}
		base[c] = r.MedianGbps
		out = append(out, r)
	}
	for i := range out {
		if t := base[Cell{out[i].WriteSize, out[i].Placement, baseline(out[i].Mode)}]; t > 0 {
			out[i].RatioToTCP = out[i].MedianGbps / t
		}
	}
	return out, nil
}

func throughputRun(l *Lab, c Cell, cfg ThroughputConfig) (runOutcome, error) {
	var o runOutcome
	cfd, sfd, err := l.connect(c.Mode, cfg.Topology)
	if err != nil {
		return o, err
	}
	defer unix.Close(sfd)
	if cfg.Nagle {
		if err := unix.SetsockoptInt(cfd, unix.IPPROTO_TCP, unix.TCP_NODELAY, 0); err != nil && c.Mode != ModeUnix {
			unix.Close(cfd)
			return o, fmt.Errorf("nagle on: %w", err)
		}
	}
	before, err := l.tally(c.Mode)
	if err != nil {
		unix.Close(cfd)
		return o, err
	}
	ccpu, scpu := cpusFor(c.Placement)

	type result struct {
		n   int64
		end time.Time
		err error
	}
	got := make(chan result, 1)
	go func() {
		unpin, err := pinThread(scpu)
		if err != nil {
			got <- result{err: err}
			return
		}
		defer unpin()
		buf := make([]byte, cmp.Or(cfg.ReadSize, DefaultReadSize))
		var n int64
		for {
			m, err := readSome(sfd, buf)
			if err != nil {
				got <- result{err: err}
				return
			}
			if m == 0 {
				got <- result{n: n, end: time.Now()}
				return
			}
			n += int64(m)
		}
	}()

	clock, err := startCPU()
	if err != nil {
		return o, err
	}
	start := time.Now()
	werr := func() error {
		defer unix.Close(cfd)
		unpin, err := pinThread(ccpu)
		if err != nil {
			return err
		}
		defer unpin()
		buf := make([]byte, c.Size)
		for time.Since(start) < cfg.Duration {
			if err := writeFull(cfd, buf); err != nil {
				return err
			}
		}
		after, err := l.tally(c.Mode)
		if err != nil {
			return err
		}
		o.redirected = int64(after.redirected - before.redirected)
		o.throttles = after.throttled - before.throttled
		// A stream of small writes with Nagle's algorithm on over
		// loopback, or one whose reader stays behind its writer, is sent
		// back to TCP: a run may end there, as a user's connection would.
		// The row says how much went by redirect.
		if o.sentBack = after.sentBack > before.sentBack; o.sentBack {
			return nil
		}
		_, err = l.requireHeld(c.Mode, cfd)
		return err
	}()
	r := <-got
	cpu, cerr := clock.elapsed()
	if err := cmp.Or(werr, cerr, r.err); err != nil {
		return o, err
	}
	o.bytes, o.wall, o.cpu = r.n, r.end.Sub(start), cpu
	return o, nil
}
