package bypass_test

import (
	"context"
	"encoding/binary"
	"errors"
	"net"
	"testing"
	"time"

	"golang.org/x/sys/unix"

	"github.com/shunt-project/shunt/bypass"
	"github.com/shunt-project/shunt/internal/testenv"
)

// setULP puts kernel TLS's upper layer on c, as OpenSSL does right before it
// hands the kernel its keys (nginx with ssl_conf_command Options KTLS).
func setULP(t *testing.T, c *net.TCPConn) (err error) {
	t.Helper()
	rawFD(t, c, func(fd int) { err = unix.SetsockoptString(fd, unix.SOL_TCP, unix.TCP_ULP, "tls") })
	return err
}

// setTLSKey gives c's TLS layer a TLS 1.2 AES-GCM-128 key for sending
// (struct tls12_crypto_info_aes_gcm_128; any key does).
func setTLSKey(t *testing.T, c *net.TCPConn) (err error) {
	t.Helper()
	const tlsTX, tls12, aesGCM128 = 1, 0x0303, 51
	info := make([]byte, 40)
	binary.NativeEndian.PutUint16(info[0:], tls12)
	binary.NativeEndian.PutUint16(info[2:], aesGCM128)
	for i := 4; i < len(info); i++ {
		info[i] = byte(i)
	}
	rawFD(t, c, func(fd int) { err = unix.SetsockoptString(fd, unix.SOL_TLS, tlsTX, string(info)) })
	return err
}

// Kernel TLS and a socket in a sockhash do not mix: the kernel refuses the
// keys of a socket with a psock, and lets the TLS layer on, whose one table
// of operations per family is rebuilt from the socket that put the layer
// on last. A bypassed socket with the layer read through plain TCP's
// recvmsg once a socket off the bypass put it on too: its redirected bytes
// were never read (6.12 under qemu: 0 of 200,000, by hand). shunt refuses
// the layer on a bypassed socket (ENOENT, as without kernel TLS), which
// programs take as "no kernel TLS here", and the connection stays bypassed.
func TestTCPULPRefusedOnBypassedSockets(t *testing.T) {
	in, cg := mustInstall(t)
	plain := testenv.Side{NS: testenv.MustNetNS(t), CG: testenv.MustCgroup(t)}
	enabled := testenv.Side{NS: testenv.MustNetNS(t), CG: cg}
	for _, fam := range loopbacks {
		t.Run(fam.network, func(t *testing.T) {
			c, s := testenv.ConnPair(t, fam.network, enabled, fam.addr, enabled, fam.addr)
			testenv.Warm(t, c, s)
			before := counters(t, in)
			sent := redirectedBytes(t, in)
			if err := setULP(t, s); !errors.Is(err, unix.ENOENT) {
				t.Fatalf("TCP_ULP on a bypassed socket: %v, want ENOENT", err)
			}
			if got := counters(t, in).ULPRefused - before.ULPRefused; got != 1 {
				t.Errorf("ulp_refused went up by %d, want 1", got)
			}
			// Off the bypass (a cgroup not enabled), kernel TLS is the
			// kernel's: where it has TLS (not the host's 6.18, which has no
			// CONFIG_TLS), the layer and a key go on, and the layer's table
			// is rebuilt from plain TCP as it would have been under the
			// bypassed socket.
			pc, ps := testenv.ConnPair(t, fam.network, plain, fam.addr, plain, fam.addr)
			testenv.Warm(t, pc, ps)
			switch err := setULP(t, ps); {
			case errors.Is(err, unix.ENOENT):
				t.Log("this kernel has no kernel TLS: only the refusal is checked")
			case err != nil:
				t.Fatalf("TCP_ULP off the bypass: %v", err)
			default:
				if err := setTLSKey(t, ps); err != nil {
					t.Fatalf("TLS key off the bypass: %v", err)
				}
			}
			// A reader blind to its psock waits here until the deadline.
			deadline := time.Now().Add(10 * time.Second)
			c.SetDeadline(deadline)
			s.SetDeadline(deadline)
			streamBothWays(t, c, s, 4<<20)
			if redirectedBytes(t, in) == sent {
				t.Error("nothing redirected after the refusal: the connection left the bypass")
			}
		})
	}
}

// redirectedBytes is how many bytes the install has redirected so far.
func redirectedBytes(t *testing.T, in *bypass.Install) uint64 {
	t.Helper()
	tot, err := in.Totals()
	if err != nil {
		t.Fatal(err)
	}
	return tot.RedirectedBytes
}

// Two MPTCP ends talk over subflows, TCP sockets that carry an upper layer
// protocol from their first moment. The kernel gives no psock to such a
// socket: the connection stays on TCP, counted as such (it was an insert
// failure in the counts before), and carries its streams whole.
func TestMPTCPStaysOnTCP(t *testing.T) {
	in, cg := mustInstall(t)
	side := testenv.Side{NS: testenv.MustNetNS(t), CG: cg}
	for _, fam := range loopbacks {
		t.Run(fam.network, func(t *testing.T) {
			var lc net.ListenConfig
			lc.SetMultipathTCP(true)
			var ln net.Listener
			var err error
			side.Make(t, func() { ln, err = lc.Listen(context.Background(), fam.network, fam.addr) })
			if err != nil {
				t.Fatal(err)
			}
			defer ln.Close()
			d := net.Dialer{Timeout: 5 * time.Second}
			d.SetMultipathTCP(true)
			before := counters(t, in)
			var cc net.Conn
			side.Make(t, func() { cc, err = d.Dial(fam.network, ln.Addr().String()) })
			if err != nil {
				t.Fatal(err)
			}
			c := cc.(*net.TCPConn)
			defer c.Close()
			sc, err := ln.Accept()
			if err != nil {
				t.Fatal(err)
			}
			s := sc.(*net.TCPConn)
			defer s.Close()
			if mp, err := c.MultipathTCP(); err != nil || !mp {
				t.Skipf("this kernel made a plain TCP connection (MPTCP %v, %v)", mp, err)
			}
			deadline := time.Now().Add(10 * time.Second)
			c.SetDeadline(deadline)
			s.SetDeadline(deadline)
			streamBothWays(t, c, s, 2<<20)
			after := counters(t, in)
			if got := after.UpperLayer - before.UpperLayer; got != 1 {
				t.Errorf("connections_upper_layer went up by %d, want 1", got)
			}
			if after.InsertFailed != before.InsertFailed || after.Paired != before.Paired {
				t.Errorf("insert failures %d -> %d, paired %d -> %d: want both unchanged", before.InsertFailed, after.InsertFailed, before.Paired, after.Paired)
			}
		})
	}
}
