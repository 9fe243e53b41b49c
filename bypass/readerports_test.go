package bypass_test

import (
	"net"
	"os"
	"testing"

	"github.com/shunt-project/shunt/bypass"
	"github.com/shunt-project/shunt/internal/testenv"
)

// A server whose reader blocks in recv has each connection paired and then
// taken out at its first read, which costs a short connection more than
// plain TCP (gunicorn's sync workers ran at 0.85x). Once one reader of a
// port needed TCP, the port's next connections are not paired at all, for
// bypass.ReaderPortTTL; other ports stay bypassed, and after the TTL the
// port is tried again.
func TestReaderPortKeptUnpaired(t *testing.T) {
	for _, network := range []string{"tcp4", "tcp6"} {
		t.Run(network, func(t *testing.T) {
			in, cg := mustInstall(t)
			side := testenv.Side{NS: testenv.MustNetNS(t), CG: cg}
			addr := map[string]string{"tcp4": "127.0.0.1:0", "tcp6": "[::1]:0"}[network]
			blocking := testenv.Listen(t, side, network, addr)
			polling := testenv.Listen(t, side, network, addr)
			port := uint16(blocking.Addr().(*net.TCPAddr).Port)

			// connect dials ln, exchanges a message each way with the
			// server reading as read does, and says whether shunt held
			// the connection while it was open.
			connect := func(ln *net.TCPListener, read func(s *net.TCPConn, b []byte) (int, error)) bool {
				c := testenv.Dial(t, side, network, ln.Addr().String(), nil)
				s := testenv.Accept(t, ln)
				defer c.Close()
				defer s.Close()
				held := flowOf(t, in, testenv.Cookie(t, c)) != nil
				if _, err := c.Write([]byte("ping")); err != nil {
					t.Fatal(err)
				}
				b := make([]byte, 4)
				if n, err := read(s, b); n != 4 || err != nil || string(b) != "ping" {
					t.Fatalf("server read %q, %v", b[:n], err)
				}
				exchange(t, s, c, "pong")
				return held
			}
			blockingRead := func(s *net.TCPConn, b []byte) (int, error) { return blockingReader{t, s, 0}.Read(b) }
			pollingRead := func(s *net.TCPConn, b []byte) (int, error) { return s.Read(b) }

			if !connect(blocking, blockingRead) {
				t.Fatal("the first connection to the blocking server was not paired: nothing was learned yet")
			}
			waitLeft(t, in)
			ports, err := in.ReaderPorts()
			if err != nil {
				t.Fatal(err)
			}
			if len(ports) != 1 || ports[0].Port != port || ports[0].PID == 0 {
				t.Fatalf("reader ports %+v, want port %d with the reader's pid", ports, port)
			}
			before, _ := in.Stats()
			for i := 0; i < 5; i++ {
				// Under qemu five connections can take longer than
				// the TTL: what is tested here is the port kept, not
				// the clock.
				if err := in.FreshenReaderPorts(); err != nil {
					t.Fatal(err)
				}
				if connect(blocking, blockingRead) {
					t.Errorf("connection %d to port %d was paired: its reader needed TCP a moment ago", i, port)
				}
			}
			if !connect(polling, pollingRead) {
				t.Error("a connection to another port was not paired")
			}
			after, _ := in.Stats()
			if kept := after.Counters.ReaderPort - before.Counters.ReaderPort; kept != 5 {
				t.Errorf("connections_reader_port grew by %d, want 5", kept)
			}
			if err := in.FreshenReaderPorts(); err != nil {
				t.Fatal(err)
			}
			if ports, _ := in.ReaderPorts(); len(ports) != 1 || ports[0].Kept != 5 {
				t.Errorf("reader ports %+v, want port %d with 5 kept", ports, port)
			}

			if err := in.AgeReaderPorts(bypass.ReaderPortTTL); err != nil {
				t.Fatal(err)
			}
			if ports, _ := in.ReaderPorts(); len(ports) != 0 {
				t.Errorf("reader ports %+v after the TTL, want none", ports)
			}
			if !connect(blocking, blockingRead) {
				t.Error("after the TTL the port's next connection was not paired again")
			}
		})
	}
}

