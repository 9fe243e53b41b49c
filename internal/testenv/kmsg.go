package testenv

import (
	"strings"
	"testing"

	"golang.org/x/sys/unix"
)

// WatchKernelLog fails the test if the kernel logs a warning, bug or splat
// while it runs (e.g. "TCP recvmsg seq # bug", a WARNING from sockmap code).
func WatchKernelLog(t testing.TB) {
	t.Helper()
	fd, err := unix.Open("/dev/kmsg", unix.O_RDONLY|unix.O_NONBLOCK|unix.O_CLOEXEC, 0)
	if err != nil {
		t.Fatalf("open /dev/kmsg: %v", err)
	}
	if _, err := unix.Seek(fd, 0, unix.SEEK_END); err != nil {
		unix.Close(fd)
		t.Fatalf("seek /dev/kmsg: %v", err)
	}
	t.Cleanup(func() {
		defer unix.Close(fd)
		buf := make([]byte, 8192)
		for {
			n, err := unix.Read(fd, buf)
			if err == unix.EPIPE { // records overwritten: keep reading
				continue
			}
			if err != nil || n <= 0 {
				return
			}
			rec := string(buf[:n])
			msg := rec
			if i := strings.IndexByte(rec, ';'); i >= 0 {
				msg = rec[i+1:]
			}
			for _, bad := range []string{"WARNING", "BUG", "bug", "Oops", "RCU stall", "refcount_t", "leak"} {
				if strings.Contains(msg, bad) {
					t.Errorf("kernel logged during the test: %s", strings.TrimSpace(msg))
					break
				}
			}
		}
	})
}
