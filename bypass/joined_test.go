package bypass_test

import (
	"bytes"
	"errors"
	"io"
	"net"
	"testing"
	"time"

	"github.com/cilium/ebpf"

	"github.com/shunt-project/shunt/bypass"
	"github.com/shunt-project/shunt/host"
	"github.com/shunt-project/shunt/internal/testenv"
	"github.com/shunt-project/shunt/splice"
)

// proxied is a proxy's shape in one enabled cgroup: client -> front (the
// proxy's accepted socket), back (its socket to the upstream) -> upstream,
// each leg paired by bypass, front and back joined in the kernel.
type proxied struct {
	client, front, back, upstream *net.TCPConn
	cookies                       [4]uint64 // in that order, taken before the join closes its own
	// added: what the proxy (the test) wrote to the upstream before the
	// join less what it read from the client, for NewShortcut.
	added uint32
}

var proxiedNames = [4]string{"client", "proxy's front", "proxy's back", "upstream"}

// mustProxied builds it over the family's loopback. header is what the
// proxy writes to the upstream before the join (a PROXY protocol header);
// the upstream checks it, then echoes. Both legs' readers are seen in recv
// first (each leg alone would be redirected from there on), the proxy's
// front socket's only if readFront: a proxy that never reads it itself
// leaves that to the join, whose reads 6.1's reader watch does not see.
func mustProxied(t *testing.T, cg host.Cgroup, sp *splice.Splicer, network, addr string, header []byte, readFront bool) proxied {
	t.Helper()
	side := testenv.Side{NS: testenv.MustNetNS(t), CG: cg}
	var p proxied
	p.client, p.front = testenv.ConnPair(t, network, side, addr, side, addr)
	p.back, p.upstream = testenv.ConnPair(t, network, side, addr, side, addr)
	if readFront {
		testenv.Warm(t, p.client, p.front)
	} else {
		// The client's reader only.
		if _, err := p.front.Write([]byte{'w'}); err != nil {
			t.Fatal(err)
		}
		if _, err := io.ReadFull(p.client, make([]byte, 1)); err != nil {
			t.Fatal(err)
		}
	}
	testenv.Warm(t, p.back, p.upstream)
	p.added = 1 + uint32(len(header)) // the warm-up's byte, and the header
	if readFront {
		p.added-- // the client's warm-up byte, read here
	}
	for i, c := range []*net.TCPConn{p.client, p.front, p.back, p.upstream} {
		p.cookies[i] = testenv.Cookie(t, c)
	}
	if _, err := p.back.Write(header); err != nil {
		t.Fatal(err)
	}
	if _, err := sp.Join(p.front, p.back); err != nil {
		t.Fatal(err)
	}
	go func() {
		got := make([]byte, len(header))
		if _, err := io.ReadFull(p.upstream, got); err != nil || !bytes.Equal(got, header) {
			t.Errorf("upstream read header %q, %v; want %q", got, err, header)
			p.upstream.Close()
			return
		}
		testenv.Pump(p.upstream, p.upstream)
	}()
	if err := p.client.SetDeadline(time.Now().Add(20 * time.Second)); err != nil {
		t.Fatal(err)
	}
	return p
}

func mustSplicerHere(t *testing.T) *splice.Splicer {
	t.Helper()
	sp, err := splice.New(splice.Options{})
	if err != nil {
		t.Fatal(err)
	}
	t.Cleanup(func() {
		if err := sp.Close(); err != nil {
			t.Error(err)
		}
	})
	return sp
}

// redirected is what each of the four sockets sent by redirect, as bypass
// counts it (the client and upstream must still be held; the join closes
// its own).
func (p proxied) redirected(t *testing.T, in *bypass.Install) (tx [4]uint64) {
	t.Helper()
	for i, cookie := range p.cookies {
		f := flowOf(t, in, cookie)
		if f == nil {
			if i == 0 || i == 3 {
				t.Fatalf("%s's socket is not held: its leg was not paired", proxiedNames[i])
			}
			continue
		}
		for _, e := range []*bypass.Endpoint{f.Client, f.Server} {
			if e != nil && e.Cookie == cookie {
				tx[i] = e.TxBytes
			}
		}
	}
	return tx
}

