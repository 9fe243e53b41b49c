package guard

import (
	"errors"
	"fmt"
	"os"
	"path/filepath"
	"strconv"

	"golang.org/x/sys/unix"
)

// Wake makes the reader of a socket look at it again. The socket is taken
// from the process that reads it (pidfd_getfd; needs ptrace rights over it,
// which root has) and given its own SO_RCVLOWAT and TCP_NOTSENT_LOWAT back:
// the first runs tcp_data_ready (an EPOLLIN edge when TCP holds bytes for
// the reader), the second the socket's write_space (an edge for a reader
// that polls for EPOLLOUT too, which then sees redirected bytes readable).
// Neither changes what the socket does. No BPF program can wake a reader:
// this is why the guard runs. fd is where the reader last read it (-1:
// unknown), tried first; else ino names the socket ("socket:[ino]" in
// /proc/PID/fd), a walk of every descriptor of the process (20 ms with
// 5,000: BenchmarkWake). cookie makes sure a descriptor is that socket. A
// process or socket gone already: os.ErrNotExist.
func Wake(pid, fd int, ino, cookie uint64) error {
	pidfd, err := unix.PidfdOpen(pid, 0)
	if err != nil {
		if errors.Is(err, unix.ESRCH) {
			return os.ErrNotExist
		}
		return fmt.Errorf("pidfd_open %d: %w", pid, err)
	}
	defer unix.Close(pidfd)
	if fd >= 0 {
		if s, ok := take(pidfd, fd, cookie); ok {
			defer unix.Close(s)
			return poke(s)
		}
	}
	fds, err := socketFDs(pid, ino)
	if err != nil {
		return err
	}
	for _, fd := range fds {
		if s, ok := take(pidfd, fd, cookie); ok {
			defer unix.Close(s)
			return poke(s)
		}
	}
	return os.ErrNotExist
}

// take duplicates descriptor fd of the process if it is the socket with the
// cookie (not closed since, nor reused for another).
func take(pidfd, fd int, cookie uint64) (int, bool) {
	s, err := unix.PidfdGetfd(pidfd, fd, 0)
	if err != nil {
		return -1, false // closed since, or not ours to take
	}
	c, err := unix.GetsockoptUint64(s, unix.SOL_SOCKET, unix.SO_COOKIE)
	if err != nil || c != cookie {
		unix.Close(s)
		return -1, false
	}
	return s, true
}

// poke sets two options of the socket to the values they have.
func poke(s int) error {
	lowat, err := unix.GetsockoptInt(s, unix.SOL_SOCKET, unix.SO_RCVLOWAT)
	if err != nil {
		return fmt.Errorf("read SO_RCVLOWAT: %w", err)
	}
	if err := unix.SetsockoptInt(s, unix.SOL_SOCKET, unix.SO_RCVLOWAT, lowat); err != nil {
		return fmt.Errorf("set SO_RCVLOWAT: %w", err)
	}
	notsent, err := unix.GetsockoptInt(s, unix.IPPROTO_TCP, unix.TCP_NOTSENT_LOWAT)
	if err != nil {
		return fmt.Errorf("read TCP_NOTSENT_LOWAT: %w", err)
	}
	if err := unix.SetsockoptInt(s, unix.IPPROTO_TCP, unix.TCP_NOTSENT_LOWAT, notsent); err != nil {
		return fmt.Errorf("set TCP_NOTSENT_LOWAT: %w", err)
	}
	return nil
}

// socketFDs lists the descriptors of pid that hold the socket with inode
// ino, or every socket descriptor when ino is 0 (unknown).
func socketFDs(pid int, ino uint64) ([]int, error) {
	dir := filepath.Join("/proc", strconv.Itoa(pid), "fd")
	ents, err := os.ReadDir(dir)
	if err != nil {
		if errors.Is(err, os.ErrNotExist) {
			return nil, os.ErrNotExist
		}
		return nil, err
	}
	want := "socket:[" + strconv.FormatUint(ino, 10) + "]"
	var fds []int
	for _, e := range ents {
		fd, err := strconv.Atoi(e.Name())
		if err != nil {
			continue
		}
		target, err := os.Readlink(filepath.Join(dir, e.Name()))
		if err != nil {
			continue
		}
		if target == want || (ino == 0 && len(target) > 8 && target[:8] == "socket:[") {
			fds = append(fds, fd)
		}
	}
	return fds, nil
}
