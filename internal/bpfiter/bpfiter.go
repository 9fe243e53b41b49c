// Package bpfiter runs BPF iterators.
package bpfiter

import (
	"encoding/binary"
	"io"
	"unsafe"

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

// Records splits what an iterator wrote into fixed-size records of T, the
// Go twin of the struct its program writes with bpf_seq_write.
func Records[T any](out []byte) []T {
	var zero T
	size := int(unsafe.Sizeof(zero))
	rs := make([]T, 0, len(out)/size)
	for len(out) >= size {
		var r T
		_, _ = binary.Decode(out[:size], binary.NativeEndian, &r)
		out = out[size:]
		rs = append(rs, r)
	}
	return rs
}
