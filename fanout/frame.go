package fanout

import "encoding/binary"

// A gap marker tells a framed subscriber how many messages it lost: a
// length field of all ones (no message is that long), then the count as a
// 4-byte big-endian number.
const (
	gapU16 = 0xffff
	gapU32 = 0xffffffff
)

// appendFrame appends one message as the framing sends it.
func appendFrame(dst []byte, f Framing, msg []byte) []byte {
	switch f {
	case FramingU16:
		dst = binary.BigEndian.AppendUint16(dst, uint16(len(msg)))
	case FramingU32:
		dst = binary.BigEndian.AppendUint32(dst, uint32(len(msg)))
	}
	return append(dst, msg...)
}

func frameLen(f Framing, msg int) int {
	switch f {
	case FramingU16:
		return 2 + msg
	case FramingU32:
		return 4 + msg
	}
	return msg
}

// appendGap appends a gap marker for n lost messages.
func appendGap(dst []byte, f Framing, n uint32) []byte {
	switch f {
	case FramingU16:
		dst = binary.BigEndian.AppendUint16(dst, gapU16)
	case FramingU32:
		dst = binary.BigEndian.AppendUint32(dst, gapU32)
	default:
		return dst
	}
	return binary.BigEndian.AppendUint32(dst, n)
}

func gapLen(f Framing) int {
	switch f {
	case FramingU16:
		return 6
	case FramingU32:
		return 8
	}
	return 0
}
