package bypass_test

import (
	"sync"
	"testing"

	"github.com/shunt-project/shunt/internal/testenv"
)

// Requirement 2: 256 MiB each way at once, writes of 1 B .. 1 MiB, arrive
// byte-exact, all of it by redirect.
func TestIntegrityBothDirections(t *testing.T) {
	in, cg := mustInstall(t)
	a, b := testenv.MustNetNS(t), testenv.MustNetNS(t)
	testenv.Veth(t, a, b)
	c, s := testenv.ConnPair(t, "tcp4", testenv.Side{NS: b, CG: cg}, "10.199.0.2:0", testenv.Side{NS: a, CG: cg}, "10.199.0.2:0")

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
	if fl.Client.TxBytes != size || fl.Server.TxBytes != size {
		t.Errorf("redirected %d / %d bytes, want %d each way", fl.Client.TxBytes, fl.Server.TxBytes, size)
	}
}