// A client process that reads its connections to a port with blocking recv
// (privoxy and its upstreams) had each connection paired and then taken out
// at its first read: 0.73x of plain TCP for privoxy behind shunt. Once its
// reader needed TCP for bypass.ReaderClientStreak connections in a row, the
// connections that process makes to that port are not paired, for
// bypass.ReaderPortTTL; its connections to other ports, another process's
// connections to the port and, after the TTL, its own are. One blocking
// connection is no habit (redis-benchmark reads the server's configuration
// so before its event-loop connections), and a connection read without
// blocking ends the streak.
func TestReaderClientKeptUnpaired(t *testing.T) {
	for _, network := range []string{"tcp4", "tcp6"} {
		t.Run(network, func(t *testing.T) {
			in, cg := mustInstall(t)
			side := testenv.Side{NS: testenv.MustNetNS(t), CG: cg}
			addr := map[string]string{"tcp4": "127.0.0.1:0", "tcp6": "[::1]:0"}[network]
			upstream := testenv.Listen(t, side, network, addr)
			other := testenv.Listen(t, side, network, addr)
			port := uint16(upstream.Addr().(*net.TCPAddr).Port)

			// answer has the server write first and the client read it
			// as read does; it says whether shunt held the connection
			// while it was open.
			answer := func(ln *net.TCPListener, c *net.TCPConn, read func(c *net.TCPConn, b []byte) (int, error)) bool {
				s := testenv.Accept(t, ln)
				defer c.Close()
				defer s.Close()
				held := flowOf(t, in, testenv.Cookie(t, c)) != nil
				if _, err := s.Write([]byte("ping")); err != nil {
					t.Fatal(err)
				}
				b := make([]byte, 4)
				if n, err := read(c, b); n != 4 || err != nil || string(b) != "ping" {
					t.Fatalf("client read %q, %v", b[:n], err)
				}
				exchange(t, c, s, "pong")
				return held
			}
			dial := func(ln *net.TCPListener) *net.TCPConn {
				return testenv.Dial(t, side, network, ln.Addr().String(), nil)
			}
			child := func(ln *net.TCPListener) *net.TCPConn {
				c, _ := testenv.DialFromChild(t, side, ln.Addr().(*net.TCPAddr))
				return c
			}
			blockingRead := func(c *net.TCPConn, b []byte) (int, error) { return blockingReader{t, c, 0}.Read(b) }
			pollingRead := func(c *net.TCPConn, b []byte) (int, error) { return c.Read(b) }

			// Blocking, polling, blocking, blocking: only the last two
			// make a streak.
			for i, read := range []func(c *net.TCPConn, b []byte) (int, error){blockingRead, pollingRead, blockingRead, blockingRead} {
				// Under qemu four connections can take longer than
				// the TTL, which would start the streak again.
				if err := in.FreshenReaderPorts(); err != nil {
					t.Fatal(err)
				}
				if !answer(upstream, dial(upstream), read) {
					t.Fatalf("connection %d was not paired: no streak of %d blocking connections had been seen before it", i, bypass.ReaderClientStreak)
				}
				waitLeft(t, in)
				if i == 1 {
					if ports, _ := in.ReaderPorts(); len(ports) != 0 {
						t.Fatalf("reader ports %+v after one blocking connection: one is no habit", ports)
					}
				}
			}
			ports, err := in.ReaderPorts()
			if err != nil {
				t.Fatal(err)
			}
			if len(ports) != 1 || !ports[0].Client || ports[0].Port != port || ports[0].PID != os.Getpid() {
				t.Fatalf("reader ports %+v, want this process (pid %d) as a client of port %d, and nothing else", ports, os.Getpid(), port)
			}
			before, _ := in.Stats()
			for i := 0; i < 3; i++ {
				if err := in.FreshenReaderPorts(); err != nil {
					t.Fatal(err)
				}
				if answer(upstream, dial(upstream), blockingRead) {
					t.Errorf("connection %d to port %d was paired: this process's reader needed TCP for it a moment ago", i, port)
				}
			}
			after, _ := in.Stats()
			if kept := after.Counters.ReaderClient - before.Counters.ReaderClient; kept != 3 {
				t.Errorf("connections_reader_client grew by %d, want 3", kept)
			}
			if moved := after.Counters.ReaderPort - before.Counters.ReaderPort; moved != 0 {
				t.Errorf("connections_reader_port grew by %d: the server's port was never read blocking", moved)
			}
			if err := in.FreshenReaderPorts(); err != nil {
				t.Fatal(err)
			}
			if !answer(other, dial(other), pollingRead) {
				t.Error("this process's connection to another port was not paired")
			}
			if !answer(upstream, child(upstream), pollingRead) {
				t.Error("another process's connection to the port was not paired")
			}

			if err := in.AgeReaderPorts(bypass.ReaderPortTTL); err != nil {
				t.Fatal(err)
			}
			if !answer(upstream, dial(upstream), pollingRead) {
				t.Error("after the TTL this process's next connection to the port was not paired again")
			}
		})
	}
}
