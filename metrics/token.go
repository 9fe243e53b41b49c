package metrics

import (
	"context"
	"crypto/subtle"
	"errors"
	"fmt"
	"net/http"
	"os"
	"strings"

	"github.com/shunt-project/shunt/internal/readlimit"
)

// The metrics name every policy rule and cgroup path (docs/SECURITY.md): a
// bearer token keeps them from local users who may reach the port.
// Prometheus sends one with `authorization: {credentials_file: ...}`.

// ReadToken reads a bearer token from path: its first line, which must not
// be empty; the file must be readable by its owner alone.
func ReadToken(path string) (string, error) {
	fi, err := os.Stat(path)
	if err != nil {
		return "", err
	}
	if fi.Mode().Perm()&0o077 != 0 {
		return "", fmt.Errorf("token file %s can be read by other users (mode %v): chmod 600 it", path, fi.Mode().Perm())
	}
	b, err := readlimit.File(context.Background(), path, 4096)
	if err != nil {
		return "", fmt.Errorf("token file %s: %w", path, err)
	}
	token, _, _ := strings.Cut(string(b), "\n")
	token = strings.TrimSpace(token)
	if token == "" {
		return "", errors.New("token file " + path + " is empty: write the token Prometheus sends")
	}
	return token, nil
}

// RequireToken serves h only to requests that carry token as a bearer
// token (Authorization: Bearer TOKEN); others get 401. An empty token
// requires nothing.
func RequireToken(h http.Handler, token string) http.Handler {
	if token == "" {
		return h
	}
	want := []byte("Bearer " + token)
	return http.HandlerFunc(func(w http.ResponseWriter, req *http.Request) {
		got := []byte(req.Header.Get("Authorization"))
		if subtle.ConstantTimeCompare(got, want) != 1 {
			w.Header().Set("WWW-Authenticate", `Bearer realm="shunt metrics"`)
			http.Error(w, "shunt metrics: a bearer token is required", http.StatusUnauthorized)
			return
		}
		h.ServeHTTP(w, req)
	})
}
