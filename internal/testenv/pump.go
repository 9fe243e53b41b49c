package testenv

import "net"

// Pump copies src to dst with read and write until src ends, then closes
// dst's writing side. Not io.Copy: between two TCP connections it splices
// (2), which bypass keeps on TCP (and learns the program as a splicer).
func Pump(dst, src net.Conn) {
	defer func() {
		if tc, ok := dst.(*net.TCPConn); ok {
			_ = tc.CloseWrite()
		}
	}()
	b := make([]byte, 64<<10)
	for {
		n, err := src.Read(b)
		if n > 0 {
			if _, werr := dst.Write(b[:n]); werr != nil {
				return
			}
		}
		if err != nil {
			return
		}
	}
}

// Serve runs handle on each connection ln accepts, each in a goroutine of
// its own, and closes the connection after it; until ln is closed.
func Serve(ln *net.TCPListener, handle func(c *net.TCPConn)) {
	go func() {
		for {
			c, err := ln.AcceptTCP()
			if err != nil {
				return
			}
			go func() {
				defer c.Close()
				handle(c)
			}()
		}
	}()
}

// EchoServer answers every connection ln accepts with what it sends (Pump),
// until ln is closed.
func EchoServer(ln *net.TCPListener) { Serve(ln, func(c *net.TCPConn) { Pump(c, c) }) }
