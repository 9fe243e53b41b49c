package compat_test

import (
	"bufio"
	"fmt"
	"net"
	"strconv"
	"syscall"
	"testing"

	"golang.org/x/sys/unix"

	"github.com/shunt-project/shunt/internal/testenv"
)

// sidecarMark marks the sidecar's own upstream connections, which the
// capture rule lets pass (Istio's proxy is let pass by its uid instead).
const sidecarMark = 0x5

// A mesh's sidecar in front of Redis: the application dials Redis, the
// namespace's output REDIRECTs that to the sidecar (as Istio and Linkerd
// capture outbound traffic), which reads SO_ORIGINAL_DST and forwards to it.
// Both legs are bypassed: the captured one through the translation.
func TestSidecarReadsOriginalDst(t *testing.T) {
	testenv.NeedProgram(t, "redis-server")
	testenv.NeedProgram(t, "nft")
	bothWays(t, redirected, 2*2*200*100<<10, func(t *testing.T, e *env) {
		port := e.freePort(t)
		e.start(t, redisArgv(strconv.Itoa(port))...)
		addr := fmt.Sprintf("127.0.0.1:%d", port)
		e.waitListening(t, addr)
		dsts := e.sidecar(t, port)
		c := e.dial(t, addr)
		redisSetGet(t, c, bufio.NewReader(c))
		if got := <-dsts; got != addr {
			t.Errorf("the sidecar read SO_ORIGINAL_DST %s, want %s", got, addr)
		}
		if e.in != nil {
			if st, err := e.in.Stats(); err != nil || st.Counters.Translated == 0 || st.Counters.Paired < 2 {
				t.Errorf("want both legs paired, one through the translation: %+v %v", st.Counters, err)
			}
		}
	})
}

// sidecar captures the env's outbound connections to port and forwards
// each to its original destination; it sends each destination it read.
func (e *env) sidecar(t *testing.T, port int) <-chan string {
	t.Helper()
	ln := testenv.Listen(t, e.side, "tcp4", "127.0.0.1:0")
	t.Cleanup(func() { ln.Close() })
	rules := fmt.Sprintf(`table ip shunt_test_mesh {
	chain out {
		type nat hook output priority -100;
		meta mark %d return
		tcp dport %d redirect to :%d
	}
}`, sidecarMark, port, ln.Addr().(*net.TCPAddr).Port)
	e.side.NS.Nft(t, rules)
	dsts := make(chan string, 16)
	go func() {
		for {
			down, err := ln.AcceptTCP()
			if err != nil {
				return
			}
			dst, err := testenv.OriginalDst(down)
			if err != nil {
				t.Errorf("SO_ORIGINAL_DST: %v", err)
				down.Close()
				continue
			}
			dsts <- dst.String()
			var up net.Conn
			d := net.Dialer{Control: func(_, _ string, c syscall.RawConn) error {
				var serr error
				c.Control(func(fd uintptr) { serr = unix.SetsockoptInt(int(fd), unix.SOL_SOCKET, unix.SO_MARK, sidecarMark) })
				return serr
			}}
			e.side.Make(t, func() { up, err = d.Dial("tcp4", dst.String()) })
			if err != nil {
				t.Errorf("sidecar dial %s: %v", dst, err)
				down.Close()
				continue
			}
			go testenv.Pump(up, down)
			go testenv.Pump(down, up)
		}
	}()
	return dsts
}
