package bench

import (
	"fmt"
	"time"

	"golang.org/x/sys/unix"

	"github.com/shunt-project/shunt/bypass"
	"github.com/shunt-project/shunt/internal/lab"
)

// newConnRun measures short connections: each transaction connects, sends
// one request, reads the response and the server's close, and closes. The
// time includes the handshake and, for shunt, pairing; whether the request
// and response are redirected depends on the mode (a reader that waits in
// recv is seen only when that recv returns, so with plain shunt both go by
// TCP; shunt-trust redirects them).
func newConnRun(l *Lab, c Cell, cfg LatencyConfig) (latencySample, error) {
	var res latencySample // RunLatency has refused modes without connections
	if err := l.bypassMode(c.Mode); err != nil {
		return res, err
	}
	var paired0 uint64
	if in := l.installFor(c.Mode); c.Mode != ModeTCP {
		st, err := in.Stats()
		if err != nil {
			return res, err
		}
		paired0 = handled(st.Counters)
	}
	ln, addr, err := l.listen(cfg.Topology, 128)
	if err != nil {
		return res, err
	}
	ccpu, scpu := cpusFor(c.Placement)

	srvErr := make(chan error, 1)
	go func() {
		unpin, err := pinThread(scpu)
		if err != nil {
			srvErr <- err
			return
		}
		defer unpin()
		buf := make([]byte, c.Size)
		for {
			sfd, _, err := unix.Accept4(ln, unix.SOCK_CLOEXEC|unix.SOCK_NONBLOCK)
			if err != nil {
				srvErr <- nil // the listener was shut down: the run is over
				return
			}
			_ = unix.SetsockoptInt(sfd, unix.IPPROTO_TCP, unix.TCP_NODELAY, 1)
			err = readFull(sfd, buf)
			if err == nil {
				err = writeFull(sfd, buf)
			}
			unix.Close(sfd) // the server closes first: TIME_WAIT stays on its side
			if err != nil {
				srvErr <- err
				return
			}
		}
	}()

	n := 0
	cliErr := l.clientNS(cfg.Topology).Do(func() error {
		return lab.InCgroup(l.Cgroup, func() error {
			unpin, err := pinThread(ccpu)
			if err != nil {
				return err
			}
			defer unpin()
			buf := make([]byte, c.Size)
			tx := func() error {
				fd, err := dial(addr)
				if err != nil {
					return err
				}
				defer unix.Close(fd)
				if err := writeFull(fd, buf); err != nil {
					return err
				}
				if err := readFull(fd, buf); err != nil {
					return err
				}
				if err := readFull(fd, buf[:1]); err != errEOF {
					return fmt.Errorf("want the server's close after its response, got %v", err)
				}
				return nil
			}
			for i := 0; i < cfg.Warmup; i++ {
				if err := tx(); err != nil {
					return err
				}
			}
			res.samples = make([]time.Duration, 0, cfg.Count)
			clock, err := startCPU()
			if err != nil {
				return err
			}
			t0 := time.Now()
			for ; n < cfg.Count; n++ {
				s := time.Now()
				if err := tx(); err != nil {
					return err
				}
				res.samples = append(res.samples, time.Since(s))
				if cfg.MaxTime > 0 && n%64 == 0 && time.Since(t0) > cfg.MaxTime {
					n++
					break
				}
			}
			res.wall = time.Since(t0)
			res.cpu, err = clock.elapsed()
			return err
		})
	})
	_ = unix.Shutdown(ln, unix.SHUT_RDWR)
	if err := <-srvErr; err != nil && cliErr == nil {
		cliErr = err
	}
	unix.Close(ln)
	if cliErr != nil || c.Mode == ModeTCP {
		return res, cliErr
	}
	// Every measured connection (and the warm-up's) must have been paired,
	// or left unpaired as brief (none with ModePaired), or the mode measured
	// plain TCP under shunt's name.
	st, err := l.installFor(c.Mode).Stats()
	if err != nil {
		return res, err
	}
	if got, want := handled(st.Counters)-paired0, uint64(n+cfg.Warmup); got < want {
		return res, fmt.Errorf("%s: %d of %d connections were paired or left unpaired as brief", c.Mode, got, want)
	}
	return res, nil
}

// handled counts the connections shunt paired, or left unpaired because
// their port's connections are brief (what the default install does with a
// connection per round trip).
func handled(c bypass.Counters) uint64 { return c.Paired + c.BriefPort }
