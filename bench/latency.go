package bench

import (
	"context"
	"fmt"
	"runtime"
	"time"

	"golang.org/x/sys/unix"
)

// Modes of the latency benchmark.
const (
	ModeTCP   = "tcp"   // plain TCP over veth between two namespaces
	ModeShunt = "shunt" // the same connection with shunt bypass
	ModeUnix  = "unix"  // AF_UNIX socketpair: the host-local floor
	// ModeBare is shunt's pairing with a redirect program stripped of its
	// checks and counters: shunt minus ModeBare is what the checks cost.
	ModeBare = "shunt-bare"
)

// interleave calls run for every round, placement and mode, in that nesting,
// so drift on a noisy machine hits every mode alike.
func interleave(ctx context.Context, rounds int, placements, modes []string, progress func(string), run func(placement, mode string) error) error {
	for r := 0; r < rounds; r++ {
		for _, pl := range placements {
			for _, mode := range modes {
				if err := ctx.Err(); err != nil {
					return err
				}
				if progress != nil {
					progress(fmt.Sprintf("round %d/%d %s %s", r+1, rounds, pl, mode))
				}
				if err := run(pl, mode); err != nil {
					return fmt.Errorf("%s %s: %w", pl, mode, err)
				}
			}
		}
	}
	return nil
}

// Placements: where client and server threads run.
const (
	SameCPU  = "same-cpu"  // both on CPU 1
	CrossCPU = "cross-cpu" // client on CPU 0, server on CPU 1
)

// LatencyConfig says what to measure.
type LatencyConfig struct {
	Size       int          // message size in bytes, each way
	Count      int          // round trips measured per round and mode
	Warmup     int          // round trips before measuring
	Rounds     int          // interleaved rounds: tcp shunt unix, tcp shunt unix, ...
	Modes      []string     // subset of ModeTCP, ModeShunt, ModeUnix
	Placements []string     // subset of SameCPU, CrossCPU
	Progress   func(string) // optional: called before each run
}

// LatencyResult is one mode at one placement, pooled over rounds.
type LatencyResult struct {
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
	// SpuriousEAGAIN counts blocking reads that failed with EAGAIN (see
	// readFull); plain TCP never does this.
	SpuriousEAGAIN int `json:"spurious_eagain"`
}

// RunLatency runs request/response ping-pong, interleaving modes round by
// round so drift on a noisy machine hits every mode alike.
func RunLatency(ctx context.Context, l *Lab, cfg LatencyConfig) ([]LatencyResult, error) {
	if runtime.NumCPU() < 2 {
		return nil, fmt.Errorf("latency benchmark needs 2 CPUs, this machine has %d", runtime.NumCPU())
	}
	type acc struct {
		samples []time.Duration
		p50s    []time.Duration
		cpu     time.Duration
		wall    time.Duration
		eagain  int
	}
	accs := map[[2]string]*acc{}
	err := interleave(ctx, cfg.Rounds, cfg.Placements, cfg.Modes, cfg.Progress, func(pl, mode string) error {
		s, cpu, wall, eagain, err := latencyRun(l, mode, pl, cfg)
		if err != nil {
			return err
		}
		a := accs[[2]string{pl, mode}]
		if a == nil {
			a = &acc{}
			accs[[2]string{pl, mode}] = a
		}
		a.samples = append(a.samples, s...)
		a.p50s = append(a.p50s, distOf(s).P50)
		a.cpu += cpu
		a.wall += wall
		a.eagain += eagain
		return nil
	})
	if err != nil {
		return nil, err
	}
	var out []LatencyResult
	for _, pl := range cfg.Placements {
		var tcp time.Duration
		for _, mode := range cfg.Modes {
			a := accs[[2]string{pl, mode}]
			d := distOf(a.samples)
			res := LatencyResult{
				Placement: pl, Mode: mode, Size: cfg.Size, Dist: d,
				RoundP50: a.p50s, MedianP50: median(a.p50s),
				RoundTripsPS:   float64(d.Count) / a.wall.Seconds(),
				CPUPerRT:       a.cpu / time.Duration(max(1, d.Count)),
				Stalled:        stalled(d),
				SpuriousEAGAIN: a.eagain,
			}
			if mode == ModeTCP {
				tcp = res.MedianP50
			}
			out = append(out, res)
		}
		for i := range out {
			if out[i].Placement == pl && tcp > 0 {
				out[i].RatioToTCP = float64(out[i].MedianP50) / float64(tcp)
			}
		}
	}
	return out, nil
}

func cpusFor(placement string) (client, server int) {
	if placement == SameCPU {
		return 1, 1
	}
	return 0, 1
}

// latencyRun measures one connection: the samples, the machine CPU and the
// wall time of the measured part, and the spurious EAGAINs seen.
func latencyRun(l *Lab, mode, placement string, cfg LatencyConfig) (samples []time.Duration, cpu, wall time.Duration, eagain int, err error) {
	var cfd, sfd int
	switch mode {
	case ModeUnix:
		var fds [2]int
		fds, err = unix.Socketpair(unix.AF_UNIX, unix.SOCK_STREAM|unix.SOCK_CLOEXEC, 0)
		cfd, sfd = fds[0], fds[1]
	case ModeTCP, ModeShunt, ModeBare:
		if err = l.Bypass(mode != ModeTCP); err != nil {
			return nil, 0, 0, 0, err
		}
		if err = l.install.UseBareRedirect(mode == ModeBare); err != nil {
			return nil, 0, 0, 0, err
		}
		cfd, sfd, err = l.tcpPair()
	default:
		err = fmt.Errorf("unknown mode %q", mode)
	}
	if err != nil {
		return nil, 0, 0, 0, err
	}
	defer unix.Close(cfd)
	ccpu, scpu := cpusFor(placement)

	srvErr := make(chan error, 1)
	var srvEagain int
	go func() {
		defer unix.Close(sfd)
		if err := pinThread(scpu); err != nil {
			srvErr <- err
			return
		}
		defer runtime.UnlockOSThread()
		buf := make([]byte, cfg.Size)
		for {
			if err := readFull(sfd, buf, &srvEagain); err != nil {
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

	samples = make([]time.Duration, cfg.Count)
	cliErr := func() error {
		if err := pinThread(ccpu); err != nil {
			return err
		}
		defer runtime.UnlockOSThread()
		buf := make([]byte, cfg.Size)
		rt := func() error {
			if err := writeFull(cfd, buf); err != nil {
				return err
			}
			return readFull(cfd, buf, &eagain)
		}
		for i := 0; i < cfg.Warmup; i++ {
			if err := rt(); err != nil {
				return err
			}
		}
		cpu0, t0 := machineCPU(), time.Now()
		for i := range samples {
			s := time.Now()
			if err := rt(); err != nil {
				return err
			}
			samples[i] = time.Since(s)
		}
		wall, cpu = time.Since(t0), machineCPU()-cpu0
		if mode == ModeShunt {
			// A mode that silently fell back would measure TCP under
			// shunt's name.
			return l.requireBypassed(cfd)
		}
		return nil
	}()
	unix.Shutdown(cfd, unix.SHUT_WR)
	if err := <-srvErr; err != nil && cliErr == nil {
		cliErr = err
	}
	if cliErr != nil {
		return nil, 0, 0, 0, cliErr
	}
	return samples, cpu, wall, eagain + srvEagain, nil
}
