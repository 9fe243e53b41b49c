package bypass_test

import (
	"bytes"
	"encoding/binary"
	"fmt"
	"io"
	"net"
	"testing"
	"time"

	"golang.org/x/sys/unix"

	"github.com/shunt-project/shunt/bypass"
	"github.com/shunt-project/shunt/internal/testenv"
)

// A writer that leaves Nagle's algorithm on and streams small sends over
// loopback moves more bytes by TCP, which gathers them into 64 KiB
// segments, than by a redirect of each (docs/BENCHMARKS.md, "Small
// writes"): its connection goes back to TCP, every byte in order. A writer
// with TCP_NODELAY, one that reads an answer after each send, or one that
// sends slowly keeps the bypass. Seen failing with the rule off
// (smallWriteRun 0): "connections sent back for small writes: 0, want 1".
func TestSmallWriteStreamGoesBackToTCP(t *testing.T) {
	// Under qemu (-short) a send takes 5 to 20 times longer: a wider
	// window, and a trickle slower by as much.
	opts, pace := bypass.Options{}, 100*time.Microsecond
	if testing.Short() {
		opts, pace = bypass.WithSmallWriteWindow(opts, 200*time.Millisecond), 10*time.Millisecond
	}
	in, cg := mustInstallWith(t, opts)
	side := testenv.Side{NS: testenv.MustNetNS(t), CG: cg}
	cases := []struct {
		name     string
		nagle    bool
		answered bool          // the writer reads a byte back after each send
		pace     time.Duration // between sends
		sentBack bool
	}{
		{name: "nagle-stream", nagle: true, sentBack: true},
		{name: "nodelay-stream"},
		{name: "nagle-answered", nagle: true, answered: true},
		{name: "nagle-trickle", nagle: true, pace: pace},
	}
	for i, fam := range loopbacks {
		for j, tc := range cases {
			if !onDiagonal(i, j) && !tc.sentBack {
				continue
			}
			t.Run(fam.network+"/"+tc.name, func(t *testing.T) {
				c, s := testenv.ConnPair(t, fam.network, side, fam.addr, side, fam.addr)
				testenv.Warm(t, c, s)
				if err := c.SetNoDelay(!tc.nagle); err != nil {
					t.Fatal(err)
				}
				before, err := in.Counters()
				if err != nil {
					t.Fatal(err)
				}
				sends := 2000
				if tc.pace > 0 || tc.answered {
					sends = 200
				}
				stream := numbered(sends)
				done := make(chan error, 1)
				go func() { done <- readStream(s, stream, tc.answered) }()
				rawFD(t, c, func(fd int) {
					for k := 0; k < sends; k++ {
						writeAll(t, fd, stream[k*sendSize:(k+1)*sendSize])
						if tc.answered {
							readByte(t, fd)
						}
						if tc.pace > 0 {
							time.Sleep(tc.pace)
						}
					}
				})
				if err := <-done; err != nil {
					t.Fatal(err)
				}
				requireSentBack(t, in, c, s, before, "for small writes", func(n bypass.Counters) uint64 { return n.SmallWrites }, tc.sentBack,
					func(f *bypass.Flow) *bypass.Endpoint { return f.Client })
			})
		}
	}
}

const sendSize = 100

// numbered is sends blocks of sendSize bytes, each starting with its
// index: a byte lost, doubled or out of order shows.
func numbered(sends int) []byte {
	b := make([]byte, sends*sendSize)
	for k := 0; k < sends; k++ {
		blk := b[k*sendSize : (k+1)*sendSize]
		binary.BigEndian.PutUint32(blk, uint32(k))
		for i := 4; i < sendSize; i++ {
			blk[i] = byte(k + i)
		}
	}
	return b
}

// readStream reads want from s. If answered, it answers each block with a
// byte, spinning on non-blocking reads: round trips then take a few
// microseconds, 64 of them well inside the small-write window, so only the
// reads tell them from a stream.
func readStream(s *net.TCPConn, want []byte, answered bool) error {
	got := make([]byte, len(want))
	if !answered {
		if err := s.SetDeadline(time.Now().Add(20 * time.Second)); err != nil {
			return err
		}
		if _, err := io.ReadFull(s, got); err != nil {
			return err
		}
	} else {
		raw, err := s.SyscallConn()
		if err != nil {
			return err
		}
		var spinErr error
		if err := raw.Control(func(fd uintptr) { spinErr = spinAnswers(int(fd), got) }); err != nil {
			return err
		}
		if spinErr != nil {
			return spinErr
		}
	}
	for i := range got {
		if got[i] != want[i] {
			return fmt.Errorf("the stream differs from what was sent at byte %d", i)
		}
	}
	return nil
}

