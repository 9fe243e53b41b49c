package splice

import (
	"sync/atomic"
	"testing"
)

// BeforeMapped runs f in every join of t, after the join took the sockets'
// queued bytes and before it adds them to the map.
func BeforeMapped(t *testing.T, f func()) {
	beforeMapped = f
	t.Cleanup(func() { beforeMapped = nil })
}

// DropRepeated runs the user-space half of repeat removal on a direction
// whose ring holds the given repeats (pairs of stream position and length).
func DropRepeated(b []byte, pos uint64, repeats ...[2]uint64) (kept []byte, left int) {
	var shared spliceSpliceDir
	for i, r := range repeats {
		shared.Skips[i].Pos = r[0]
		shared.Skips[i].Len = uint32(r[1])
	}
	shared.SkipHead = uint32(len(repeats))
	d := &direction{shared: &shared}
	kept = d.dropRepeated(b, pos)
	return kept, int(shared.SkipHead - shared.SkipTail)
}

// ClaimSeen makes the verdict's count of bytes seen on a->b (arriving on a)
// claim n bytes more than arrived, as if the verdict had passed them to user
// space and they were still held in the psock's backlog; n < 0 takes the
// claim back.
func (p *Pair) ClaimSeen(n int64) { atomic.AddUint64(&p.ab.shared.State, uint64(n)) }

// Mechanisms says how the verdict runs: attached on the map (no link), and
// reading the skb by probe reads (no bpf_cast_to_kern_ctx), as the loaded
// program's configuration holds it.
func (s *Splicer) Mechanisms() (onMap, probeReads bool, err error) {
	var cfg spliceSpliceConfig
	err = s.objs.Cfg.Get(&cfg)
	return s.attach.OnMap(), cfg.ProbeReads == 1, err
}

// Mechanisms, as Splicer's.
func (s *UDPSplicer) Mechanisms() (onMap, probeReads bool, err error) {
	var cfg spliceudpSpliceUdpConfig
	err = s.objs.Cfg.Get(&cfg)
	return s.attach.OnMap(), cfg.ProbeReads == 1, err
}

// RepairWith puts socket i of the pair back into the kernel path as the
// watcher does after a refusal, with fd standing for the socket.
func (p *UDPPair) RepairWith(i, fd int) { p.repair(i, fd) }

// CloseDefault closes the process-wide Splicer of Splice, if one was
// loaded, for the leak check at the end of the tests.
func CloseDefault() {
	if defaultSplicer != nil {
		defaultSplicer.Close()
	}
}
