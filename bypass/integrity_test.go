package bypass_test

import (
	"sync"
	"testing"
	"time"

	"github.com/shunt-project/shunt/internal/testenv"
)

// Requirement 2: 256 MiB each way at once, writes of 1 B .. 1 MiB, arrive
// byte-exact. Readers here are slower than writers, so flow control moves
// sends between the redirect path and TCP many times on the way: the stream
// must survive every switch.
func TestIntegrityBothDirections(t *testing.T) {
	in, cg := mustInstall(t)
	a, b := testenv.MustNetNS(t), testenv.MustNetNS(t)
	testenv.Veth(t, a, b)
	c, s := testenv.ConnPair(t, "tcp4", testenv.Side{NS: b, CG: cg}, "10.199.0.2:0", testenv.Side{NS: a, CG: cg}, "10.199.0.2:0")

	// A stream that stalls (bytes lost or stuck behind a reordering) must
	// fail the test, not hang it.
	for _, conn := range []interface{ SetDeadline(time.Time) error }{c, s} {
		_ = conn.SetDeadline(time.Now().Add(60 * time.Second))
	}
	const size = 256 << 20
	up := testenv.Stream{Seed: 1, Size: size, MaxChunk: 1 << 20}
	down := testenv.Stream{Seed: 2, Size: size, MaxChunk: 1 << 20}
	errs := make(chan error, 4)
	var wg sync.WaitGroup
	for _, f := range []func() error{
		func() error { defer c.CloseWrite(); return up.Write(c) },
		func() error { return up.Check(s, true) },
		func() error { defer s.CloseWrite(); return down.Write(s) },
		func() error { return down.Check(c, true) },
	} {
		wg.Add(1)
		go func() { defer wg.Done(); errs <- f() }()
	}
	wg.Wait()
	close(errs)
	for err := range errs {
		if err != nil {
			t.Error(err)
		}
	}

	fl := flowOf(t, in, testenv.Cookie(t, c))
	if fl == nil || fl.Client == nil || fl.Server == nil {
		t.Fatalf("connection not bypassed: %+v", fl)
	}
	if fl.Client.TxBytes == 0 || fl.Server.TxBytes == 0 {
		t.Errorf("redirected %d / %d bytes: want redirection both ways", fl.Client.TxBytes, fl.Server.TxBytes)
	}
	t.Logf("redirected %d MiB up, %d MiB down of %d MiB each; sends over TCP: %d up, %d down",
		fl.Client.TxBytes>>20, fl.Server.TxBytes>>20, size>>20, fl.Client.TCPMsgs, fl.Server.TCPMsgs)
}
