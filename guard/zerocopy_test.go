package guard_test

import (
	"errors"
	"io"
	"strings"
	"syscall"
	"testing"
	"time"

	"golang.org/x/sys/unix"

	"github.com/shunt-project/shunt/bypass"
	"github.com/shunt-project/shunt/internal/testenv"
)

// A TCP_ZEROCOPY_RECEIVE reader maps TCP's queue alone. One that read
// before (a header by read()) may have redirected bytes queued at its first
// zerocopy call, as may one whose install trusts readers (sends redirected
// before the first read): it would poll for them for ever, and a TCP byte
// mapped ahead of them would reorder the stream. Its peer's later sends
// queue behind them, and the guard resets the connection: both sides get
// an error, counted and reported, and never a byte out of order. Before
// the getsockopt hook such a reader took nothing and polled until its
// deadline (bypass's TestZerocopyReceiveReaderGetsEveryByte, its third
// case).
func TestZerocopyReaderWithRedirectedBytesIsReset(t *testing.T) {
	for _, tc := range []struct {
		name string
		opts bypass.Options
		warm bool
	}{
		{"after reads", bypass.Options{}, true},
		{"trusted reader", bypass.Options{TrustReaders: true}, false},
	} {
		t.Run(tc.name, func(t *testing.T) {
			in, side := installedWith(t, tc.opts)
			zerocopyReaderIsReset(t, in, side, runGuard(t, in), tc.warm)
		})
	}
}

func zerocopyReaderIsReset(t *testing.T, in *bypass.Install, side testenv.Side, reports <-chan string, warm bool) {
	t.Helper()
	c, s := testenv.ConnPair(t, "tcp4", side, "127.0.0.1:0", side, "127.0.0.1:0")
	if warm {
		testenv.Warm(t, c, s)
	}
	queued := []byte(strings.Repeat("redirected, never mapped ", 2000))
	if _, err := c.Write(queued); err != nil {
		t.Fatal(err)
	}
	var got []byte
	var takeErr error
	start := time.Now()
	bound := 3 * time.Second
	if testing.Short() {
		bound = 10 * time.Second // qemu without KVM
	}
	raw, err := s.SyscallConn()
	if err != nil {
		t.Fatal(err)
	}
	raw.Control(func(fd uintptr) {
		zc := testenv.NewZerocopyReceiver(t, int(fd))
		// Until the bytes are queued (a redirect lands within the send).
		fds := []unix.PollFd{{Fd: int32(fd), Events: unix.POLLIN}}
		unix.Poll(fds, 2000)
		sent := false
		for time.Since(start) < bound+2*time.Second {
			b, err := zc.Take()
			got = append(got, b...)
			if err != nil {
				takeErr = err
				return
			}
			if !sent {
				// Sent after the first call: behind the queued bytes,
				// never ahead of them.
				c.Write([]byte("later"))
				sent = true
			}
			unix.Poll(fds, 100)
		}
	})
	took := time.Since(start)
	if len(got) > 0 && !strings.HasPrefix(string(queued)+"later", string(got)) {
		t.Fatalf("the zerocopy reader took %d bytes out of order: %.40q", len(got), got)
	}
	if !errors.Is(takeErr, syscall.ECONNABORTED) && !errors.Is(takeErr, syscall.ECONNRESET) {
		st, _ := in.Stats()
		t.Logf("counters %+v", st.Counters)
		select {
		case msg := <-reports:
			t.Log(msg)
		default:
		}
		t.Fatalf("the zerocopy reader took %d bytes in %v, then %v; want the connection reset", len(got), took, takeErr)
	}
	if took > bound {
		t.Errorf("the caught connection took %v to end, want within %v", took, bound)
	}
	c.SetReadDeadline(time.Now().Add(5 * time.Second))
	if _, err := io.ReadAll(c); !errors.Is(err, syscall.ECONNRESET) {
		t.Errorf("the client read %v, want ECONNRESET", err)
	}
	select {
	case msg := <-reports:
		if !strings.Contains(msg, "TCP_ZEROCOPY_RECEIVE") || !strings.Contains(msg, "connection reset") {
			t.Errorf("guard report %q does not name zerocopy receive and the reset", msg)
		}
	case <-time.After(5 * time.Second):
		t.Fatal("the guard reported nothing")
	}
	st, err := in.Stats()
	if err != nil {
		t.Fatal(err)
	}
	if st.Counters.ZerocopyCaught != 1 || st.Counters.ZerocopyReceive != 1 {
		t.Errorf("zerocopy receive %d, caught %d; want 1 and 1", st.Counters.ZerocopyReceive, st.Counters.ZerocopyCaught)
	}
}
