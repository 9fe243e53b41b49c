package daemon_test

import (
	"net"
	"path/filepath"
	"testing"
	"time"

	"golang.org/x/sys/unix"

	"github.com/shunt-project/shunt/internal/testenv"
)

// A unix stream socket joined with a TCP one through the daemon (a sidecar's
// unix socket to its application, and its TCP connection out) keeps moving
// every byte across a take-over, and ends with an event.
func TestTakeOverUnixTCP(t *testing.T) {
	testenv.RequireRoot(t)
	path := filepath.Join(t.TempDir(), "shunt.sock")
	old, oldDone := startOldDaemon(t, path)
	cl := mustClient(t, path)

	app, ours := testenv.UnixPair(t, unix.SOCK_STREAM)
	side := testenv.Side{NS: testenv.MustNetNS(t)}
	back, server := testenv.ConnPair(t, "tcp4", side, "127.0.0.1:0", side, "127.0.0.1:0")
	h, err := cl.Join(ours, back)
	if err != nil {
		t.Fatal(err)
	}
	ours.Close()
	back.Close()
	if st, err := cl.Stats(); err != nil || len(st) != 1 || st[0].Proto != "tcp+unix" || !st[0].InKernel {
		t.Fatalf("stats %+v, %v; want one tcp+unix pair in the kernel", st, err)
	}

	up := testenv.Stream{Seed: 91, Size: 32 << 20, MaxChunk: 64 << 10}
	down := testenv.Stream{Seed: 92, Size: 64 << 20, MaxChunk: 64 << 10}
	for _, c := range []net.Conn{app, server} {
		c.SetDeadline(time.Now().Add(60 * time.Second))
	}
	errs := make(chan error, 4)
	go func() { errs <- up.WriteAndClose(app) }()
	go func() { errs <- down.WriteAndClose(server) }()
	go func() { errs <- up.Check(server, true) }()
	go func() { errs <- down.Check(app, true) }()
	time.Sleep(50 * time.Millisecond)

	takeOver(t, path, 1, oldDone)
	if err := old.Close(); err != nil {
		t.Fatal(err)
	}
	for range 4 {
		if err := <-errs; err != nil {
			t.Fatal(err)
		}
	}
	select {
	case ev := <-cl.Events():
		if ev.Event != "ended" || ev.Handle != h || ev.BytesAB != uint64(up.Size) || ev.BytesBA != uint64(down.Size) || ev.Error != "" {
			t.Fatalf("event %+v", ev)
		}
	case <-time.After(10 * time.Second):
		t.Fatal("no ended event from the new daemon")
	}
}