var loopbacks = []struct{ network, addr string }{{"tcp4", "127.0.0.1:0"}, {"tcp6", "[::1]:0"}}

// A kernel join (shunt proxy --mode kernel, splice, daemon) may hold sockets
// of connections bypass paired: a proxy running in an enabled cgroup between
// a client and an upstream that are enabled too. The join's verdict reads
// only TCP's queue and counts its own sends as TCP's, so nothing may be
// redirected into a joined socket nor out of one. Seen failing without that:
// the stream stopped after its first chunks, the upstream's replies waiting
// in the proxy socket's psock where the verdict never looks.
func TestKernelJoinInsideAnEnabledCgroup(t *testing.T) {
	in, cg := mustInstall(t)
	sp := mustSplicerHere(t)
	for i, fam := range loopbacks {
		t.Run(fam.network, func(t *testing.T) {
			p := mustProxied(t, cg, sp, fam.network, fam.addr, nil, true)
			s := testenv.Stream{Seed: uint64(i + 1), Size: 8 << 20, MaxChunk: 200 << 10}
			if err := s.Through(p.client, p.client); err != nil {
				t.Fatalf("through the join: %v", err)
			}
			for i, n := range p.redirected(t, in) {
				if n != 0 {
					t.Errorf("%s redirected %d bytes with no shortcut: a joined socket's leg must stay on TCP", proxiedNames[i], n)
				}
			}
		})
	}
}

// With a shortcut the join is passed by: the client's sends go straight to
// the upstream's socket and back, as if there were no proxy, while nothing
// sent by TCP is still on its way through the join; a PROXY header the
// proxy wrote first stays first. Every byte arrives once and in order.
func TestShortcutPassesTheJoinBy(t *testing.T) {
	in, cg := mustInstall(t)
	sp := mustSplicerHere(t)
	cases := []struct {
		name      string
		header    []byte
		readFront bool
	}{
		{"no-header", nil, true},
		{"proxy-header", []byte("PROXY TCP4 10.0.0.1 10.0.0.2 1111 2222\r\n"), true},
		{"front-read-by-the-join-only", nil, false},
	}
	for i, fam := range loopbacks {
		for _, c := range cases {
			header := c.header
			t.Run(fam.network+"/"+c.name, func(t *testing.T) {
				p := mustProxied(t, cg, sp, fam.network, fam.addr, header, c.readFront)
				sc, err := in.NewShortcut(p.front, p.back, p.added)
				if err != nil {
					t.Fatal(err)
				}
				s := testenv.Stream{Seed: uint64(10 + i), Size: 8 << 20, MaxChunk: 200 << 10}
				if err := s.Through(p.client, p.client); err != nil {
					t.Fatalf("through the shortcut: %v", err)
				}
				tx := p.redirected(t, in)
				if err := sc.Close(); err != nil {
					t.Fatal(err)
				}
				ab, ba, sends, err := sc.Bytes()
				if err != nil {
					t.Fatal(err)
				}
				t.Logf("passed the join by: %d bytes up, %d down, %d sends; redirected by client %d, upstream %d",
					ab, ba, sends, tx[0], tx[3])
				if ab == 0 || ba == 0 {
					t.Errorf("nothing passed the join by one way (up %d, down %d bytes)", ab, ba)
				}
				if tx[0] < ab || tx[3] < ba {
					t.Errorf("the peers' own counts (%d, %d) are below the shortcut's (%d, %d)", tx[0], tx[3], ab, ba)
				}
			})
		}
	}
}

