package testenv

import (
	"bytes"
	"errors"
	"fmt"
	"io"
	"math/rand/v2"
	"net"
	"os"
	"strings"
	"testing"
	"time"
)

// Stream is a reproducible byte stream: a writer sends it in chunks of random
// size and a reader with the same seed checks every byte in order, so any
// byte lost, duplicated, reordered or delivered to the wrong socket shows.
type Stream struct {
	Seed uint64
	Size int64
	// MaxChunk bounds the random write size (1 .. MaxChunk bytes).
	MaxChunk int
}

func (s Stream) source() *rand.ChaCha8 {
	var seed [32]byte
	for i := 0; i < 8; i++ {
		seed[i] = byte(s.Seed >> (8 * i))
	}
	return rand.NewChaCha8(seed)
}

// Write sends the stream to w in random-sized writes.
func (s Stream) Write(w io.Writer) error {
	src := s.source()
	sizes := rand.New(rand.NewPCG(s.Seed, 1))
	buf := make([]byte, s.MaxChunk)
	for left := s.Size; left > 0; {
		n := 1 + sizes.IntN(s.MaxChunk)
		if int64(n) > left {
			n = int(left)
		}
		_, _ = src.Read(buf[:n])
		if _, err := w.Write(buf[:n]); err != nil {
			return fmt.Errorf("write at offset %d: %w", s.Size-left, err)
		}
		left -= int64(n)
	}
	return nil
}

// Check reads exactly the stream from r and reports the first difference.
// It then expects EOF when wantEOF is set.
func (s Stream) Check(r io.Reader, wantEOF bool) error {
	src := s.source()
	got := make([]byte, 256<<10)
	want := make([]byte, len(got))
	var off int64
	for off < s.Size {
		n := len(got)
		if int64(n) > s.Size-off {
			n = int(s.Size - off)
		}
		m, err := r.Read(got[:n])
		if m > 0 {
			_, _ = src.Read(want[:m])
			if !bytes.Equal(got[:m], want[:m]) {
				i := 0
				for got[i] == want[i] {
					i++
				}
				return fmt.Errorf("stream %d differs at byte %d of %d (got % x, want % x)%s", s.Seed, off+int64(i), s.Size, got[i:min(i+8, m)], want[i:min(i+8, m)], s.locate(got[i:m], off+int64(i)))
			}
			off += int64(m)
		}
		if err != nil {
			return fmt.Errorf("stream %d: read at byte %d of %d: %w", s.Seed, off, s.Size, err)
		}
	}
	if wantEOF {
		var one [1]byte
		if m, err := r.Read(one[:]); m != 0 || err != io.EOF {
			return fmt.Errorf("stream %d: want EOF after %d bytes, got %d more bytes, err %v", s.Seed, s.Size, m, err)
		}
	}
	return nil
}

// locate says where in the stream the bytes found at offset at belong, when
// they are from within 16 MiB of it: a repeat or a skip.
func (s Stream) locate(got []byte, at int64) string {
	if len(got) < 16 {
		return ""
	}
	got = got[:min(len(got), 64)]
	from := max(0, at-16<<20)
	buf := make([]byte, min(s.Size, at+16<<20)-from)
	src := s.source()
	skip := make([]byte, 1<<20)
	for left := from; left > 0; left -= int64(len(skip)) {
		_, _ = src.Read(skip[:min(int64(len(skip)), left)])
	}
	_, _ = src.Read(buf)
	if i := bytes.Index(buf, got); i >= 0 {
		return fmt.Sprintf("; those bytes belong at offset %d (%+d)", from+int64(i), from+int64(i)-at)
	}
	return "; those bytes are not from within 16 MiB"
}

// ErrStalled is returned by WriteUntilStalled when the writer was held back.
var ErrStalled = errors.New("writer stalled")

// WriteUntilStalled writes s to c until a write makes no progress for idle
// (then ErrStalled) or s ends; it returns the bytes c accepted.
func (s Stream) WriteUntilStalled(c *net.TCPConn, idle time.Duration) (int64, error) {
	w := &stallWriter{c: c, idle: idle}
	err := s.Write(w)
	c.SetWriteDeadline(time.Time{})
	return w.n, err
}

