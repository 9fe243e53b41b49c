package reap

import (
	"encoding/binary"
	"errors"
	"fmt"
	"net/netip"
	"syscall"
	"time"

	"golang.org/x/sys/unix"

	"github.com/shunt-project/shunt/sockindex"
)

// diagConn is a NETLINK_SOCK_DIAG socket. It talks to the namespace it was
// created in, whatever thread uses it later.
type diagConn struct {
	fd  int
	seq uint32
}

const (
	reqLen     = 56 // struct inet_diag_req_v2
	diagMsgLen = 72 // struct inet_diag_msg
	nlHdrLen   = unix.SizeofNlMsghdr
)

func openDiag() (*diagConn, error) {
	fd, err := unix.Socket(unix.AF_NETLINK, unix.SOCK_RAW|unix.SOCK_CLOEXEC, unix.NETLINK_SOCK_DIAG)
	if err != nil {
		return nil, fmt.Errorf("open sock_diag socket: %w", err)
	}
	tv := unix.NsecToTimeval((2 * time.Second).Nanoseconds())
	if err := unix.SetsockoptTimeval(fd, unix.SOL_SOCKET, unix.SO_RCVTIMEO, &tv); err != nil {
		unix.Close(fd)
		return nil, err
	}
	return &diagConn{fd: fd}, nil
}

func (d *diagConn) Close() error { return unix.Close(d.fd) }

// netnsCookie says which namespace the socket talks to.
func (d *diagConn) netnsCookie() (uint64, error) {
	return unix.GetsockoptUint64(d.fd, unix.SOL_SOCKET, unix.SO_NETNS_COOKIE)
}

// diagID is struct inet_diag_sockid in host terms.
type diagID struct {
	family      int
	local       netip.AddrPort
	remote      netip.AddrPort
	cookie      uint64
	established bool // from a reply: TCP_ESTABLISHED (for UDP: connected)
}

func idOf(s sockindex.Socket) diagID {
	return diagID{family: s.Family, local: s.Local, remote: s.Remote, cookie: s.Cookie}
}

func putAddr(b []byte, family int, a netip.Addr) {
	if !a.IsValid() {
		return // a dump request names no socket: all zeros
	}
	if family == unix.AF_INET {
		a4 := a.Unmap().As4()
		copy(b, a4[:])
		return
	}
	a16 := a.As16()
	copy(b, a16[:])
}

func getAddr(b []byte, family int) netip.Addr {
	if family == unix.AF_INET {
		return netip.AddrFrom4([4]byte(b[:4]))
	}
	return netip.AddrFrom16([16]byte(b[:16])).Unmap()
}

// request encodes struct inet_diag_req_v2 for one socket.
func request(proto sockindex.Proto, id diagID) []byte {
	b := make([]byte, reqLen)
	b[0] = byte(id.family)
	b[1] = byte(proto)
	binary.NativeEndian.PutUint32(b[4:], 0xffffffff) // every state
	binary.BigEndian.PutUint16(b[8:], id.local.Port())
	binary.BigEndian.PutUint16(b[10:], id.remote.Port())
	putAddr(b[12:28], id.family, id.local.Addr())
	putAddr(b[28:44], id.family, id.remote.Addr())
	binary.NativeEndian.PutUint32(b[48:], uint32(id.cookie))
	binary.NativeEndian.PutUint32(b[52:], uint32(id.cookie>>32))
	return b
}

// parseMsg decodes struct inet_diag_msg.
func parseMsg(b []byte) (diagID, bool) {
	if len(b) < diagMsgLen {
		return diagID{}, false
	}
	fam := int(b[0])
	id := diagID{family: fam, established: b[1] == 1}
	id.local = netip.AddrPortFrom(getAddr(b[8:24], fam), binary.BigEndian.Uint16(b[4:]))
	id.remote = netip.AddrPortFrom(getAddr(b[24:40], fam), binary.BigEndian.Uint16(b[6:]))
	id.cookie = uint64(binary.NativeEndian.Uint32(b[44:])) | uint64(binary.NativeEndian.Uint32(b[48:]))<<32
	return id, true
}

// reply is the kernel's answer to one request: a socket, or an error.
type reply struct {
	id  diagID
	err error
}

