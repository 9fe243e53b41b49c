package bypass_test

import (
	"bytes"
	"testing"
	"time"

	"github.com/shunt-project/shunt/bypass"
	"github.com/shunt-project/shunt/internal/testenv"
)

// An io_uring receive's completion says whether bytes are left in the
// socket after it (IORING_CQE_F_SOCK_NONEMPTY, from the msg_inq TCP's
// recvmsg fills in), and event loops built on io_uring end their reads when
// it does not (Netty's io_uring transport), then wait for the next readiness
// edge. A psock's recvmsg never fills it in: a redirected stream read that
// way was told "empty" with bytes queued after every read, and stalled once
// its writer waited for it (Netty's io_uring transport behind shunt: 2 of 6
// 64 MiB uploads stalled until the stall scan moved them, 2.4-3.3 s instead
// of 0.4 s, on 2026-11-30). So a reader seen reading through io_uring keeps
// its direction on TCP, where every completion tells the truth, wherever
// io_uring runs the receive: in io_uring_enter, in an io-wq worker, or in
// the ring's SQPOLL thread.
func TestIOUringReaderIsToldWhatIsLeft(t *testing.T) {
	in, cg := mustInstall(t)
	side := testenv.Side{NS: testenv.MustNetNS(t), CG: cg}
	families := []struct{ network, addr string }{{"tcp4", "127.0.0.1:0"}, {"tcp6", "[::1]:0"}}
	for _, mode := range []testenv.IOUringMode{testenv.IOUringInline, testenv.IOUringWorker, testenv.IOUringSQPoll} {
		for _, fam := range families {
			t.Run(mode.String()+"/"+fam.network, func(t *testing.T) {
				uringReaderToldWhatIsLeft(t, in, side, mode, fam.network, fam.addr)
			})
		}
	}
}

func uringReaderToldWhatIsLeft(t *testing.T, in *bypass.Install, side testenv.Side, mode testenv.IOUringMode, network, addr string) {
	before, err := in.Counters()
	if err != nil {
		t.Fatal(err)
	}
	c, s := testenv.ConnPair(t, network, side, addr, side, addr)
	r, err := testenv.NewIOUringReader(s, mode)
	if err != nil {
		t.Fatalf("io_uring reader: %v", err)
	}
	defer r.Close()
	buf := make([]byte, 1024)
	// The first bytes take TCP; the first read is io_uring's, as an
	// io_uring event loop's always is.
	write(t, c, "hello")
	if n, _, err := r.Read(buf); err != nil || string(buf[:n]) != "hello" {
		t.Fatalf("first read: %q %v", buf[:n], err)
	}
	body := bytes.Repeat([]byte("0123456789abcdef"), 4096) // 64 KiB
	if _, err := c.Write(body); err != nil {
		t.Fatal(err)
	}
	time.Sleep(20 * time.Millisecond) // all of it queued at s
	var got []byte
	for reads := 0; len(got) < len(body); reads++ {
		n, more, err := r.Read(buf)
		if err != nil {
			t.Fatalf("after %d of %d bytes: %v", len(got), len(body), err)
		}
		got = append(got, buf[:n]...)
		if left := len(body) - len(got); left >= len(buf) && !more {
			// Queued already: the writer wrote it all before the
			// first of these reads.
			t.Fatalf("read %d: told nothing is left with %d bytes still to come (the completion lacks IORING_CQE_F_SOCK_NONEMPTY)", reads, left)
		}
	}
	if !bytes.Equal(got, body) {
		t.Fatal("the bytes read are not the bytes written")
	}
	after, err := in.Counters()
	if err != nil {
		t.Fatal(err)
	}
	if after.URingReaders != before.URingReaders+1 {
		t.Errorf("io_uring readers counted %d, want %d", after.URingReaders, before.URingReaders+1)
	}
}
