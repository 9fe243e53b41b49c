package metrics_test

import (
	"context"
	"io"
	"net"
	"net/http"
	"path/filepath"
	"strings"
	"testing"
	"time"

	"github.com/shunt-project/shunt/metrics"
)

// Serve answers /metrics, 404s elsewhere, and returns cleanly when its
// context ends.
func TestServeAnswersThenStops(t *testing.T) {
	dir := t.TempDir()
	src := metrics.Source{PinDir: filepath.Join(dir, "none"), IndexDir: filepath.Join(dir, "none-index"), Version: "test"}
	ln, err := net.Listen("tcp", "127.0.0.1:0")
	if err != nil {
		t.Fatal(err)
	}
	ctx, cancel := context.WithCancel(context.Background())
	done := make(chan error, 1)
	go func() { done <- metrics.Serve(ctx, ln, metrics.Handler(metrics.Registry(src), io.Discard)) }()

	get := func(path string) (int, string) {
		resp, err := http.Get("http://" + ln.Addr().String() + path)
		if err != nil {
			t.Fatal(err)
		}
		defer resp.Body.Close()
		b, _ := io.ReadAll(resp.Body)
		return resp.StatusCode, string(b)
	}
	code, body := get("/metrics")
	for _, want := range []string{`shunt_build_info{goversion="`, `version="test"} 1`, "shunt_bypass_enabled 0", "shunt_index_enabled 0", "go_goroutines", "process_resident_memory_bytes"} {
		if code != 200 || !strings.Contains(body, want) {
			t.Errorf("GET /metrics: %d, lacks %q", code, want)
		}
	}
	if code, _ := get("/nothing"); code != 404 {
		t.Errorf("GET /nothing: %d, want 404", code)
	}

	cancel()
	select {
	case err := <-done:
		if err != nil {
			t.Errorf("Serve after cancel: %v", err)
		}
	case <-time.After(10 * time.Second):
		t.Fatal("Serve did not return after its context ended")
	}
}
