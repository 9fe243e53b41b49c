package bypass_test

import (
	"fmt"
	"net"
	"os"
	"sync"
	"testing"
	"time"

	"golang.org/x/sys/unix"

	"github.com/shunt-project/shunt/bypass"
	"github.com/shunt-project/shunt/host"
	"github.com/shunt-project/shunt/internal/testenv"
)

// pairSetup is one client namespace and one server namespace.
type pairSetup struct {
	client, server *testenv.NetNS
	serverIP       string
}

// Requirement 3: identical addresses and ports in different namespaces,
// connected at the same moment from the same source port: every byte
// reaches only its true peer. A key made of the bare 4-tuple fails this.
func TestIsolationIdenticalTuples(t *testing.T) {
	in, cg := mustInstall(t)

	t.Run("veth-pairs", func(t *testing.T) {
		var pairs [2]pairSetup
		for i := range pairs {
			a, b := testenv.MustNetNS(t), testenv.MustNetNS(t)
			testenv.Veth(t, a, b)
			pairs[i] = pairSetup{a, b, "10.199.0.2"}
		}
		raceIdentical(t, in, cg, pairs, "10.199.0.1")
	})
	t.Run("loopback", func(t *testing.T) {
		var pairs [2]pairSetup
		for i := range pairs {
			n := testenv.MustNetNS(t)
			pairs[i] = pairSetup{n, n, "127.0.0.1"}
		}
		raceIdentical(t, in, cg, pairs, "127.0.0.1")
	})
}

// raceIdentical opens, round after round, one connection per pair with the
// very same 4-tuple and checks that each server gets its own client's stream
// and each client its own server's. Even rounds connect both at once (the
// handshakes overlap: shunt cannot tell them apart and must leave them on
// TCP); odd rounds stagger the second connect so both handshakes are clean
// and two live bypassed connections share one 4-tuple.
func raceIdentical(t *testing.T, in *bypass.Install, cg host.Cgroup, pairs [2]pairSetup, clientIP string) {
	const rounds = 20
	const serverPort = 7000
	var lns [2]*net.TCPListener
	for i, p := range pairs {
		lns[i] = testenv.Listen(t, testenv.Side{NS: p.server, CG: cg}, "tcp4", fmt.Sprintf("%s:%d", p.serverIP, serverPort))
	}
	bypassedStaggered := 0
	for r := 0; r < rounds; r++ {
		staggered := r%2 == 1
		var fds [2]int
		for i, p := range pairs {
			testenv.Side{NS: p.client, CG: cg}.Make(t, func() {
				fds[i] = boundSocket(t, clientIP, 41000+r)
			})
		}
		var wg sync.WaitGroup
		var cerr [2]error
		for i, p := range pairs {
			wg.Add(1)
			go func() {
				defer wg.Done()
				if staggered && i == 1 {
					time.Sleep(5 * time.Millisecond)
				}
				dst := &unix.SockaddrInet4{Port: serverPort}
				copy(dst.Addr[:], net.ParseIP(p.serverIP).To4())
				cerr[i] = unix.Connect(fds[i], dst)
			}()
		}
		wg.Wait()
		var conns, srv [2]*net.TCPConn
		for i := range pairs {
			if cerr[i] != nil {
				t.Fatalf("round %d pair %d: connect: %v", r, i, cerr[i])
			}
			conns[i] = fileConn(t, fds[i])
			srv[i] = testenv.Accept(t, lns[i])
			testenv.Warm(t, conns[i], srv[i])
		}
		// Each side sends its own stream; both pairs run at once.
		errs := make(chan error, 8)
		for i := range pairs {
			up := testenv.Stream{Seed: uint64(100*r + 10 + i), Size: 64 << 10, MaxChunk: 4096}
			down := testenv.Stream{Seed: uint64(100*r + 20 + i), Size: 64 << 10, MaxChunk: 4096}
			c, s := conns[i], srv[i]
			go func() { errs <- up.Write(c) }()
			go func() { errs <- up.Check(s, false) }()
			go func() { errs <- down.Write(s) }()
			go func() { errs <- down.Check(c, false) }()
		}
		for k := 0; k < 8; k++ {
			if err := <-errs; err != nil {
				t.Fatalf("round %d (staggered %v): %v", r, staggered, err)
			}
		}
		for i := range pairs {
			if f := flowOf(t, in, testenv.Cookie(t, conns[i])); f != nil && f.Server != nil && f.Client != nil {
				if f.Server.Cookie != testenv.Cookie(t, srv[i]) {
					t.Fatalf("round %d: pair %d client paired with a foreign server socket", r, i)
				}
				if staggered && f.Client.TxBytes > 0 && f.Server.TxBytes > 0 {
					bypassedStaggered++
				}
			}
		}
		for i := range pairs {
			conns[i].Close()
			srv[i].Close()
		}
	}
	st, _ := in.Stats()
	t.Logf("%d of %d staggered connections bypassed; %d handshakes ambiguous and left on TCP",
		bypassedStaggered, rounds, st.Counters.Ambiguous)
	// Without bypassed look-alikes this test would only prove the fallback.
	if bypassedStaggered < rounds/2 {
		t.Errorf("only %d of %d staggered connections were bypassed", bypassedStaggered, rounds)
	}
}

// boundSocket makes a TCP socket bound to ip:port, ready to connect.
func boundSocket(t *testing.T, ip string, port int) int {
	t.Helper()
	fd, err := unix.Socket(unix.AF_INET, unix.SOCK_STREAM|unix.SOCK_CLOEXEC, 0)
	if err != nil {
		t.Fatal(err)
	}
	_ = unix.SetsockoptInt(fd, unix.SOL_SOCKET, unix.SO_REUSEADDR, 1)
	sa := &unix.SockaddrInet4{Port: port}
	copy(sa.Addr[:], net.ParseIP(ip).To4())
	if err := unix.Bind(fd, sa); err != nil {
		unix.Close(fd)
		t.Fatalf("bind %s:%d: %v", ip, port, err)
	}
	return fd
}

// fileConn wraps a connected socket fd (and takes it over).
func fileConn(t *testing.T, fd int) *net.TCPConn {
	t.Helper()
	f := os.NewFile(uintptr(fd), "socket")
	defer f.Close()
	c, err := net.FileConn(f)
	if err != nil {
		t.Fatal(err)
	}
	t.Cleanup(func() { c.Close() })
	return c.(*net.TCPConn)
}
