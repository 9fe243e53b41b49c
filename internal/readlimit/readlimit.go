// Package readlimit reads the files a command is given (a ruleset, a
// configuration) with a bound on their size, and gives up when the command
// is interrupted: `-f /dev/zero` must not fill memory, and `-f -` with
// nothing on standard input, or a FIFO nobody writes to, must end on Ctrl-C.
package readlimit

import (
	"context"
	"fmt"
	"io"
	"os"
)

// TooLargeError says the input went past the limit.
type TooLargeError struct{ Limit int64 }

func (e TooLargeError) Error() string {
	return fmt.Sprintf("more than %s: not what this reads (a mistaken path, a device?)", size(e.Limit))
}

func size(n int64) string {
	if n >= 1<<20 && n%(1<<20) == 0 {
		return fmt.Sprintf("%d MiB", n>>20)
	}
	return fmt.Sprintf("%d bytes", n)
}

// All reads r to its end, refusing more than limit bytes. It returns when
// ctx ends even if a read blocks; the blocked read is abandoned (a command
// that gets ctx's error exits).
func All(ctx context.Context, r io.Reader, limit int64) ([]byte, error) {
	type result struct {
		b   []byte
		err error
	}
	done := make(chan result, 1)
	go func() {
		b, err := io.ReadAll(io.LimitReader(r, limit+1))
		if err == nil && int64(len(b)) > limit {
			b, err = nil, TooLargeError{limit}
		}
		done <- result{b, err}
	}()
	select {
	case res := <-done:
		return res.b, res.err
	case <-ctx.Done():
		return nil, ctx.Err()
	}
}

// File reads the file at path as All does; opening it may block too (a
// FIFO waits for a writer), and ctx ends that wait as well.
func File(ctx context.Context, path string, limit int64) ([]byte, error) {
	type opened struct {
		f   *os.File
		err error
	}
	ch := make(chan opened, 1)
	go func() {
		f, err := os.Open(path)
		ch <- opened{f, err}
	}()
	var o opened
	select {
	case o = <-ch:
	case <-ctx.Done():
		go func() {
			if o := <-ch; o.f != nil {
				o.f.Close()
			}
		}()
		return nil, ctx.Err()
	}
	if o.err != nil {
		return nil, o.err
	}
	defer o.f.Close()
	return All(ctx, o.f, limit)
}
