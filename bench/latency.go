package bench

import (
	"context"
	"fmt"
	"runtime"
	"time"

	"golang.org/x/sys/unix"
)

// LatencyConfig says what to measure.
type LatencyConfig struct {
	Matrix
	Count   int           // round trips measured per run (at most)
	MaxTime time.Duration // a run stops early after this long (0: no limit)
	Warmup  int           // round trips before measuring
	// NewConn makes every round trip a new connection: connect, request,
	// response, the server's close (see newConnRun).
	NewConn bool
}

// LatencyResult is one cell, pooled over rounds.
type LatencyResult struct {
	Topology     string          `json:"topology"`
	Placement    string          `json:"placement"`
	Mode         string          `json:"mode"`
	Size         int             `json:"size"`
	Dist         Dist            `json:"latency"`
	RoundP50     []time.Duration `json:"round_p50_ns"`
	MedianP50    time.Duration   `json:"median_round_p50_ns"`
	RoundTripsPS float64         `json:"round_trips_per_s"`
	CPUPerRT     time.Duration   `json:"machine_cpu_per_round_trip_ns"`
	Stalled      bool            `json:"stalled"`
	RatioToTCP   float64         `json:"p50_ratio_to_tcp,omitempty"` // median round p50 over tcp's
}

// RunLatency runs request/response ping-pong over every cell of the matrix.
func RunLatency(ctx context.Context, l *Lab, cfg LatencyConfig) ([]LatencyResult, error) {
	if err := cfg.Validate(); err != nil {
		return nil, err
	}
	if runtime.NumCPU() < 2 {
		return nil, fmt.Errorf("latency benchmark needs 2 CPUs, this machine has %d", runtime.NumCPU())
	}
	if err := cfg.checkTools(); err != nil {
		return nil, err
	}
	if cfg.NewConn {
		for _, m := range cfg.Modes {
			if _, _, ext := ExternalMode(m); ext || m == ModeUnix {
				return nil, fmt.Errorf("mode %s cannot make a connection per round trip: use tcp, shunt, shunt-trust or shunt-bare with --new-conn", m)
			}
		}
	}
	type acc struct {
		pooled
		dists []Dist // per round, from tools that report only percentiles
	}
	accs := map[Cell]*acc{}
	err := cfg.run(ctx, func(c Cell) error {
		a := pool(accs, c)
		if _, _, ext := ExternalMode(c.Mode); ext {
			d, err := sockperfRun(l, c, cfg)
			if err != nil {
				return err
			}
			a.dists = append(a.dists, d)
			a.p50s = append(a.p50s, d.P50)
			return nil
		}
		r, err := latencyRun(l, c, cfg)
		if err != nil {
			return err
		}
		a.add(r.samples, r.cpu, r.wall)
		return nil
	})
	if err != nil {
		return nil, err
	}
	var out []LatencyResult
	for _, c := range cfg.cells() {
		a := accs[c]
		r := LatencyResult{
			Topology: cfg.Topology, Placement: c.Placement, Mode: c.Mode, Size: c.Size,
			Dist: distOf(a.samples), RoundP50: a.p50s, MedianP50: median(a.p50s),
		}
		if len(a.dists) > 0 {
			// A tool's own summary: its rate and CPU are not comparable
			// (its run includes start-up and warm-up), so they stay 0.
			r.Dist = combine(a.dists)
		} else {
			r.RoundTripsPS = float64(r.Dist.Count) / a.wall.Seconds()
			r.CPUPerRT = a.cpu / time.Duration(max(1, r.Dist.Count))
		}
		r.Stalled = stalled(r.Dist)
		out = append(out, r)
	}
	// Ratios against plain TCP of the same size, placement and tool.
	base := map[Cell]time.Duration{}
	for _, r := range out {
		base[Cell{r.Size, r.Placement, r.Mode}] = r.MedianP50
	}
	for i := range out {
		if t := base[Cell{out[i].Size, out[i].Placement, baseline(out[i].Mode)}]; t > 0 {
			out[i].RatioToTCP = float64(out[i].MedianP50) / float64(t)
		}
	}
	return out, nil
}

type latencySample struct {
	samples   []time.Duration
	cpu, wall time.Duration
}

// latencyRun measures one connection.
func latencyRun(l *Lab, c Cell, cfg LatencyConfig) (latencySample, error) {
	if cfg.NewConn {
		return newConnRun(l, c, cfg)
	}
	var res latencySample
	cfd, sfd, err := l.connect(c.Mode, cfg.Topology)
	if err != nil {
		return res, err
	}
	defer unix.Close(cfd)
	ccpu, scpu := cpusFor(c.Placement)

	srvErr := make(chan error, 1)
	go func() {
		defer unix.Close(sfd)
		unpin, err := pinThread(scpu)
		if err != nil {
			srvErr <- err
			return
		}
		defer unpin()
		buf := make([]byte, c.Size)
		for {
			if err := readFull(sfd, buf); err != nil {
				if err == errEOF {
					err = nil
				}
				srvErr <- err
				return
			}
			if err := writeFull(sfd, buf); err != nil {
				srvErr <- err
				return
			}
		}
	}()

	res.samples = make([]time.Duration, 0, cfg.Count)
	cliErr := func() error {
		unpin, err := pinThread(ccpu)
		if err != nil {
			return err
		}
		defer unpin()
		buf := make([]byte, c.Size)
		rt := func() error {
			if err := writeFull(cfd, buf); err != nil {
				return err
			}
			return readFull(cfd, buf)
		}
		for i := 0; i < cfg.Warmup; i++ {
			if err := rt(); err != nil {
				return err
			}
		}
		clock, err := startCPU()
		if err != nil {
			return err
		}
		t0 := time.Now()
		for i := 0; i < cfg.Count; i++ {
			s := time.Now()
			if err := rt(); err != nil {
				return err
			}
			res.samples = append(res.samples, time.Since(s))
			if cfg.MaxTime > 0 && i%64 == 0 && time.Since(t0) > cfg.MaxTime {
				break
			}
		}
		res.wall = time.Since(t0)
		if res.cpu, err = clock.elapsed(); err != nil {
			return err
		}
		// A mode that silently fell back would measure TCP under
		// shunt's name.
		return l.requireBypassed(c.Mode, cfd)
	}()
	_ = unix.Shutdown(cfd, unix.SHUT_WR)
	if err := <-srvErr; err != nil && cliErr == nil {
		cliErr = err
	}
	return res, cliErr
}
