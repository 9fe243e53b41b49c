package bypass

import (
	"bytes"
	"encoding/binary"
	"fmt"
	"net/netip"
	"sort"
	"time"

	"github.com/shunt-project/shunt/host"
)

// Endpoint is one socket of a bypassed connection.
type Endpoint struct {
	Addr        netip.AddrPort `json:"addr"` // this socket's own address and port
	Netns       uint64         `json:"netns"`
	NetnsName   string         `json:"netns_name,omitempty"` // network namespace cookie (SO_NETNS_COOKIE)
	Cgroup      string         `json:"cgroup"`               // cgroup v2 path of the socket ("" if removed)
	Cookie      uint64         `json:"cookie"`               // socket cookie (SO_COOKIE)
	TCPState    string         `json:"tcp_state"`            // e.g. ESTABLISHED, CLOSE_WAIT
	TxBytes     uint64         `json:"tx_bytes"`             // bytes this socket sent by redirect
	TxMsgs      uint64         `json:"tx_msgs"`              // sendmsg calls redirected
	TCPMsgs     uint64         `json:"tcp_msgs"`             // sendmsg calls that took the TCP path
	Redirecting bool           `json:"redirecting"`          // false once this direction fell back to TCP
	Throttled   bool           `json:"throttled"`            // fell back because the peer's reader fell behind
	Reader      Reader         `json:"reader"`               // how this socket's reader reads, as far as seen
}

// Reader says how a socket's reader has been seen reading. Only recv/read
// (recvmsg) see redirected bytes, so its peer redirects to it only once it is
// ReaderRecv.
type Reader string

const (
	ReaderUnseen Reader = "unseen" // no recvmsg yet (perhaps a splice(2) reader): the peer's sends take TCP
	ReaderRecv   Reader = "recv"   // reads with non-blocking recv/read: the peer's sends may be redirected
	ReaderTCP    Reader = "tcp"    // blocks in recv or asked for MSG_WAITALL: the connection goes back to TCP
)

func readerOf(flags uint32) Reader {
	switch {
	case flags&stateTCPReader != 0:
		return ReaderTCP
	case flags&stateReads != 0:
		return ReaderRecv
	}
	return ReaderUnseen
}

// Flow is a bypassed connection. Client is the side that called connect().
// A side is nil when its socket has closed or was never paired.
type Flow struct {
	Client *Endpoint `json:"client"`
	Server *Endpoint `json:"server"`
	Since  time.Time `json:"since"` // when the connection was paired
}

// Flows lists the bypassed connections on the host.
func (in *Install) Flows() ([]Flow, error) {
	recs, err := in.records()
	if err != nil {
		return nil, err
	}
	return groupFlows(recs, bootOffset(), host.NetnsNames()), nil
}

// records reads the state of every socket shunt holds.
func (in *Install) records() ([]bypassFlowRecord, error) {
	it, err := in.loadIterators()
	if err != nil {
		return nil, err
	}
	defer it.Close()
	buf, err := runIter(it.Flows)
	if err != nil {
		return nil, fmt.Errorf("read flows: %w", err)
	}
	recs, err := decodeRecords(buf)
	if err != nil {
		return nil, err
	}
	// A socket open in several processes is reported once per process.
	seen := map[uint64]bool{}
	out := recs[:0]
	for _, r := range recs {
		if !seen[r.Cookie] {
			seen[r.Cookie] = true
			out = append(out, r)
		}
	}
	return out, nil
}

func decodeRecords(buf []byte) ([]bypassFlowRecord, error) {
	size := binary.Size(bypassFlowRecord{})
	if len(buf)%size != 0 {
		return nil, fmt.Errorf("read flows: %d bytes is not a whole number of %d-byte records", len(buf), size)
	}
	recs := make([]bypassFlowRecord, len(buf)/size)
	if err := binary.Read(bytes.NewReader(buf), binary.NativeEndian, recs); err != nil {
		return nil, fmt.Errorf("read flows: %w", err)
	}
	return recs, nil
}

