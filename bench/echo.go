package bench

import (
	"context"
	"fmt"
	"strings"
	"time"

	"golang.org/x/sys/unix"

	"github.com/shunt-project/shunt/bench/kecho"
	"github.com/shunt-project/shunt/internal/uring"
)

// Echo server kinds. A "+bp" suffix on a user-space kind turns on busy
// polling (SO_BUSY_POLL) on both sockets.
const (
	EchoRW      = "rw"       // read/write loop
	EchoPipe    = "pipe"     // splice(2) socket -> pipe -> socket
	EchoIOURing = "io_uring" // one RECV then SEND per chunk through io_uring
	EchoSockmap = "sockmap"  // sk_skb verdict sends input back out; no process
	BusyPoll    = "+bp"
)

// EchoModes lists every mode the echo scenario knows.
var EchoModes = []string{EchoRW, EchoRW + BusyPoll, EchoPipe, EchoPipe + BusyPoll, EchoIOURing, EchoIOURing + BusyPoll, EchoSockmap}

// busyPollUsec is what "+bp" sets SO_BUSY_POLL to.
const busyPollUsec = 50

// EchoConfig says what to measure; the matrix sizes are block sizes.
type EchoConfig struct {
	Matrix
	Count   int           // echoes per run (at most)
	MaxTime time.Duration // a run stops early after this long
	// SndBuf is forced (SO_SNDBUFFORCE) on the server socket: 0 keeps the
	// kernel's autotuned buffer, SndBufAuto sizes it for kernel echo only.
	SndBuf int
}

// SndBufAuto gives the kernel echo a send buffer of sndBufBlocks blocks, and
// never less than the autotuning ceiling it replaces (tcp_wmem[2], 4 MiB).
//
// Why: the psock worker that sends redirected bytes out gets EAGAIN when the
// send buffer is full and retries one jiffy (4 ms at HZ=250) later; nothing
// pulls that retry forward when space frees. With the autotuned buffer (at
// most tcp_wmem[2], 4 MiB) a 4 MiB echo took 3 jiffies (p50 12.0 ms, 137 of
// 150 over 10 ms); 2 blocks of buffer still cost 2 jiffies (8.1 ms); 4
// blocks removed the retries (5.8 ms, max 7.8 ms). docs/BENCHMARKS.md.
const SndBufAuto = -1

const (
	sndBufBlocks = 4
	sndBufFloor  = 4 << 20
)

// serverSndBuf is the send buffer echoRun forces for a mode, 0 for none.
func (cfg EchoConfig) serverSndBuf(kind string, block int) int {
	if cfg.SndBuf == SndBufAuto {
		if kind == EchoSockmap {
			return max(sndBufBlocks*block, sndBufFloor)
		}
		return 0
	}
	return cfg.SndBuf
}

// EchoResult is one cell over all rounds.
type EchoResult struct {
	Topology   string          `json:"topology"`
	Placement  string          `json:"placement"`
	Mode       string          `json:"mode"`
	Block      int             `json:"block"`
	Dist       Dist            `json:"latency"`
	RoundP50   []time.Duration `json:"round_p50_ns"`
	MedianP50  time.Duration   `json:"median_round_p50_ns"`
	Over10ms   int             `json:"echoes_over_10ms"`
	SndBuf     int             `json:"server_sndbuf"` // forced send buffer, 0: the kernel's
	Stalled    bool            `json:"stalled"`
	CPUPerEcho time.Duration   `json:"machine_cpu_per_echo_ns"`
}

// RunEcho times echoes of whole blocks through each kind of echo server.
func RunEcho(ctx context.Context, l *Lab, cfg EchoConfig) ([]EchoResult, error) {
	if err := cfg.Validate(); err != nil {
		return nil, err
	}
	var ke *kecho.Echo
	for _, m := range cfg.Modes {
		if m == EchoSockmap && ke == nil {
			var err error
			if ke, err = kecho.New(); err != nil {
				return nil, err
			}
			defer ke.Close()
		}
	}
	accs := map[Cell]*pooled{}
	err := cfg.run(ctx, func(c Cell) error {
		s, cpu, err := echoRun(l, ke, c, cfg)
		if err != nil {
			return err
		}
		pool(accs, c).add(s, cpu, 0)
		return nil
	})
	if err != nil {
		return nil, err
	}
	var out []EchoResult
	for _, c := range cfg.cells() {
		a := accs[c]
		d := distOf(a.samples)
		over := 0
		for _, s := range a.samples {
			if s > StallLimit {
				over++
			}
		}
		out = append(out, EchoResult{
			Topology: cfg.Topology, Placement: c.Placement, Mode: c.Mode, Block: c.Size, Dist: d,
			RoundP50: a.p50s, MedianP50: median(a.p50s), Over10ms: over, Stalled: stalled(d),
			SndBuf:     cfg.serverSndBuf(strings.TrimSuffix(c.Mode, BusyPoll), c.Size),
			CPUPerEcho: a.cpu / time.Duration(max(1, d.Count)),
		})
	}
	return out, nil
}

