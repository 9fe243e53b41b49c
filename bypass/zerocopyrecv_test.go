package bypass_test

import (
	"bytes"
	"errors"
	"testing"
	"time"

	"golang.org/x/sys/unix"

	"github.com/shunt-project/shunt/internal/testenv"
)

// A reader that takes its bytes with getsockopt(TCP_ZEROCOPY_RECEIVE), the
// pages of TCP's receive queue mapped into its memory, and read()s only
// the skip hint (what cannot be mapped), sees TCP's queue alone: bytes
// redirected into its psock never come. Its socket goes back to TCP at its
// first such call, so it gets every byte, in order, whether it read
// before (a header by read(), then the bulk mapped) or not. With the build
// before the getsockopt hook such a reader took 64 KiB of 1 MiB, then
// polled readable with nothing to map until its deadline.
func TestZerocopyReceiveReaderGetsEveryByte(t *testing.T) {
	in, cg := mustInstall(t)
	cases := []struct {
		name, network, addr string
		readFirst           bool
	}{
		{"tcp4", "tcp4", "127.0.0.1:0", false},
		{"tcp6", "tcp6", "[::1]:0", false},
		{"tcp4 after reads", "tcp4", "127.0.0.1:0", true},
	}
	for _, tc := range cases {
		t.Run(tc.name, func(t *testing.T) {
			side := testenv.Side{NS: testenv.MustNetNS(t), CG: cg}
			c, s := testenv.ConnPair(t, tc.network, side, tc.addr, side, tc.addr)
			if tc.readFirst {
				testenv.Warm(t, c, s)
				exchange(t, c, s, "a header, read by read()")
				if flowOf(t, in, testenv.Cookie(t, c)) == nil {
					t.Fatal("the connection is not bypassed before the first zerocopy receive")
				}
			}
			before := counters(t, in)
			want := bytes.Repeat([]byte("0123456789abcdef"), 1<<16) // 1 MiB
			var got []byte
			var calls int
			rawFD(t, s, func(fd int) {
				zc := testenv.NewZerocopyReceiver(t, fd)
				// The first call comes before any byte is sent, as a
				// program's first call comes before it reads.
				if _, err := zc.Take(); err != nil {
					t.Fatalf("getsockopt(TCP_ZEROCOPY_RECEIVE): %v", err)
				}
				go func() {
					for off := 0; off < len(want); off += 64 << 10 {
						if _, err := c.Write(want[off : off+64<<10]); err != nil {
							return
						}
						time.Sleep(5 * time.Millisecond)
					}
				}()
				for deadline := time.Now().Add(5 * time.Second); len(got) < len(want) && time.Now().Before(deadline); {
					fds := []unix.PollFd{{Fd: int32(fd), Events: unix.POLLIN}}
					if _, err := unix.Poll(fds, 100); err != nil && !errors.Is(err, unix.EINTR) {
						t.Fatal(err)
					}
					b, err := zc.Take()
					if err != nil {
						t.Errorf("getsockopt(TCP_ZEROCOPY_RECEIVE) after %d bytes: %v", len(got), err)
						return
					}
					calls++
					got = append(got, b...)
				}
			})
			if !bytes.Equal(got, want) {
				t.Fatalf("took %d of %d bytes in %d calls (intact so far: %v)", len(got), len(want), calls, bytes.HasPrefix(want, got))
			}
			if n := counters(t, in).ZerocopyReceive - before.ZerocopyReceive; n != 1 {
				t.Errorf("connections_zerocopy_receive went up by %d, want 1", n)
			}
			exchange(t, c, s, "and plain reads after it")
		})
	}
}
