package proxy

import (
	"errors"
	"io"
	"net"
	"sync"
)

// result is what one connection moved, and why it ended early (if it did).
type result struct {
	up, down, kernel uint64
	throttled        uint64 // kernel mode: times flow control gave a direction to user space
	passedBy         uint64 // kernel mode: of kernel, sent straight between the peers (a shortcut)
	err              error
}

// relay copies both ways in user space until each side has sent FIN, which
// is forwarded with CloseWrite. A reset or error on either side resets both.
// withSplice lets Go move the bytes with splice(2) through a pipe;
// otherwise they go through a buffer.
func relay(client, upstream *net.TCPConn, withSplice bool) result {
	var wg sync.WaitGroup
	var once sync.Once
	var r result
	var firstErr error
	oneWay := func(dst, src *net.TCPConn, n *uint64) {
		defer wg.Done()
		var err error
		if withSplice {
			*n, err = copySplice(dst, src)
		} else {
			*n, err = copyBuffer(dst, src)
		}
		if err == nil {
			err = dst.CloseWrite()
		}
		if err != nil {
			once.Do(func() {
				firstErr = err
				abort(client, upstream)
			})
		}
	}
	wg.Add(2)
	go oneWay(upstream, client, &r.up)
	go oneWay(client, upstream, &r.down)
	wg.Wait()
	client.Close()
	upstream.Close()
	if firstErr != nil && !errors.Is(firstErr, net.ErrClosed) {
		r.err = firstErr
	} else if firstErr != nil {
		r.err = errors.New("connection reset")
	}
	return r
}

var bufPool = sync.Pool{New: func() any { b := make([]byte, 64<<10); return &b }}

// copyBuffer is a plain read/write loop (no ReaderFrom shortcuts).
func copyBuffer(dst, src *net.TCPConn) (uint64, error) {
	buf := bufPool.Get().(*[]byte)
	defer bufPool.Put(buf)
	var total uint64
	for {
		n, err := src.Read(*buf)
		if n > 0 {
			if _, werr := dst.Write((*buf)[:n]); werr != nil {
				return total, werr
			}
			total += uint64(n)
		}
		if err == io.EOF {
			return total, nil
		}
		if err != nil {
			return total, err
		}
	}
}

// copySplice uses TCPConn.ReadFrom, which on Linux moves the bytes with
// splice(2) through a pipe.
func copySplice(dst, src *net.TCPConn) (uint64, error) {
	n, err := dst.ReadFrom(src)
	return uint64(n), err
}
