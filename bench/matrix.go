package bench

import (
	"context"
	"fmt"
)

// Modes a scenario can compare.
const (
	ModeTCP   = "tcp"   // plain TCP
	ModeShunt = "shunt" // the same connection with shunt bypass
	ModeUnix  = "unix"  // AF_UNIX socketpair: the host-local floor
	// ModeBare is shunt's pairing with a redirect program stripped of its
	// checks and counters: shunt minus ModeBare is what the checks cost.
	ModeBare = "shunt-bare"
	// ModeTrust is shunt installed with TrustReaders: redirected from the
	// first byte, before a reader has called recv.
	ModeTrust = "shunt-trust"
	// ModePaired is shunt installed with PairBrief: every connection is
	// paired, also those to ports whose connections are brief, which the
	// default install leaves unpaired (what a pairing costs them).
	ModePaired = "shunt-pair-brief"
)

// Placements: where the two ends' threads run.
const (
	SameCPU  = "same-cpu"  // both on CPU 1
	CrossCPU = "cross-cpu" // client (sender) on CPU 0, server (receiver) on CPU 1
	// AnyCPU leaves both to the scheduler, as unpinned programs are: it
	// moves them, and a sync wake-up draws a reader to its writer's CPU.
	AnyCPU = "any-cpu"
)

// Topologies: where the two TCP sockets live.
const (
	Veth     = "veth"     // two namespaces joined by veth
	Loopback = "loopback" // one namespace, over 127.0.0.1
)

// cpusFor gives the CPU of each end; -1 for any.
func cpusFor(placement string) (client, server int) {
	switch placement {
	case SameCPU:
		return 1, 1
	case AnyCPU:
		return -1, -1
	}
	return 0, 1
}

// Matrix is what a scenario sweeps. Every cell is measured once per round,
// rounds outermost, so drift on a noisy machine hits every cell alike.
type Matrix struct {
	Rounds     int
	Sizes      []int
	Placements []string
	Modes      []string
	Topology   string
	Progress   func(string) // optional: called before each run
}

// Cell is one combination of a Matrix.
type Cell struct {
	Size      int
	Placement string
	Mode      string
}

func (c Cell) String() string { return fmt.Sprintf("%s %s %dB", c.Placement, c.Mode, c.Size) }

// Validate reports a bad matrix in one line.
func (m Matrix) Validate() error {
	if m.Rounds < 1 || len(m.Sizes) == 0 || len(m.Placements) == 0 || len(m.Modes) == 0 {
		return fmt.Errorf("need at least one round, size, placement and mode")
	}
	for _, s := range m.Sizes {
		if s < 1 || s > 64<<20 {
			return fmt.Errorf("size %d out of range (1 B .. 64 MiB)", s)
		}
	}
	if m.Topology != Veth && m.Topology != Loopback {
		return fmt.Errorf("unknown topology %q (veth or loopback)", m.Topology)
	}
	return nil
}

// cells lists the cells in reporting order: size, placement, mode.
func (m Matrix) cells() []Cell {
	var out []Cell
	for _, size := range m.Sizes {
		for _, pl := range m.Placements {
			for _, mode := range m.Modes {
				out = append(out, Cell{size, pl, mode})
			}
		}
	}
	return out
}

// run calls fn for every cell of every round.
func (m Matrix) run(ctx context.Context, fn func(Cell) error) error {
	for r := 0; r < m.Rounds; r++ {
		for _, c := range m.cells() {
			if err := ctx.Err(); err != nil {
				return err
			}
			if m.Progress != nil {
				m.Progress(fmt.Sprintf("round %d/%d %s", r+1, m.Rounds, c))
			}
			if err := fn(c); err != nil {
				return fmt.Errorf("%s: %w", c, err)
			}
		}
	}
	return nil
}
