package host

import (
	"net"
	"time"

	"github.com/cilium/ebpf"
	"github.com/cilium/ebpf/link"
	"golang.org/x/sys/unix"
)

// fionreadCountsTCP puts one end of a loopback TCP connection into a scratch
// sockhash with a pass-everything sk_msg program (attached as a link where
// linked, else to the map, as shunt attaches its own), sends it 10 bytes by
// TCP and asks FIONREAD. Kernels differ here by a fix, not by a version
// shunt can name, so it is measured. False when it cannot be measured (no
// loopback in this network namespace).
func fionreadCountsTCP(linked bool) bool {
	m, p, err := scratchSkMsg()
	if err != nil {
		return false
	}
	defer m.Close()
	defer p.Close()
	if linked {
		l, err := link.AttachRawLink(link.RawLinkOptions{Target: m.FD(), Program: p, Attach: ebpf.AttachSkMsgVerdict})
		if err != nil {
			return false
		}
		defer l.Close()
	} else {
		opts := link.RawAttachProgramOptions{Target: m.FD(), Program: p, Attach: ebpf.AttachSkMsgVerdict}
		if err := link.RawAttachProgram(opts); err != nil {
			return false
		}
		defer func() {
			_ = link.RawDetachProgram(link.RawDetachProgramOptions{Target: m.FD(), Program: p, Attach: ebpf.AttachSkMsgVerdict})
		}()
	}

	ln, err := net.ListenTCP("tcp4", &net.TCPAddr{IP: net.IPv4(127, 0, 0, 1)})
	if err != nil {
		return false
	}
	defer ln.Close()
	ln.SetDeadline(time.Now().Add(time.Second))
	c, err := net.DialTCP("tcp4", nil, ln.Addr().(*net.TCPAddr))
	if err != nil {
		return false
	}
	defer c.Close()
	s, err := ln.AcceptTCP()
	if err != nil {
		return false
	}
	defer s.Close()
	raw, err := s.SyscallConn()
	if err != nil {
		return false
	}
	queued := -1 // stays so if the socket closed under us
	_ = raw.Control(func(fd uintptr) {
		if m.Update(uint32(0), uint64(fd), ebpf.UpdateAny) != nil {
			return
		}
		// The sender is not in the sockhash: these bytes come by TCP.
		if _, err := c.Write([]byte("0123456789")); err != nil {
			return
		}
		pfd := []unix.PollFd{{Fd: int32(fd), Events: unix.POLLIN}}
		if n, err := unix.Poll(pfd, 1000); err != nil || n != 1 {
			return
		}
		queued, _ = unix.IoctlGetInt(int(fd), unix.SIOCINQ)
	})
	return queued == 10
}
