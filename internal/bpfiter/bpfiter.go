// Package bpfiter runs BPF iterators.
package bpfiter

import (
	"io"

	"github.com/cilium/ebpf/link"
)

// Read runs the iterator once and returns all it wrote. Socket iterators
// see the network namespace of the calling thread.
func Read(it *link.Iter) ([]byte, error) {
	r, err := it.Open()
	if err != nil {
		return nil, err
	}
	defer r.Close()
	return io.ReadAll(r)
}
