package bench

import (
	"context"
	"fmt"
	"runtime"
	"slices"
	"time"

	"golang.org/x/sys/unix"
)

// ThroughputConfig says what to measure.
type ThroughputConfig struct {
	WriteSize  int           // bytes per write()
	Duration   time.Duration // how long the sender writes, per round and mode
	Rounds     int
	Modes      []string // ModeTCP, ModeShunt, ModeUnix
	Placements []string
	Progress   func(string)
}

// ThroughputResult is one mode at one placement over all rounds.
type ThroughputResult struct {
	Placement   string    `json:"placement"`
	Mode        string    `json:"mode"`
	WriteSize   int       `json:"write_size"`
	RoundGbps   []float64 `json:"round_gbit_per_s"`
	MedianGbps  float64   `json:"median_gbit_per_s"`
	CPUSecPerGB float64   `json:"machine_cpu_s_per_gb"`
	RatioToTCP  float64   `json:"ratio_to_tcp,omitempty"`
}

// RunThroughput streams one way for cfg.Duration per run; throughput counts
// bytes the receiver got until it read the last one.
func RunThroughput(ctx context.Context, l *Lab, cfg ThroughputConfig) ([]ThroughputResult, error) {
	type acc struct {
		gbps  []float64
		cpu   time.Duration
		bytes int64
	}
	accs := map[[2]string]*acc{}
	err := interleave(ctx, cfg.Rounds, cfg.Placements, cfg.Modes, cfg.Progress, func(pl, mode string) error {
		n, wall, cpu, err := throughputRun(l, mode, pl, cfg)
		if err != nil {
			return err
		}
		k := [2]string{pl, mode}
		if accs[k] == nil {
			accs[k] = &acc{}
		}
		accs[k].gbps = append(accs[k].gbps, float64(n)*8/wall.Seconds()/1e9)
		accs[k].cpu += cpu
		accs[k].bytes += n
		return nil
	})
	if err != nil {
		return nil, err
	}
	var out []ThroughputResult
	for _, pl := range cfg.Placements {
		var tcp float64
		first := len(out)
		for _, mode := range cfg.Modes {
			a := accs[[2]string{pl, mode}]
			res := ThroughputResult{
				Placement: pl, Mode: mode, WriteSize: cfg.WriteSize, RoundGbps: a.gbps,
				MedianGbps:  medianF(a.gbps),
				CPUSecPerGB: a.cpu.Seconds() / (float64(a.bytes) / 1e9),
			}
			if mode == ModeTCP {
				tcp = res.MedianGbps
			}
			out = append(out, res)
		}
		for i := first; i < len(out) && tcp > 0; i++ {
			out[i].RatioToTCP = out[i].MedianGbps / tcp
		}
	}
	return out, nil
}

func throughputRun(l *Lab, mode, placement string, cfg ThroughputConfig) (int64, time.Duration, time.Duration, error) {
	var cfd, sfd int
	var err error
	switch mode {
	case ModeUnix:
		var fds [2]int
		fds, err = unix.Socketpair(unix.AF_UNIX, unix.SOCK_STREAM|unix.SOCK_CLOEXEC, 0)
		cfd, sfd = fds[0], fds[1]
	case ModeTCP, ModeShunt:
		if err = l.Bypass(mode == ModeShunt); err == nil {
			cfd, sfd, err = l.tcpPair()
		}
	default:
		err = fmt.Errorf("unknown mode %q", mode)
	}
	if err != nil {
		return 0, 0, 0, err
	}
	defer unix.Close(sfd)
	ccpu, scpu := cpusFor(placement)

	type result struct {
		n   int64
		end time.Time
		err error
	}
	got := make(chan result, 1)
	go func() {
		if err := pinThread(scpu); err != nil {
			got <- result{err: err}
			return
		}
		defer runtime.UnlockOSThread()
		buf := make([]byte, 256<<10)
		var n int64
		for {
			m, err := unix.Read(sfd, buf)
			if err == unix.EINTR || err == unix.EAGAIN { // EAGAIN: see readFull
				continue
			}
			if err != nil {
				got <- result{err: fmt.Errorf("read: %w", err)}
				return
			}
			if m == 0 {
				got <- result{n: n, end: time.Now()}
				return
			}
			n += int64(m)
		}
	}()

	cpu0, start := machineCPU(), time.Now()
	werr := func() error {
		defer unix.Close(cfd)
		if err := pinThread(ccpu); err != nil {
			return err
		}
		defer runtime.UnlockOSThread()
		buf := make([]byte, cfg.WriteSize)
		for time.Since(start) < cfg.Duration {
			if err := writeFull(cfd, buf); err != nil {
				return err
			}
		}
		if mode == ModeShunt {
			return l.requireBypassed(cfd)
		}
		return nil
	}()
	r := <-got
	cpu := machineCPU() - cpu0
	if werr != nil {
		return 0, 0, 0, werr
	}
	if r.err != nil {
		return 0, 0, 0, r.err
	}
	return r.n, r.end.Sub(start), cpu, nil
}

func medianF(v []float64) float64 {
	if len(v) == 0 {
		return 0
	}
	s := slices.Clone(v)
	slices.Sort(s)
	return s[len(s)/2]
}
