package daemon

import (
	"bytes"
	"encoding/json"
	"os"
	"testing"
	"time"

	"golang.org/x/sys/unix"
)

// FuzzRequest: whatever a client sends on the control socket, without
// descriptors, the daemon answers with a reply that says OK or gives an
// error, and holds no pair for it.
func FuzzRequest(f *testing.F) {
	for _, seed := range []string{
		`{"op":"stats"}`, `{"op":"join"}`, `{"op":"close","handle":7}`, `{"op":"handover","version":"x"}`,
		`{"op":3}`, `[]`, `{"op":"close","handle":-1}`, `not json`, ``,
	} {
		f.Add([]byte(seed))
	}
	f.Fuzz(func(t *testing.T, b []byte) {
		srv := newServer("", nil, nil, nil)
		r := srv.handle(nil, b, nil, nil)
		if r.OK == (r.Error != "") {
			t.Fatalf("reply %+v: OK and an error, or neither", r)
		}
		if _, err := json.Marshal(r); err != nil {
			t.Fatalf("reply does not encode: %v", err)
		}
		if n := len(srv.Stats()); n != 0 {
			t.Fatalf("%d pairs after a request without descriptors", n)
		}
	})
}

// FuzzHandoverState: whatever a daemon taking over is sent (the input's
// lines, one message each, each with the descriptors its kind calls for,
// stand-ins open on a file of the test's), it receives a state or an
// error, and afterwards holds none of the descriptors it was sent once it
// has closed that state.
func FuzzHandoverState(f *testing.F) {
	for _, seed := range []string{
		`{"head":{"tcp_pairs":0,"udp_pairs":0,"clients":0}}`,
		`{"head":{"tcp_pairs":1,"udp_pairs":0,"clients":0}}` + "\n" + `{"tcp":{"info":{"handle":1},"pending_ab":3}}` + "\n" + `{"data":"YWJj"}`,
		`{"head":{"tcp_pairs":0,"udp_pairs":1,"clients":1}}` + "\n" + `{"udp":{"info":{"handle":2}}}` + "\n" + `{"client":{"client":0}}`,
		`{"head":{"tcp_pairs":0,"udp_pairs":0,"clients":2}}` + "\n" + `{"client":{"client":0}}` + "\n" + `{"ready":true}`,
		`{"error":"refused"}`,
		`{"head":{"tcp_pairs":-1,"udp_pairs":1000000,"clients":0}}`,
		"",
	} {
		f.Add([]byte(seed))
	}
	f.Fuzz(func(t *testing.T, b []byte) {
		standIn, err := os.CreateTemp(t.TempDir(), "fd")
		if err != nil {
			t.Fatal(err)
		}
		defer standIn.Close()
		give, take := seqpacketPair(t)
		defer take.Close()
		wrote := make(chan struct{})
		go func() {
			defer close(wrote)
			defer give.Close()
			for i, line := range bytes.Split(b, []byte("\n")) {
				if i == 64 {
					return
				}
				var m handoverMsg
				_ = json.Unmarshal(line, &m)
				_, n := m.kind()
				fds := make([]int, n)
				for j := range fds {
					fds[j], _ = unix.Dup(int(standIn.Fd()))
				}
				var oob []byte
				if n > 0 {
					oob = unix.UnixRights(fds...)
				}
				_, _, err := give.WriteMsgUnix(line, oob, nil)
				closeFDs(fds)
				if err != nil {
					return
				}
			}
		}()
		take.SetDeadline(time.Now().Add(2 * time.Second))
		st, err := newHandoverConn(take).recvState()
		if err == nil {
			st.close()
		}
		<-wrote
		if n := fdsOn(t, standIn.Name()); n != 1 {
			t.Fatalf("%d descriptors of the stand-in file open after recvState (%v), want the test's own", n, err)
		}
	})
}

// fdsOn counts this process's descriptors open on path.
func fdsOn(t *testing.T, path string) int {
	ents, err := os.ReadDir("/proc/self/fd")
	if err != nil {
		t.Fatal(err)
	}
	n := 0
	for _, e := range ents {
		if target, err := os.Readlink("/proc/self/fd/" + e.Name()); err == nil && target == path {
			n++
		}
	}
	return n
}