// roundTrip sends every request in one sendmsg and collects one answer per
// request, in order.
func (d *diagConn) roundTrip(typ uint16, flags uint16, proto sockindex.Proto, ids []diagID) ([]reply, error) {
	if len(ids) == 0 {
		return nil, nil
	}
	first := d.seq + 1
	buf := make([]byte, 0, len(ids)*(nlHdrLen+reqLen))
	for _, id := range ids {
		d.seq++
		buf = appendMsg(buf, typ, flags, d.seq, request(proto, id))
	}
	if err := unix.Sendto(d.fd, buf, 0, &unix.SockaddrNetlink{Family: unix.AF_NETLINK}); err != nil {
		return nil, fmt.Errorf("sock_diag send: %w", err)
	}
	out := make([]reply, len(ids))
	done := make([]bool, len(ids))
	left := len(ids)
	rb := make([]byte, 1<<16)
	for left > 0 {
		msgs, err := d.receive(rb)
		if err != nil {
			return nil, err
		}
		for _, m := range msgs {
			i := int(m.Header.Seq - first)
			if i < 0 || i >= len(ids) || done[i] {
				continue
			}
			switch m.Header.Type {
			case unix.NLMSG_ERROR:
				if len(m.Data) >= 4 {
					if e := int32(binary.NativeEndian.Uint32(m.Data)); e != 0 {
						out[i].err = syscall.Errno(-e)
					}
				}
			default:
				id, ok := parseMsg(m.Data)
				if !ok {
					out[i].err = errors.New("short sock_diag reply")
				}
				out[i].id = id
			}
			done[i] = true
			left--
		}
	}
	return out, nil
}

// receive reads one datagram of replies into rb and splits it.
func (d *diagConn) receive(rb []byte) ([]syscall.NetlinkMessage, error) {
	n, _, err := unix.Recvfrom(d.fd, rb, 0)
	if err != nil {
		return nil, fmt.Errorf("sock_diag receive: %w", err)
	}
	msgs, err := syscall.ParseNetlinkMessage(rb[:n])
	if err != nil {
		return nil, fmt.Errorf("sock_diag reply: %w", err)
	}
	return msgs, nil
}

func appendMsg(buf []byte, typ, flags uint16, seq uint32, payload []byte) []byte {
	h := make([]byte, nlHdrLen)
	binary.NativeEndian.PutUint32(h[0:], uint32(nlHdrLen+len(payload)))
	binary.NativeEndian.PutUint16(h[4:], typ)
	binary.NativeEndian.PutUint16(h[6:], flags)
	binary.NativeEndian.PutUint32(h[8:], seq)
	return append(append(buf, h...), payload...)
}

// get asks for each socket by exact tuple and cookie.
func (d *diagConn) get(proto sockindex.Proto, ids []diagID) ([]reply, error) {
	if proto == sockindex.UDP {
		// udp_dump_one looks the socket up as if a packet came from src
		// to dst (the kernel's "swapped for historical reasons"), unlike
		// UDP's SOCK_DESTROY and TCP's lookups.
		swapped := make([]diagID, len(ids))
		for i, id := range ids {
			swapped[i] = id
			swapped[i].local, swapped[i].remote = id.remote, id.local
		}
		ids = swapped
	}
	return d.roundTrip(unix.SOCK_DIAG_BY_FAMILY, unix.NLM_F_REQUEST, proto, ids)
}

// destroy sends SOCK_DESTROY for each socket: TCP sockets are aborted
// (ECONNABORTED), UDP sockets get the same error on their next call.
func (d *diagConn) destroy(proto sockindex.Proto, ids []diagID) ([]reply, error) {
	return d.roundTrip(unix.SOCK_DESTROY, unix.NLM_F_REQUEST|unix.NLM_F_ACK, proto, ids)
}

// dump lists every socket of a family and protocol in the namespace. Only
// used to learn the local port of connected UDP sockets that never sent.
func (d *diagConn) dump(proto sockindex.Proto, family int) ([]diagID, error) {
	d.seq++
	seq := d.seq
	buf := appendMsg(nil, unix.SOCK_DIAG_BY_FAMILY, unix.NLM_F_REQUEST|unix.NLM_F_DUMP, seq, request(proto, diagID{family: family}))
	if err := unix.Sendto(d.fd, buf, 0, &unix.SockaddrNetlink{Family: unix.AF_NETLINK}); err != nil {
		return nil, fmt.Errorf("sock_diag dump: %w", err)
	}
	var out []diagID
	rb := make([]byte, 1<<16)
	for {
		msgs, err := d.receive(rb)
		if err != nil {
			return nil, err
		}
		for _, m := range msgs {
			if m.Header.Seq != seq {
				continue
			}
			switch m.Header.Type {
			case unix.NLMSG_DONE:
				return out, nil
			case unix.NLMSG_ERROR:
				if len(m.Data) >= 4 {
					if e := int32(binary.NativeEndian.Uint32(m.Data)); e != 0 {
						return nil, fmt.Errorf("sock_diag dump: %w", syscall.Errno(-e))
					}
				}
				return out, nil
			default:
				if id, ok := parseMsg(m.Data); ok {
					out = append(out, id)
				}
			}
		}
	}
}
