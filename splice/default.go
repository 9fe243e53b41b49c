package splice

import (
	"net"
	"sync"
)

var (
	defaultOnce    sync.Once
	defaultSplicer *Splicer
	defaultErr     error
)

// Splice joins a and b in the kernel with a process-wide Splicer (loaded on
// first use) and returns when the pair has ended, both connections closed:
// nil after FIN each way, else why it ended (a reset, an error). It is the
// kernel's io.Copy both ways for a Go proxy's connection handler.
func Splice(a, b *net.TCPConn) error {
	defaultOnce.Do(func() { defaultSplicer, defaultErr = New(Options{}) })
	if defaultErr != nil {
		return defaultErr
	}
	p, err := defaultSplicer.Join(a, b)
	if err != nil {
		return err
	}
	<-p.Done()
	return p.Err()
}
