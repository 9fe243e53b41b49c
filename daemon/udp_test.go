package daemon_test

import (
	"bytes"
	"net"
	"path/filepath"
	"strings"
	"syscall"
	"testing"
	"time"

	"github.com/shunt-project/shunt/internal/testenv"
)

// A UDP pair through the daemon: datagrams cross both ways, stats name it,
// closing it reports its end to the client that joined it, and a TCP socket
// with a UDP one is refused.
func TestDaemonUDPPair(t *testing.T) {
	path := mustDaemon(t)
	cl := mustClient(t, path)
	ns := testenv.MustNetNS(t)
	client, front := testenv.UDPConnPair(t, ns, "127.0.0.1:0")
	back, server := testenv.UDPConnPair(t, ns, "127.0.0.1:0")
	h, err := cl.JoinUDP(front, back)
	if err != nil {
		t.Fatal(err)
	}
	front.Close()
	back.Close()
	buf := make([]byte, 1<<16)
	for i, ends := range [][2]*net.UDPConn{{client, server}, {server, client}, {client, server}} {
		msg := bytes.Repeat([]byte{byte(i + 1)}, 1000*(i+1))
		ends[0].Write(msg)
		ends[1].SetReadDeadline(time.Now().Add(5 * time.Second))
		if n, err := ends[1].Read(buf); err != nil || !bytes.Equal(buf[:n], msg) {
			t.Fatalf("datagram %d: %d bytes, %v", i, n, err)
		}
	}
	st, err := cl.Stats()
	if err != nil || len(st) != 1 || st[0].Proto != "udp" || st[0].DatagramsAB != 2 || st[0].DatagramsBA != 1 || st[0].BytesAB != 4000 || st[0].BytesBA != 2000 {
		t.Fatalf("stats %+v, %v", st, err)
	}
	if err := cl.Abort(h); err != nil {
		t.Fatal(err)
	}
	select {
	case ev := <-cl.Events():
		if ev.Event != "ended" || ev.Handle != h || ev.Proto != "udp" || ev.DatagramsAB != 2 {
			t.Fatalf("event %+v", ev)
		}
	case <-time.After(5 * time.Second):
		t.Fatal("no ended event")
	}
	client.Write([]byte("after"))
	server.SetReadDeadline(time.Now().Add(100 * time.Millisecond))
	if _, err := server.Read(buf); err == nil {
		t.Error("a datagram crossed a closed pair")
	}

	_, tcpFront, _, _ := sockets(t, ns)
	_, udpFront := testenv.UDPConnPair(t, ns, "127.0.0.1:0")
	if _, err := cl.JoinFDs(connFD(tcpFront), connFD(udpFront)); err == nil || !strings.Contains(err.Error(), "two of a kind") {
		t.Errorf("TCP with UDP: %v", err)
	}
}

// connFD is the descriptor behind a connection (still owned by it).
func connFD(c syscall.Conn) int {
	raw, _ := c.SyscallConn()
	fd := -1
	raw.Control(func(f uintptr) { fd = int(f) })
	return fd
}

// A take-over keeps UDP pairs forwarding, with their counters, and the
// joining client can still close its pair and hear of it.
func TestTakeOverUDP(t *testing.T) {
	testenv.RequireRoot(t)
	path := filepath.Join(t.TempDir(), "shunt.sock")
	old, oldDone := startOldDaemon(t, path)
	cl := mustClient(t, path)
	ns := testenv.MustNetNS(t)
	client, front := testenv.UDPConnPair(t, ns, "127.0.0.1:0")
	back, server := testenv.UDPConnPair(t, ns, "127.0.0.1:0")
	h, err := cl.JoinUDP(front, back)
	if err != nil {
		t.Fatal(err)
	}
	front.Close()
	back.Close()
	buf := make([]byte, 64)
	cross := func(msg string) {
		t.Helper()
		client.Write([]byte(msg))
		server.SetReadDeadline(time.Now().Add(5 * time.Second))
		if n, err := server.Read(buf); err != nil || string(buf[:n]) != msg {
			t.Fatalf("%q arrived as %q, %v", msg, buf[:n], err)
		}
	}
	cross("before")

	takeOver(t, path, 1, oldDone)
	if err := old.Close(); err != nil {
		t.Fatal(err)
	}
	cross("after")
	st, err := cl.Stats()
	if err != nil || len(st) != 1 || st[0].Handle != h || st[0].Proto != "udp" || st[0].DatagramsAB != 2 {
		t.Fatalf("stats after the take-over %+v, %v", st, err)
	}
	if err := cl.Abort(h); err != nil {
		t.Fatal(err)
	}
	select {
	case ev := <-cl.Events():
		if ev.Handle != h || ev.DatagramsAB != 2 {
			t.Fatalf("event %+v", ev)
		}
	case <-time.After(5 * time.Second):
		t.Fatal("no ended event")
	}
}