func echoRun(l *Lab, ke *kecho.Echo, c Cell, cfg EchoConfig) ([]time.Duration, time.Duration, error) {
	cfd, sfd, err := l.connect(ModeTCP, cfg.Topology)
	if err != nil {
		return nil, 0, err
	}
	defer unix.Close(cfd)
	// The echo loops block in their syscalls, as in the 2019 experiment;
	// bypass is not involved.
	for _, fd := range []int{cfd, sfd} {
		if err := unix.SetNonblock(fd, false); err != nil {
			unix.Close(sfd)
			return nil, 0, err
		}
	}
	kind, busy := strings.CutSuffix(c.Mode, BusyPoll)
	if busy {
		for _, fd := range []int{cfd, sfd} {
			if err := unix.SetsockoptInt(fd, unix.SOL_SOCKET, unix.SO_BUSY_POLL, busyPollUsec); err != nil {
				unix.Close(sfd)
				return nil, 0, fmt.Errorf("SO_BUSY_POLL: %w", err)
			}
		}
	}
	if sb := cfg.serverSndBuf(kind, c.Size); sb > 0 {
		if err := unix.SetsockoptInt(sfd, unix.SOL_SOCKET, unix.SO_SNDBUFFORCE, sb); err != nil {
			unix.Close(sfd)
			return nil, 0, fmt.Errorf("SO_SNDBUFFORCE: %w", err)
		}
	}
	ccpu, scpu := cpusFor(c.Placement)

	srvDone := make(chan error, 1)
	if kind == EchoSockmap {
		if err := ke.Add(sfd); err != nil {
			unix.Close(sfd)
			return nil, 0, err
		}
		defer func() {
			_ = ke.Remove(sfd)
			unix.Close(sfd)
		}()
		close(srvDone)
	} else {
		go func() {
			defer unix.Close(sfd)
			unpin, err := pinThread(scpu)
			if err != nil {
				srvDone <- err
				return
			}
			defer unpin()
			srvDone <- echoServe(kind, sfd)
		}()
	}

	samples, cpu, err := echoClient(cfd, ccpu, c.Size, cfg)
	_ = unix.Shutdown(cfd, unix.SHUT_WR)
	if serr := <-srvDone; serr != nil && err == nil {
		err = serr
	}
	return samples, cpu, err
}

// echoServe runs a user-space echo loop until EOF.
func echoServe(kind string, fd int) error {
	buf := make([]byte, 256<<10)
	switch kind {
	case EchoRW:
		for {
			n, err := unix.Read(fd, buf)
			if err == unix.EINTR || err == unix.EAGAIN {
				continue
			}
			if err != nil || n == 0 {
				return err
			}
			if err := writeFull(fd, buf[:n]); err != nil {
				return err
			}
		}
	case EchoPipe:
		var p [2]int
		if err := unix.Pipe2(p[:], unix.O_CLOEXEC); err != nil {
			return err
		}
		defer unix.Close(p[0])
		defer unix.Close(p[1])
		for {
			n, err := unix.Splice(fd, nil, p[1], nil, 1<<20, unix.SPLICE_F_MOVE)
			if err == unix.EINTR || err == unix.EAGAIN {
				continue
			}
			if err != nil || n == 0 {
				return err
			}
			for n > 0 {
				m, err := unix.Splice(p[0], nil, fd, nil, int(n), unix.SPLICE_F_MOVE)
				if err == unix.EINTR {
					continue
				}
				if err != nil {
					return err
				}
				n -= m
			}
		}
	case EchoIOURing:
		r, err := uring.New(4)
		if err != nil {
			return err
		}
		defer r.Close()
		for {
			n, err := r.Do(uring.OpRecv, fd, buf)
			if err == unix.EINTR || err == unix.EAGAIN {
				continue
			}
			if err != nil || n == 0 {
				return err
			}
			for off := 0; off < n; {
				m, err := r.Do(uring.OpSend, fd, buf[off:n])
				if err == unix.EINTR || err == unix.EAGAIN {
					continue
				}
				if err != nil {
					return err
				}
				off += m
			}
		}
	}
	return fmt.Errorf("unknown echo mode %q", kind)
}

// soloBlock is the largest block the client writes and then reads from one
// thread: the socket buffers hold it whole, so neither end blocks in write.
const soloBlock = 64 << 10

// echoClient sends a block and times until the whole block is back. Larger
// blocks need a writer beside the reader, or both ends would block in write;
// both run on the client CPU.
func echoClient(fd, cpu, size int, cfg EchoConfig) ([]time.Duration, time.Duration, error) {
	unpin, err := pinThread(cpu)
	if err != nil {
		return nil, 0, err
	}
	defer unpin()
	out := make([]byte, size)
	in := make([]byte, size)
	if size <= soloBlock {
		return timeEchoes(cfg, func() error {
			if err := writeFull(fd, out); err != nil {
				return err
			}
			return readFull(fd, in)
		})
	}

	start := make(chan struct{})
	wrote := make(chan error, 1)
	defer close(start)
	go func() {
		unpin, err := pinThread(cpu)
		if err != nil {
			wrote <- err
			return
		}
		defer unpin()
		for range start {
			wrote <- writeFull(fd, out)
		}
	}()

	return timeEchoes(cfg, func() error {
		start <- struct{}{}
		if err := readFull(fd, in); err != nil {
			return err
		}
		return <-wrote
	})
}

// timeEchoes times echo() up to cfg.Count times or for cfg.MaxTime.
func timeEchoes(cfg EchoConfig, echo func() error) ([]time.Duration, time.Duration, error) {
	samples := make([]time.Duration, 0, cfg.Count)
	clock, err := startCPU()
	if err != nil {
		return nil, 0, err
	}
	t0 := time.Now()
	for i := 0; i < cfg.Count; i++ {
		s := time.Now()
		if err := echo(); err != nil {
			return nil, 0, fmt.Errorf("echo %d: %w", i, err)
		}
		samples = append(samples, time.Since(s))
		if cfg.MaxTime > 0 && time.Since(t0) > cfg.MaxTime {
			break
		}
	}
	cpu, err := clock.elapsed()
	return samples, cpu, err
}
