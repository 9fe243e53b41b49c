package daemon

import (
	"encoding/json"
	"testing"
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
