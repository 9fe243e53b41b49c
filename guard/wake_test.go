package guard_test

import (
	"os"
	"testing"

	"golang.org/x/sys/unix"

	"github.com/shunt-project/shunt/guard"
	"github.com/shunt-project/shunt/internal/testenv"
)

// BenchmarkWake prices one wake-up of a reader in a process with 5,000 more
// descriptors (nginx holding idle clients): the guard takes the socket's
// descriptor and sets two options; told where it was read ("by
// descriptor"), or finding it in /proc/PID/fd ("by walk": 20 ms, against 6 us).
func BenchmarkWake(b *testing.B) {
	testenv.RequireRoot(b)
	testenv.MustOpenFiles(b, 5000)
	c, _ := testenv.ConnPair(b, "tcp4", testenv.Side{}, "127.0.0.1:0", testenv.Side{}, "127.0.0.1:0")
	var ino, cookie uint64
	var sockFD int
	raw, err := c.SyscallConn()
	if err != nil {
		b.Fatal(err)
	}
	var ferr error
	err = raw.Control(func(u uintptr) {
		fd := int(u)
		sockFD = fd
		var st unix.Stat_t
		if ferr = unix.Fstat(fd, &st); ferr != nil {
			return
		}
		ino = st.Ino
		cookie, ferr = unix.GetsockoptUint64(fd, unix.SOL_SOCKET, unix.SO_COOKIE)
	})
	if err != nil || ferr != nil {
		b.Fatal(err, ferr)
	}
	for _, bc := range []struct {
		name string
		fd   int
	}{{"by descriptor", sockFD}, {"by walk", -1}} {
		b.Run(bc.name, func(b *testing.B) {
			for i := 0; i < b.N; i++ {
				if err := guard.Wake(os.Getpid(), bc.fd, ino, cookie); err != nil {
					b.Fatal(err)
				}
			}
		})
	}
}
