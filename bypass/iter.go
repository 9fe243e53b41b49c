package bypass

import (
	"bytes"
	"errors"
	"fmt"
	"io"
	"os"
	"unsafe"

	"github.com/cilium/ebpf"
	"github.com/cilium/ebpf/link"
	"golang.org/x/sys/unix"
)

// runIter runs one pass of an iterator over every open file on the host
// and returns what it wrote.
func runIter(prog *ebpf.Program) ([]byte, error) {
	l, err := link.AttachIter(link.IterOptions{Program: prog})
	if err != nil {
		return nil, err
	}
	defer l.Close()
	r, err := l.Open()
	if err != nil {
		return nil, err
	}
	defer r.Close()
	return readAll(r)
}

// runIterIn runs one pass of an iter/task_file program over the open files
// of one process: the kernel's task iterators take a pid (6.1), which the
// iterator links of cilium/ebpf do not pass, so the link is made here.
func runIterIn(prog *ebpf.Program, pid int) ([]byte, error) {
	// union bpf_iter_link_info's task member: tid, pid, pid_fd.
	info := [3]uint32{0, uint32(pid), 0}
	// The BPF_LINK_CREATE attribute as far as an iterator's fields go;
	// iterInfo a pointer the garbage collector sees (a 64-bit field: the
	// static binary is built for 64-bit architectures only).
	attr := struct {
		progFD, targetFD, attachType, flags uint32
		iterInfo                            unsafe.Pointer
		iterInfoLen                         uint32
		_                                   uint32
	}{progFD: uint32(prog.FD()), attachType: unix.BPF_TRACE_ITER, iterInfo: unsafe.Pointer(&info), iterInfoLen: uint32(unsafe.Sizeof(info))}
	lfd, err := bpfCall(unix.BPF_LINK_CREATE, unsafe.Pointer(&attr), unsafe.Sizeof(attr))
	if err != nil {
		return nil, fmt.Errorf("create an iterator link for pid %d: %w", pid, err)
	}
	defer unix.Close(lfd)
	create := struct{ linkFD, flags uint32 }{linkFD: uint32(lfd)}
	fd, err := bpfCall(unix.BPF_ITER_CREATE, unsafe.Pointer(&create), unsafe.Sizeof(create))
	if err != nil {
		return nil, fmt.Errorf("open the iterator for pid %d: %w", pid, err)
	}
	f := os.NewFile(uintptr(fd), "bpf_iter")
	defer f.Close()
	return readAll(f)
}

// bpfCall makes the bpf(2) call cmd with attr and returns the descriptor
// it made.
func bpfCall(cmd uintptr, attr unsafe.Pointer, size uintptr) (int, error) {
	fd, _, errno := unix.Syscall(unix.SYS_BPF, cmd, uintptr(attr), size)
	if errno != 0 {
		return -1, errno
	}
	return int(fd), nil
}

func readAll(r io.Reader) ([]byte, error) {
	var b bytes.Buffer
	if _, err := io.Copy(&b, r); err != nil && !errors.Is(err, io.EOF) {
		return nil, err
	}
	return b.Bytes(), nil
}
