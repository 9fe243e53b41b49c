// Package kecho is an echo server that runs entirely in the kernel: an
// sk_skb verdict sends every received byte back out of the same socket. It
// exists to measure kernel redirection against user-space echo loops.
package kecho

//go:generate go run github.com/cilium/ebpf/cmd/bpf2go -cc clang -target bpfel -cflags "-O2 -g -Wall -Werror -mcpu=v3 -I/usr/include/x86_64-linux-gnu" echo ../../bpf/echo.c

import (
	"fmt"

	"github.com/cilium/ebpf"
	"github.com/cilium/ebpf/link"
	"golang.org/x/sys/unix"
)

// Echo holds the sockets being echoed. Nothing is pinned: it lives as long
// as the process holds it.
type Echo struct {
	objs echoObjects
	link link.Link
}

// New loads the echo program and attaches it to its socket map.
func New() (*Echo, error) {
	e := &Echo{}
	if err := loadEchoObjects(&e.objs, nil); err != nil {
		return nil, fmt.Errorf("load echo program: %w", err)
	}
	l, err := link.AttachRawLink(link.RawLinkOptions{
		Target:  e.objs.EchoSocks.FD(),
		Program: e.objs.EchoVerdict,
		Attach:  ebpf.AttachSkSKBVerdict,
	})
	if err != nil {
		e.objs.Close()
		return nil, fmt.Errorf("attach echo verdict: %w", err)
	}
	e.link = l
	return e, nil
}

// Add makes the kernel echo everything fd receives from now on.
func (e *Echo) Add(fd int) error {
	cookie, err := unix.GetsockoptUint64(fd, unix.SOL_SOCKET, unix.SO_COOKIE)
	if err != nil {
		return fmt.Errorf("SO_COOKIE: %w", err)
	}
	if err := e.objs.EchoSocks.Update(cookie, uint64(fd), ebpf.UpdateNoExist); err != nil {
		return fmt.Errorf("add socket to echo map: %w", err)
	}
	return nil
}

// Remove stops echoing fd. Bytes the kernel has queued for it are dropped.
func (e *Echo) Remove(fd int) error {
	cookie, err := unix.GetsockoptUint64(fd, unix.SOL_SOCKET, unix.SO_COOKIE)
	if err != nil {
		return err
	}
	return e.objs.EchoSocks.Delete(cookie)
}

// Close detaches the program; sockets leave the map when it is freed.
func (e *Echo) Close() error {
	e.link.Close()
	return e.objs.Close()
}