// An entry the map's LRU evicted takes that direction back through the
// join (every byte still arrives), and Close says its count is lost rather
// than reporting 0 bytes passed by as if that were true.
func TestShortcutSaysWhenItsCountsAreLost(t *testing.T) {
	in, cg := mustInstall(t)
	sp := mustSplicerHere(t)
	p := mustProxied(t, cg, sp, "tcp4", "127.0.0.1:0", nil, true)
	sc, err := in.NewShortcut(p.front, p.back, p.added)
	if err != nil {
		t.Fatal(err)
	}
	if err := sc.EvictBack(); err != nil {
		t.Fatal(err)
	}
	s := testenv.Stream{Seed: 30, Size: 1 << 20, MaxChunk: 64 << 10}
	if err := s.Through(p.client, p.client); err != nil {
		t.Fatalf("through the shortcut one way and the join the other: %v", err)
	}
	if _, _, _, err := sc.Bytes(); !errors.Is(err, ebpf.ErrKeyNotExist) {
		t.Errorf("Bytes with an entry evicted: %v, want ErrKeyNotExist", err)
	}
	err = sc.Close()
	if !errors.Is(err, ebpf.ErrKeyNotExist) {
		t.Fatalf("Close with an entry evicted: %v, want ErrKeyNotExist", err)
	}
	ab, ba, _, err := sc.Bytes()
	if err != nil {
		t.Fatalf("Bytes after Close: %v (Close kept what it read)", err)
	}
	if ab == 0 || ba != 0 {
		t.Errorf("after Close: %d bytes up, %d down; want the up count kept and the lost one 0", ab, ba)
	}
}

// A small backlog bound makes the client's sends switch between the
// shortcut and TCP through the join over and over (flow control sends by TCP
// while the upstream holds 64 KiB unread): each switch back to the shortcut
// must wait until the upstream has read everything that took the join.
func TestShortcutKeepsOrderAcrossPaths(t *testing.T) {
	in, cg := mustInstallWith(t, bypass.Options{MaxBacklog: 64 << 10})
	sp := mustSplicerHere(t)
	for i, fam := range loopbacks {
		t.Run(fam.network, func(t *testing.T) {
			p := mustProxied(t, cg, sp, fam.network, fam.addr, nil, true)
			sc, err := in.NewShortcut(p.front, p.back, p.added)
			if err != nil {
				t.Fatal(err)
			}
			defer sc.Close()
			s := testenv.Stream{Seed: uint64(20 + i), Size: 16 << 20, MaxChunk: 100 << 10}
			if err := s.Through(p.client, p.client); err != nil {
				t.Fatalf("through the shortcut and the join: %v", err)
			}
			ab, ba, sends, err := sc.Bytes()
			if err != nil {
				t.Fatal(err)
			}
			f := flowOf(t, in, p.cookies[0])
			var tcpSends uint64
			if f != nil && f.Client != nil {
				tcpSends = f.Client.TCPMsgs
			}
			t.Logf("passed the join by: %d bytes up, %d down, %d sends; client's sends by TCP: %d", ab, ba, sends, tcpSends)
			if ab == 0 || tcpSends == 0 {
				t.Errorf("want both paths used up: %d bytes by the shortcut, %d sends by TCP", ab, tcpSends)
			}
		})
	}
}

// Sockets bypass did not pair (the upstream outside the enabled cgroups)
// get no shortcut, and the caller is told why.
func TestShortcutNeedsPairedLegs(t *testing.T) {
	in, cg := mustInstall(t)
	other := testenv.MustCgroup(t)
	ns := testenv.MustNetNS(t)
	client, front := testenv.ConnPair(t, "tcp4", testenv.Side{NS: ns, CG: cg}, "127.0.0.1:0", testenv.Side{NS: ns, CG: cg}, "127.0.0.1:0")
	back, _ := testenv.ConnPair(t, "tcp4", testenv.Side{NS: ns, CG: other}, "127.0.0.1:0", testenv.Side{NS: ns, CG: cg}, "127.0.0.1:0")
	_ = client
	if _, err := in.NewShortcut(front, back, 0); !errors.Is(err, bypass.ErrNotHeld) {
		t.Fatalf("NewShortcut with an unpaired leg: %v, want ErrNotHeld", err)
	}
}
