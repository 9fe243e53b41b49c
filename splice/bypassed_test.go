package splice_test

import (
	"bytes"
	"io"
	"net"
	"testing"
	"time"

	"github.com/shunt-project/shunt/bypass"
	"github.com/shunt-project/shunt/bypass/bypasstest"
	"github.com/shunt-project/shunt/internal/testenv"
	"github.com/shunt-project/shunt/splice"
)

// A send that bypass redirects to a socket a join is taking (bypass looked
// before the join's verdict was there) lands in the socket's psock queue,
// which the verdict never sees: the join reads those bytes in user space.
// They must count as read, not as bytes the kernel took and lost: the
// direction goes to the kernel and forwards EOF. Before, it stayed in user
// space and, at EOF, reset both sides once LostAfter passed (`shunt proxy
// --mode kernel` in an enabled cgroup: TestProxyCommandPassesTheJoinBy, about
// 1 run in 8 under -race).
func TestSendRedirectedWhileJoiningIsRead(t *testing.T) {
	in, cg := bypasstest.MustEnabled(t, bypass.Options{NoProbation: true}) // every end is this process: one program
	s := mustSplicer(t, splice.Options{LostAfter: time.Second})
	side := testenv.Side{NS: testenv.MustNetNS(t), CG: cg}
	for i, fam := range families {
		t.Run(fam.name, func(t *testing.T) {
			p := &proxied{}
			p.client, p.front = testenv.ConnPair(t, fam.network, side, fam.addr, side, fam.addr)
			p.back, p.server = testenv.ConnPair(t, fam.network, side, fam.addr, side, fam.addr)
			testenv.Warm(t, p.client, p.front) // both readers seen in recv: sends are redirected
			early := []byte("sent while the join is made")
			var before, after uint64
			splice.BeforeMapped(t, func() {
				before = sentByRedirect(t, in, p.client)
				if _, err := p.client.Write(early); err != nil {
					t.Error(err)
				}
				after = sentByRedirect(t, in, p.client)
			})
			p.join(t, s)
			if after-before != uint64(len(early)) {
				t.Fatalf("bypass redirected %d of the %d bytes sent while joining: the case is not made", after-before, len(early))
			}
			got := make([]byte, len(early))
			if _, err := io.ReadFull(p.server, got); err != nil || !bytes.Equal(got, early) {
				t.Fatalf("read %q, %v; want %q", got, err, early)
			}
			// Idle now, both directions go to the kernel: only if every
			// byte read counts as read (asked here, not after the stream,
			// where under load user space may copy all of it).
			p.waitKernel(t)
			up := testenv.Stream{Seed: uint64(2*i + 1), Size: 4 << 20, MaxChunk: 60000}
			down := testenv.Stream{Seed: uint64(2*i + 2), Size: 4 << 20, MaxChunk: 60000}
			p.streamBothWays(t, up, down)
			p.waitDone(t)
			if err := p.pair.Err(); err != nil {
				t.Fatalf("pair ended with %v", err)
			}
		})
	}
}

// sentByRedirect is what bypass redirected from c's socket so far.
func sentByRedirect(t *testing.T, in *bypass.Install, c *net.TCPConn) uint64 {
	t.Helper()
	cookie := testenv.Cookie(t, c)
	flows, err := in.Flows()
	if err != nil {
		t.Fatal(err)
	}
	for _, f := range flows {
		for _, e := range []*bypass.Endpoint{f.Client, f.Server} {
			if e != nil && e.Cookie == cookie {
				return e.TxBytes
			}
		}
	}
	t.Fatalf("%v is not held by bypass", c.LocalAddr())
	return 0
}
