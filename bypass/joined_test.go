package bypass_test

import (
	"testing"
	"time"

	"github.com/shunt-project/shunt/bypass"
	"github.com/shunt-project/shunt/internal/testenv"
	"github.com/shunt-project/shunt/splice"
)

// A kernel join (shunt proxy --mode kernel, splice, daemon) may hold sockets
// of connections bypass paired: a proxy running in an enabled cgroup between
// a client and an upstream that are enabled too. The join's verdict reads
// only TCP's queue and counts its own sends as TCP's, so nothing may be
// redirected into a joined socket nor out of one. Seen failing without that:
// the stream stopped after its first chunks, the upstream's replies waiting
// in the proxy socket's psock where the verdict never looks.
func TestKernelJoinInsideAnEnabledCgroup(t *testing.T) {
	in, cg := mustInstall(t)
	sp, err := splice.New(splice.Options{})
	if err != nil {
		t.Fatal(err)
	}
	t.Cleanup(func() {
		if err := sp.Close(); err != nil {
			t.Error(err)
		}
	})
	for i, fam := range []struct{ network, addr string }{{"tcp4", "127.0.0.1:0"}, {"tcp6", "[::1]:0"}} {
		t.Run(fam.network, func(t *testing.T) {
			side := testenv.Side{NS: testenv.MustNetNS(t), CG: cg}
			client, front := testenv.ConnPair(t, fam.network, side, fam.addr, side, fam.addr)
			back, upstream := testenv.ConnPair(t, fam.network, side, fam.addr, side, fam.addr)
			// Both legs' readers seen in recv: each leg alone would be
			// redirected from here on.
			testenv.Warm(t, client, front)
			testenv.Warm(t, back, upstream)
			type held struct {
				name   string
				cookie uint64
				open   bool // still open when checked (the join closes its own)
			}
			socks := []held{
				{"client", testenv.Cookie(t, client), true}, {"proxy's front", testenv.Cookie(t, front), false},
				{"proxy's back", testenv.Cookie(t, back), false}, {"upstream", testenv.Cookie(t, upstream), true},
			}
			if _, err := sp.Join(front, back); err != nil {
				t.Fatal(err)
			}
			go echo(upstream)
			if err := client.SetDeadline(time.Now().Add(20 * time.Second)); err != nil {
				t.Fatal(err)
			}
			s := testenv.Stream{Seed: uint64(i + 1), Size: 8 << 20, MaxChunk: 200 << 10}
			if err := s.Through(client, client); err != nil {
				t.Fatalf("through the join: %v", err)
			}
			for _, c := range socks {
				f := flowOf(t, in, c.cookie)
				if f == nil {
					if c.open {
						t.Fatalf("%s's socket is not held: its leg was not paired", c.name)
					}
					continue
				}
				for _, e := range []*bypass.Endpoint{f.Client, f.Server} {
					if e != nil && e.Cookie == c.cookie && e.TxBytes != 0 {
						t.Errorf("%s redirected %d bytes; a joined socket's leg must stay on TCP", c.name, e.TxBytes)
					}
				}
			}
		})
	}
}
