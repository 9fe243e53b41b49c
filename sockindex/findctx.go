package sockindex

import (
	"encoding/binary"
	"unsafe"
)

// findCtx is struct find_ctx as bytes. A lookup runs on the reap's critical
// path, and cilium/ebpf's reflection-based encoding of the 1.6 KB context
// cost more than the BPF program itself, so it is laid out by hand.
type findCtx struct{ buf []byte }

const findSlots = uint32(len(indexFindCtx{}.Out))

var (
	offStart   = int(unsafe.Offsetof(indexFindCtx{}.Start))
	offHigh    = int(unsafe.Offsetof(indexFindCtx{}.High))
	offPresent = int(unsafe.Offsetof(indexFindCtx{}.Present))
	offOut     = int(unsafe.Offsetof(indexFindCtx{}.Out))
	entrySize  = int(unsafe.Sizeof(indexEntry{}))
)

func newFindCtx(b *indexBackend) *findCtx {
	fc := &findCtx{buf: make([]byte, unsafe.Sizeof(indexFindCtx{}))}
	copy(fc.buf, b.Addr[:])
	binary.NativeEndian.PutUint16(fc.buf[unsafe.Offsetof(b.Port):], b.Port)
	fc.buf[unsafe.Offsetof(b.Proto)] = b.Proto
	return fc
}

func (fc *findCtx) setStart(s uint32) { binary.NativeEndian.PutUint32(fc.buf[offStart:], s) }
func (fc *findCtx) high() uint32      { return binary.NativeEndian.Uint32(fc.buf[offHigh:]) }
func (fc *findCtx) present() uint32   { return binary.NativeEndian.Uint32(fc.buf[offPresent:]) }

func (fc *findCtx) entry(i int) indexEntry {
	b := fc.buf[offOut+i*entrySize:]
	var e indexEntry
	e.Cookie = binary.NativeEndian.Uint64(b[unsafe.Offsetof(e.Cookie):])
	e.NetnsCookie = binary.NativeEndian.Uint64(b[unsafe.Offsetof(e.NetnsCookie):])
	e.SinceNs = binary.NativeEndian.Uint64(b[unsafe.Offsetof(e.SinceNs):])
	copy(e.Local[:], b[unsafe.Offsetof(e.Local):])
	e.LocalPort = binary.NativeEndian.Uint16(b[unsafe.Offsetof(e.LocalPort):])
	e.Family = b[unsafe.Offsetof(e.Family)]
	e.Flags = b[unsafe.Offsetof(e.Flags)]
	e.OwnerTgid = binary.NativeEndian.Uint32(b[unsafe.Offsetof(e.OwnerTgid):])
	return e
}
