package splice_test

import (
	"errors"
	"net"
	"strings"
	"testing"
	"time"

	"golang.org/x/sys/unix"

	"github.com/shunt-project/shunt/internal/testenv"
	"github.com/shunt-project/shunt/splice"
)

// unixProxied is an application on a unix socket and a TCP server, with a
// proxy's unix socket and its TCP socket to the server joined:
// app <-> ours ... back <-> server.
type unixProxied struct {
	app, ours    *net.UnixConn
	back, server *net.TCPConn
	pair         *splice.Pair
	fromUnix     func() splice.Stats // the unix -> TCP direction's stats
	toUnix       func() splice.Stats
}

// mustUnixProxied joins the unix and the TCP socket, the unix one first
// (as a) or second.
func mustUnixProxied(t *testing.T, s *splice.Splicer, unixFirst bool) *unixProxied {
	t.Helper()
	ns := testenv.MustNetNS(t)
	side := testenv.Side{NS: ns}
	p := &unixProxied{}
	p.app, p.ours = testenv.UnixPair(t, unix.SOCK_STREAM)
	p.back, p.server = testenv.ConnPair(t, "tcp4", side, "127.0.0.1:0", side, "127.0.0.1:0")
	var err error
	if unixFirst {
		p.pair, err = s.Join(p.ours, p.back)
	} else {
		p.pair, err = s.Join(p.back, p.ours)
	}
	if err != nil {
		t.Fatal(err)
	}
	p.fromUnix = func() splice.Stats {
		ab, ba := p.pair.Stats()
		if unixFirst {
			return ab
		}
		return ba
	}
	p.toUnix = func() splice.Stats {
		ab, ba := p.pair.Stats()
		if unixFirst {
			return ba
		}
		return ab
	}
	return p
}

func (p *unixProxied) waitDone(t *testing.T) {
	t.Helper()
	select {
	case <-p.pair.Done():
	case <-time.After(10 * time.Second):
		t.Fatal("the pair did not end")
	}
	if err := p.pair.Err(); err != nil {
		t.Fatal(err)
	}
}

// A unix socket joined with a TCP one: 64 MiB from TCP to unix (forwarded
// by the kernel) and 32 MiB from unix to TCP (copied in user space) at once,
// every byte in order, each EOF forwarded after the last byte; nothing is
// left in the maps.
func TestUnixTCPBothWays(t *testing.T) {
	s := mustSplicer(t, splice.Options{})
	for _, unixFirst := range []bool{true, false} {
		name := "unix-tcp"
		if !unixFirst {
			name = "tcp-unix"
		}
		t.Run(name, func(t *testing.T) {
			p := mustUnixProxied(t, s, unixFirst)
			for _, c := range []net.Conn{p.app, p.server} {
				c.SetDeadline(time.Now().Add(60 * time.Second))
			}
			up := testenv.Stream{Seed: 31, Size: 32 << 20, MaxChunk: 100 << 10}
			down := testenv.Stream{Seed: 32, Size: 64 << 20, MaxChunk: 100 << 10}
			errs := make(chan error, 2)
			go func() { errs <- up.Through(p.app, p.server) }()
			go func() { errs <- down.Through(p.server, p.app) }()
			for range 2 {
				if err := <-errs; err != nil {
					t.Fatal(err)
				}
			}
			p.waitDone(t)
			from, to := p.fromUnix(), p.toUnix()
			t.Logf("unix->tcp %+v; tcp->unix %+v", from, to)
			if from.Bytes != uint64(up.Size) || from.Kernel != 0 {
				t.Errorf("unix->tcp moved %d bytes, %d by the kernel; want %d, all in user space", from.Bytes, from.Kernel, up.Size)
			}
			if to.Bytes != uint64(down.Size) || to.Kernel == 0 {
				t.Errorf("tcp->unix moved %d bytes, %d by the kernel; want %d, some by the kernel", to.Bytes, to.Kernel, down.Size)
			}
			if socks, cookies, err := s.MapEntries(); socks+cookies != 0 || err != nil {
				t.Errorf("after the pair ended: %d sockets, %d cookies in the maps (%v)", socks, cookies, err)
			}
		})
	}
}

// An application that stops reading its unix socket holds the TCP sender
// back as a proxy would (the kernel keeps what it forwards under the unix
// socket's buffer), and gets every byte once it reads again.
func TestUnixSlowReaderHoldsSender(t *testing.T) {
	s := mustSplicer(t, splice.Options{})
	p := mustUnixProxied(t, s, true)
	stream := testenv.Stream{Seed: 33, Size: 256 << 20, MaxChunk: 64 << 10}
	n, err := stream.WriteUntilStalled(p.server, 500*time.Millisecond)
	if !errors.Is(err, testenv.ErrStalled) {
		t.Fatalf("the writer was never held back: %d bytes accepted (%v)", n, err)
	}
	t.Logf("accepted %.1f MiB before the writer was held; tcp->unix %+v", float64(n)/(1<<20), p.toUnix())
	if n > 32<<20 {
		t.Fatalf("accepted %d MiB with nobody reading; TCP's own buffers hold about 10-20 MiB", n>>20)
	}
	accepted := testenv.Stream{Seed: 33, Size: n, MaxChunk: 64 << 10}
	p.server.CloseWrite()
	p.app.SetDeadline(time.Now().Add(30 * time.Second))
	if err := accepted.Check(p.app, true); err != nil {
		t.Fatal(err)
	}
	p.app.CloseWrite()
	p.waitDone(t)
}

// What cannot be joined says so, and nothing is left behind.
func TestUnixJoinRefused(t *testing.T) {
	s := mustSplicer(t, splice.Options{})
	_, a := testenv.UnixPair(t, unix.SOCK_STREAM)
	_, b := testenv.UnixPair(t, unix.SOCK_STREAM)
	if _, err := s.Join(a, b); err == nil || !strings.Contains(err.Error(), "two unix sockets") {
		t.Errorf("two unix sockets: %v", err)
	}
	_, d := testenv.UnixPair(t, unix.SOCK_DGRAM)
	ns := testenv.MustNetNS(t)
	side := testenv.Side{NS: ns}
	c, _ := testenv.ConnPair(t, "tcp4", side, "127.0.0.1:0", side, "127.0.0.1:0")
	if _, err := s.Join(d, c); err == nil || !strings.Contains(err.Error(), "not SOCK_STREAM") {
		t.Errorf("a unix datagram socket: %v", err)
	}
	if socks, cookies, _ := s.MapEntries(); socks+cookies != 0 || s.Active() != 0 {
		t.Errorf("%d sockets, %d cookies, %d pairs left", socks, cookies, s.Active())
	}
}