func spinAnswers(fd int, got []byte) error {
	deadline := time.Now().Add(20 * time.Second)
	for off := 0; off < len(got); {
		n, err := unix.Read(fd, got[off:off+sendSize-off%sendSize])
		switch {
		case err == unix.EAGAIN:
			if time.Now().After(deadline) {
				return fmt.Errorf("read %d of %d bytes in 20 s", off, len(got))
			}
			continue
		case err != nil:
			return err
		case n == 0:
			return io.ErrUnexpectedEOF
		}
		off += n
		if off%sendSize == 0 {
			if _, err := unix.Write(fd, []byte{'.'}); err != nil {
				return err
			}
		}
	}
	return nil
}

// writeAll writes b to the non-blocking fd, waiting for room if need be.
func writeAll(t *testing.T, fd int, b []byte) {
	t.Helper()
	for len(b) > 0 {
		n, err := unix.Write(fd, b)
		if err == unix.EAGAIN {
			waitFD(t, fd, unix.POLLOUT)
			continue
		}
		if err != nil {
			t.Fatalf("write: %v", err)
		}
		b = b[n:]
	}
}

// readByte reads one byte from the non-blocking fd, spinning.
func readByte(t *testing.T, fd int) {
	t.Helper()
	b := make([]byte, 1)
	for deadline := time.Now().Add(5 * time.Second); ; {
		n, err := unix.Read(fd, b)
		if err == unix.EAGAIN && time.Now().Before(deadline) {
			continue
		}
		if err != nil || n != 1 {
			t.Fatalf("read the answer: %d, %v", n, err)
		}
		return
	}
}

func waitFD(t *testing.T, fd int, events int16) {
	t.Helper()
	pfd := []unix.PollFd{{Fd: int32(fd), Events: events}}
	if n, err := unix.Poll(pfd, 5000); err != nil && err != unix.EINTR {
		t.Fatal(err)
	} else if n == 0 {
		t.Fatal("waited 5 s on the socket")
	}
}

// The connection of a small-write stream goes back to TCP while its reader
// may hold redirected bytes: the writer's sends take TCP from then on, and
// a reader that takes the short read draining the redirected ones for all
// there is (nginx) must not be left waiting for an edge those TCP bytes
// raised before. The reader reads as nginx does while the writer streams,
// then stops: every byte arrives, without a wait on a stall.
func TestSmallWriteStreamNeverStallsItsReader(t *testing.T) {
	opts := bypass.Options{}
	if testing.Short() {
		opts = bypass.WithSmallWriteWindow(opts, 200*time.Millisecond)
	}
	for _, network := range []string{"tcp4", "tcp6"} {
		t.Run(network, func(t *testing.T) {
			in, c, s := guardedPair(t, network, opts)
			testenv.Warm(t, c, s)
			if err := s.SetNoDelay(false); err != nil {
				t.Fatal(err)
			}
			before, err := in.Counters()
			if err != nil {
				t.Fatal(err)
			}
			const sends = 3000
			stream := numbered(sends)
			type result struct {
				got []byte
				err error
			}
			done := make(chan result, 1)
			start := time.Now()
			go func() {
				got, err := fionreadRead(t, c, len(stream), fionreadReader{}, 10*time.Second)
				done <- result{got, err}
			}()
			rawFD(t, s, func(fd int) {
				for k := 0; k < sends; k++ {
					writeAll(t, fd, stream[k*sendSize:(k+1)*sendSize])
				}
			})
			r := <-done
			took := time.Since(start)
			if r.err != nil {
				t.Fatalf("after %v: %v", took.Round(time.Millisecond), r.err)
			}
			if !bytes.Equal(r.got, stream) {
				t.Fatalf("got %d bytes that differ from the %d sent", len(r.got), len(stream))
			}
			after, err := in.Counters()
			if err != nil {
				t.Fatal(err)
			}
			t.Logf("%d bytes in %v; sent back for small writes %d, stalls rescued %d", len(r.got), took.Round(time.Millisecond),
				after.SmallWrites-before.SmallWrites, after.StallsRescued-before.StallsRescued)
			if after.SmallWrites != before.SmallWrites+1 {
				t.Fatalf("connections sent back for small writes: %d, want 1: the case is not made", after.SmallWrites-before.SmallWrites)
			}
			if took > 3*time.Second {
				t.Errorf("the stream took %v: the reader waited on a stall", took)
			}
		})
	}
}
