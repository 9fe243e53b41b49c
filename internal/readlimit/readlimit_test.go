package readlimit_test

import (
	"context"
	"errors"
	"os"
	"path/filepath"
	"strings"
	"syscall"
	"testing"
	"time"

	"github.com/shunt-project/shunt/internal/readlimit"
)

func TestWithinTheLimit(t *testing.T) {
	b, err := readlimit.All(context.Background(), strings.NewReader("scopes: []\n"), 11)
	if err != nil || string(b) != "scopes: []\n" {
		t.Fatalf("got %q, %v", b, err)
	}
}

// An endless input is refused once past the limit, not read to the end
// (`policy apply -f /dev/zero` grew to 5.8 GB in 10 s).
func TestEndlessInputRefused(t *testing.T) {
	f, err := os.Open("/dev/zero")
	if err != nil {
		t.Fatal(err)
	}
	defer f.Close()
	_, err = readlimit.All(context.Background(), f, 1<<20)
	var tl readlimit.TooLargeError
	if !errors.As(err, &tl) || tl.Limit != 1<<20 {
		t.Fatalf("reading /dev/zero: %v, want TooLargeError", err)
	}
	if !strings.Contains(err.Error(), "more than 1 MiB") {
		t.Errorf("message %q does not say the limit", err)
	}
}

// A FIFO nobody writes to blocks the open; an input nobody ends blocks the
// read: both give up when the context ends.
func TestInterruptEndsTheWait(t *testing.T) {
	fifo := filepath.Join(t.TempDir(), "fifo")
	if err := syscall.Mkfifo(fifo, 0o600); err != nil {
		t.Fatal(err)
	}
	r, w, err := os.Pipe()
	if err != nil {
		t.Fatal(err)
	}
	defer r.Close()
	defer w.Close()
	for name, read := range map[string]func(ctx context.Context) error{
		"fifo without a writer": func(ctx context.Context) error { _, err := readlimit.File(ctx, fifo, 1<<20); return err },
		"pipe never closed":     func(ctx context.Context) error { _, err := readlimit.All(ctx, r, 1<<20); return err },
	} {
		ctx, cancel := context.WithTimeout(context.Background(), 100*time.Millisecond)
		start := time.Now()
		err := read(ctx)
		cancel()
		if !errors.Is(err, context.DeadlineExceeded) {
			t.Errorf("%s: %v, want the context's error", name, err)
		}
		if took := time.Since(start); took > 2*time.Second {
			t.Errorf("%s: returned after %v", name, took)
		}
	}
}
