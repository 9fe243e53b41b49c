package bypass_test

import (
	"net"
	"testing"
	"time"

	"golang.org/x/sys/unix"

	"github.com/shunt-project/shunt/host"
	"github.com/shunt-project/shunt/internal/testenv"
)

// A splice(2) reader sees nothing of a redirected flow (6.18), so users
// exclude the ports of such servers: their connections stay on TCP and the
// reader gets every byte, as over plain TCP. Other ports are still bypassed.
func TestExcludedPortsStayOnTCP(t *testing.T) {
	in, enabled := mustInstall(t)
	plain := testenv.MustCgroup(t)
	msg := "bytes a splice(2) reader must see"
	var got [2]transcript
	for i, cg := range []host.Cgroup{plain, enabled} {
		side := testenv.Side{NS: testenv.MustNetNS(t), CG: cg}
		ln := testenv.Listen(t, side, "tcp4", "127.0.0.1:0")
		port := uint16(ln.Addr().(*net.TCPAddr).Port)
		if err := in.SetExcludedPorts([]uint16{port, 1}); err != nil {
			t.Fatal(err)
		}
		before := counters(t, in)
		c := testenv.Dial(t, side, "tcp4", ln.Addr().String(), nil)
		s := testenv.Accept(t, ln)
		c.Write([]byte(msg))
		c.CloseWrite()
		n := spliceAll(t, s, len(msg))
		got[i].add("spliced %d of %d bytes", n, len(msg))

		// A second connection to the port: MSG_WAITALL waits for all of it.
		c2 := testenv.Dial(t, side, "tcp4", ln.Addr().String(), nil)
		s2 := testenv.Accept(t, ln)
		for _, m := range []string{"one ", "two ", "three"} {
			c2.Write([]byte(m))
			time.Sleep(5 * time.Millisecond)
		}
		rawFD(t, s2, func(fd int) {
			b := make([]byte, 13)
			n, _, err := unix.Recvfrom(fd, b, unix.MSG_WAITALL)
			got[i].add("MSG_WAITALL read %q err=%v", b[:max(n, 0)], errName(err))
		})
		if i == 1 {
			after := counters(t, in)
			if after.Paired != before.Paired || after.Excluded != before.Excluded+2 {
				t.Errorf("counters before %+v after %+v: want the connection left on TCP and counted", before, after)
			}
		}
	}
	if p, b := got[0].String(), got[1].String(); p != b {
		t.Errorf("application saw something else through shunt\n--- plain TCP:\n%s\n--- shunt:\n%s", p, b)
	}

	// The list is replaced, not added to: the port is bypassed again.
	if err := in.SetExcludedPorts([]uint16{1}); err != nil {
		t.Fatal(err)
	}
	if ports, err := in.ExcludedPorts(); err != nil || len(ports) != 1 || ports[0] != 1 {
		t.Fatalf("excluded ports %v %v, want [1]", ports, err)
	}
	side := testenv.Side{NS: testenv.MustNetNS(t), CG: enabled}
	before := counters(t, in)
	c, s := testenv.ConnPair(t, "tcp4", side, "127.0.0.1:0", side, "127.0.0.1:0")
	exchange(t, c, s, "still bypassed")
	if after := counters(t, in); after.Paired != before.Paired+1 {
		t.Errorf("a port no longer excluded was not bypassed: %+v -> %+v", before, after)
	}
}

// spliceAll moves what arrives on c into a pipe with splice(2) until want
// bytes came, EOF, or two seconds passed, and returns how many bytes it got.
func spliceAll(t *testing.T, c *net.TCPConn, want int) int {
	t.Helper()
	p := mustPipe(t)
	got := 0
	deadline := time.Now().Add(2 * time.Second)
	rawFD(t, c, func(fd int) {
		for got < want && time.Now().Before(deadline) {
			n, err := unix.Splice(fd, nil, p[1], nil, want-got, unix.SPLICE_F_NONBLOCK)
			if n > 0 {
				got += int(n)
				continue
			}
			if n == 0 && err == nil {
				return // EOF
			}
			time.Sleep(5 * time.Millisecond)
		}
	})
	return got
}
