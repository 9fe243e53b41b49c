package metrics_test

import (
	"net/http"
	"net/http/httptest"
	"os"
	"path/filepath"
	"strings"
	"testing"

	"github.com/shunt-project/shunt/metrics"
)

func TestRequireToken(t *testing.T) {
	ok := http.HandlerFunc(func(w http.ResponseWriter, _ *http.Request) { w.Write([]byte("shunt_x 1\n")) })
	h := metrics.RequireToken(ok, "s3cret")
	for _, c := range []struct {
		auth string
		want int
	}{
		{"", http.StatusUnauthorized},
		{"Bearer wrong", http.StatusUnauthorized},
		{"Basic s3cret", http.StatusUnauthorized},
		{"Bearer s3cret", http.StatusOK},
	} {
		req := httptest.NewRequest("GET", "/metrics", nil)
		if c.auth != "" {
			req.Header.Set("Authorization", c.auth)
		}
		rec := httptest.NewRecorder()
		h.ServeHTTP(rec, req)
		if rec.Code != c.want {
			t.Errorf("Authorization %q: %d, want %d", c.auth, rec.Code, c.want)
		}
		if rec.Code != http.StatusOK && strings.Contains(rec.Body.String(), "shunt_x") {
			t.Errorf("Authorization %q: the metrics were served", c.auth)
		}
	}
	rec := httptest.NewRecorder()
	metrics.RequireToken(ok, "").ServeHTTP(rec, httptest.NewRequest("GET", "/metrics", nil))
	if rec.Code != http.StatusOK {
		t.Errorf("no token asked: %d, want 200", rec.Code)
	}
}

func TestReadToken(t *testing.T) {
	dir := t.TempDir()
	write := func(name, text string, mode os.FileMode) string {
		p := filepath.Join(dir, name)
		if err := os.WriteFile(p, []byte(text), mode); err != nil {
			t.Fatal(err)
		}
		os.Chmod(p, mode)
		return p
	}
	if tok, err := metrics.ReadToken(write("good", "s3cret\n", 0o600)); err != nil || tok != "s3cret" {
		t.Errorf("good file: %q, %v", tok, err)
	}
	for name, c := range map[string]struct {
		text string
		mode os.FileMode
		want string
	}{
		"readable by others": {"s3cret\n", 0o644, "can be read by other users (mode -rw-r--r--): chmod 600 it"},
		"empty":              {"\n", 0o600, "is empty"},
	} {
		_, err := metrics.ReadToken(write(name, c.text, c.mode))
		if err == nil || !strings.Contains(err.Error(), c.want) {
			t.Errorf("%s: %v, want %q", name, err, c.want)
		}
	}
}
