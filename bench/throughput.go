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
}

// RunThroughput streams one way for cfg.Duration per run; throughput counts
// bytes the receiver got until it read the last one.
func RunThroughput(ctx context.Context, l *Lab, cfg ThroughputConfig) ([]ThroughputResult, error) {
	if err := cfg.Validate(); err != nil {
		return nil, err
	}
	type acc struct {
		gbps  []float64
		cpu   time.Duration
		bytes int64
		peak  int64
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
		n, wall, cpu, err := run(l, c, cfg)
		peak, merr := mem.Stop()
		if err != nil {
			return err
		}
		if merr != nil {
			return merr
		}
		a := pool(accs, c)
		a.gbps = append(a.gbps, float64(n)*8/wall.Seconds()/1e9)
		a.cpu += cpu
		a.bytes += n
		a.peak = max(a.peak, peak)
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

func throughputRun(l *Lab, c Cell, cfg ThroughputConfig) (int64, time.Duration, time.Duration, error) {
	cfd, sfd, err := l.connect(c.Mode, cfg.Topology)
	if err != nil {
		return 0, 0, 0, err
	}
	defer unix.Close(sfd)
	if cfg.Nagle {
		if err := unix.SetsockoptInt(cfd, unix.IPPROTO_TCP, unix.TCP_NODELAY, 0); err != nil && c.Mode != ModeUnix {
			unix.Close(cfd)
			return 0, 0, 0, fmt.Errorf("nagle on: %w", err)
		}
	}
	// A stream of small writes with Nagle's algorithm on over loopback, or
	// one whose reader stays behind its writer, is sent back to TCP: a run
	// may end there, as a user's connection would.
	sentBack, err := l.sentBackToTCP(c.Mode)
	if err != nil {
		unix.Close(cfd)
		return 0, 0, 0, err
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
		return 0, 0, 0, err
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
		if n, err := l.sentBackToTCP(c.Mode); err != nil || n > sentBack {
			return err
		}
		return l.requireBypassed(c.Mode, cfd)
	}()
	r := <-got
	cpu, cerr := clock.elapsed()
	if werr != nil {
		return 0, 0, 0, werr
	}
	if cerr != nil {
		return 0, 0, 0, cerr
	}
	if r.err != nil {
		return 0, 0, 0, r.err
	}
	return r.n, r.end.Sub(start), cpu, nil
}