// bootOffset converts bpf_ktime_get_ns (CLOCK_MONOTONIC) to wall time.
func bootOffset() func(uint64) time.Time {
	now := time.Now()
	mono := uint64(monotonicNow())
	return func(ns uint64) time.Time { return now.Add(-time.Duration(mono - ns)) }
}

func groupFlows(recs []bypassFlowRecord, wall func(uint64) time.Time, netns map[uint64]string) []Flow {
	cgPaths := map[uint64]string{}
	bySelf := map[bypassSockKey]*bypassFlowRecord{}
	for i := range recs {
		bySelf[recs[i].State.Self] = &recs[i]
	}
	done := map[bypassSockKey]bool{}
	flows := []Flow{}
	for i := range recs {
		r := &recs[i]
		if done[r.State.Self] {
			continue
		}
		done[r.State.Self] = true
		f := Flow{Since: wall(r.State.CreatedNs)}
		peer := bySelf[r.State.Peer]
		if peer != nil && peer.State.Peer == r.State.Self {
			done[peer.State.Self] = true
		} else {
			peer = nil
		}
		for _, x := range []*bypassFlowRecord{r, peer} {
			if x == nil {
				continue
			}
			ep := endpoint(x, cgPaths)
			ep.NetnsName = netns[ep.Netns]
			if x.State.Self.Role == roleClient {
				f.Client = ep
			} else {
				f.Server = ep
				f.Since = wall(x.State.CreatedNs) // paired when the server joined
			}
		}
		flows = append(flows, f)
	}
	sort.Slice(flows, func(i, j int) bool { return flows[i].Since.Before(flows[j].Since) })
	return flows
}

const (
	roleClient = uint32(bypassRoleROLE_CLIENT)
	roleServer = uint32(bypassRoleROLE_SERVER)
)

func endpoint(r *bypassFlowRecord, cgPaths map[uint64]string) *Endpoint {
	addr, _ := r.State.Self.addrs()
	path, ok := cgPaths[r.CgroupId]
	if !ok {
		path = host.CgroupPathByID(r.CgroupId)
		cgPaths[r.CgroupId] = path
	}
	return &Endpoint{
		Addr:        addr,
		Netns:       r.State.Self.Netns,
		Cgroup:      path,
		Cookie:      r.Cookie,
		TCPState:    tcpStateName(r.TcpState),
		TxBytes:     r.State.TxBytes,
		TxMsgs:      r.State.TxMsgs,
		TCPMsgs:     r.State.PassMsgs,
		Redirecting: r.State.Flags&stateFallback == 0,
		Throttled:   r.State.Flags&stateThrottled != 0,
		Reader:      readerOf(r.State.Flags),
	}
}

// addrs is the socket's own address and its peer's.
func (k bypassSockKey) addrs() (local, remote netip.AddrPort) {
	t := k.Tuple
	client := netip.AddrPortFrom(netip.AddrFrom16(t.ClientIp).Unmap(), t.ClientPort)
	server := netip.AddrPortFrom(netip.AddrFrom16(t.ServerIp).Unmap(), t.ServerPort)
	if k.Role == roleClient {
		return client, server
	}
	return server, client
}

const (
	stateFallback  = uint32(bypassStateFlagsSTATE_FALLBACK)
	stateThrottled = uint32(bypassStateFlagsSTATE_THROTTLED)
	stateReads     = uint32(bypassStateFlagsSTATE_READS)
	stateTCPReader = uint32(bypassStateFlagsSTATE_TCP_READER)
)

var tcpStates = []string{"", "ESTABLISHED", "SYN_SENT", "SYN_RECV", "FIN_WAIT1", "FIN_WAIT2",
	"TIME_WAIT", "CLOSE", "CLOSE_WAIT", "LAST_ACK", "LISTEN", "CLOSING", "NEW_SYN_RECV"}

func tcpStateName(s uint32) string {
	if int(s) < len(tcpStates) && s > 0 {
		return tcpStates[s]
	}
	return fmt.Sprintf("STATE_%d", s)
}
