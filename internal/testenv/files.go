package testenv

import (
	"testing"

	"golang.org/x/sys/unix"
)

// MustOpenFiles opens n more descriptors (of /dev/null) in the test's
// process, closed when the test ends: a process with many open files, as a
// busy server is.
func MustOpenFiles(t testing.TB, n int) {
	t.Helper()
	files := make([]int, 0, n)
	t.Cleanup(func() {
		for _, fd := range files {
			unix.Close(fd)
		}
	})
	for range n {
		fd, err := unix.Open("/dev/null", unix.O_RDONLY|unix.O_CLOEXEC, 0)
		if err != nil {
			t.Fatalf("open descriptor %d of %d: %v", len(files)+1, n, err)
		}
		files = append(files, fd)
	}
}
