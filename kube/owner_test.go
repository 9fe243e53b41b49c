package kube_test

import (
	"context"
	"net/http"
	"net/http/httptest"
	"testing"
	"time"

	"k8s.io/client-go/rest"

	"github.com/shunt-project/shunt/kube"
)

// What the API server answers about the agent's DaemonSet, and whether the
// agent takes it for gone (uninstalled) or there (a rollout).
func TestDaemonSetGone(t *testing.T) {
	for _, tc := range []struct {
		name    string
		code    int
		body    string
		gone    bool
		wantErr bool
	}{
		{"there", 200, `{"kind":"DaemonSet","metadata":{"name":"shunt-agent"}}`, false, false},
		{"being deleted", 200, `{"kind":"DaemonSet","metadata":{"name":"shunt-agent","deletionTimestamp":"2026-11-27T06:00:00Z"}}`, true, false},
		{"not found", 404, `{"kind":"Status","apiVersion":"v1","status":"Failure","reason":"NotFound","code":404}`, true, false},
		{"role deleted", 403, `{"kind":"Status","apiVersion":"v1","status":"Failure","reason":"Forbidden","code":403}`, true, false},
		{"account deleted", 401, `{"kind":"Status","apiVersion":"v1","status":"Failure","reason":"Unauthorized","code":401}`, true, false},
		{"server trouble", 503, `{"kind":"Status","apiVersion":"v1","status":"Failure","reason":"ServiceUnavailable","code":503}`, false, true},
	} {
		t.Run(tc.name, func(t *testing.T) {
			var path string
			srv := httptest.NewServer(http.HandlerFunc(func(w http.ResponseWriter, r *http.Request) {
				path = r.URL.Path
				w.Header().Set("Content-Type", "application/json")
				w.WriteHeader(tc.code)
				w.Write([]byte(tc.body))
			}))
			defer srv.Close()
			gone, err := kube.DaemonSetGone(&rest.Config{Host: srv.URL}, "shunt-system", "shunt-agent")
			if err != nil {
				t.Fatal(err)
			}
			ctx, cancel := context.WithTimeout(context.Background(), 10*time.Second)
			defer cancel()
			got, err := gone(ctx)
			if got != tc.gone || (err != nil) != tc.wantErr {
				t.Errorf("gone %v, err %v; want %v, error %v", got, err, tc.gone, tc.wantErr)
			}
			if path != "/apis/apps/v1/namespaces/shunt-system/daemonsets/shunt-agent" {
				t.Errorf("asked for %s", path)
			}
		})
	}
}