type stallWriter struct {
	c    *net.TCPConn
	idle time.Duration
	n    int64
}

func (w *stallWriter) Write(b []byte) (int, error) {
	w.c.SetWriteDeadline(time.Now().Add(w.idle))
	n, err := w.c.Write(b)
	w.n += int64(n)
	if errors.Is(err, os.ErrDeadlineExceeded) {
		return n, ErrStalled
	}
	return n, err
}

// HalfCloser is a connection that can send FIN.
type HalfCloser interface {
	io.Writer
	CloseWrite() error
}

// WriteAndClose writes the stream to c, then sends FIN.
func (s Stream) WriteAndClose(c HalfCloser) error {
	if err := s.Write(c); err != nil {
		return err
	}
	return c.CloseWrite()
}

// Through writes the stream to w (then FIN) while checking it, and EOF
// after it, on r.
func (s Stream) Through(w HalfCloser, r io.Reader) error {
	sent := make(chan error, 1)
	go func() { sent <- s.WriteAndClose(w) }()
	if err := s.Check(r, true); err != nil {
		return err
	}
	return <-sent
}

// HeaderThenSplice serves a connection as a proxy that reads a header
// first does: it reads 4 bytes with recv, then echoes the rest with
// io.Copy, which splices between two *net.TCPConn (TCPConn.ReadFrom).
func HeaderThenSplice(s *net.TCPConn) (copied int64, err error) {
	head := make([]byte, 4)
	if _, err := io.ReadFull(s, head); err != nil {
		return 0, err
	}
	copied, err = io.Copy(s, s)
	_ = s.CloseWrite()
	return copied, err
}

// SpliceResult is what a server that read a header and then spliced got:
// the bytes it copied, its error, and when it ended (from the client's
// write).
type SpliceResult struct {
	N   int64
	Err error
	At  time.Duration
}

// CaughtSplice makes a connection in side whose server reads a 4-byte
// header by recv and then splices (HeaderThenSplice) while the client's
// redirected bytes are queued, which splice cannot read: shunt catches it.
// Both ends have a 20 s deadline; the server's result comes on the channel.
func CaughtSplice(t testing.TB, side Side) (client, server *net.TCPConn, served <-chan SpliceResult) {
	t.Helper()
	return CaughtSpliceBy(t, side, HeaderThenSplice)
}

// CaughtSpliceBy is CaughtSplice with the server's way of splicing
// (HeaderThenSplice, HeaderThenIOUringSplice).
func CaughtSpliceBy(t testing.TB, side Side, serve func(*net.TCPConn) (int64, error)) (client, server *net.TCPConn, served <-chan SpliceResult) {
	t.Helper()
	c, s := ConnPair(t, "tcp4", side, "127.0.0.1:0", side, "127.0.0.1:0")
	for _, conn := range []*net.TCPConn{c, s} {
		conn.SetDeadline(time.Now().Add(20 * time.Second))
	}
	Warm(t, c, s) // both readers seen in recv: sends are redirected
	done := make(chan SpliceResult, 1)
	start := time.Now()
	go func() {
		n, err := serve(s)
		done <- SpliceResult{n, err, time.Since(start)}
	}()
	if _, err := c.Write([]byte("HEAD" + strings.Repeat("spliced body ", 5000))); err != nil {
		t.Fatal(err)
	}
	return c, s, done
}

// Conn is one end of a stream: it reads, writes and sends FIN.
type Conn interface {
	io.Reader
	HalfCloser
}

// BothWays sends up from a to b and down from b to a at once, each closed
// after its last byte, and checks that both arrive whole and end in EOF.
// The returned wait gives the first error once all four are done.
func BothWays(a, b Conn, up, down Stream) (wait func() error) {
	errs := make(chan error, 4)
	go func() { errs <- up.WriteAndClose(a) }()
	go func() { errs <- down.WriteAndClose(b) }()
	go func() { errs <- up.Check(b, true) }()
	go func() { errs <- down.Check(a, true) }()
	return func() error {
		var first error
		for range 4 {
			if err := <-errs; err != nil && first == nil {
				first = err
			}
		}
		return first
	}
}
