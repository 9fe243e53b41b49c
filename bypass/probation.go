package bypass

import (
	"cmp"
	"fmt"
	"slices"
	"strings"
	"time"
)

// NewProgram is a program the install met reading its connections of one
// role: until one of those readers (its probe) has read ProbationReads
// times without splicing, or ProbationTime passed since the first probe
// began and the probe read ProbationTimeReads times, all its readers of
// that role read by TCP (Counters.ReaderHeld).
type NewProgram struct {
	Command string    `json:"command"` // its process's command name (comm)
	Role    string    `json:"role"`    // "accepted" or "connected": a proxy's two sides are on probation apart
	Since   time.Time `json:"since"`   // when its first probe began
	// Admitted: its readers take redirected bytes. A program whose time ran
	// out and whose probe read twice is admitted at its next read.
	Admitted   bool   `json:"admitted"`
	ProbeReads uint32 `json:"probe_reads"`  // what its probe read so far (of ProbationReads)
	Held       uint64 `json:"readers_held"` // its readers that read by TCP meanwhile, the probes too
}

// NewPrograms lists the programs the install met reading, those on
// probation first. Empty for an install made before the probation.
func (in *Install) NewPrograms() ([]NewProgram, error) {
	out := []NewProgram{}
	if _, ok := in.maps[recvProgramsMap]; !ok {
		return out, nil
	}
	cfg, err := in.config()
	if err != nil {
		return nil, fmt.Errorf("read install options: %w", err)
	}
	wall := bootOffset()
	now := time.Now()
	err = eachEntry(in, recvProgramsMap, func(k *bypassRecvKey, v *bypassRecvProgram) {
		out = append(out, NewProgram{Command: commString(k.Comm), Role: roleName(k.Role), Since: wall(v.SinceNs),
			Admitted: v.Proven != 0 ||
				now.Sub(wall(v.SinceNs)) > time.Duration(cfg.ProbationNs) && v.Reads >= cfg.ProbationTimeReads,
			ProbeReads: v.Reads, Held: v.Held})
	})
	if err != nil {
		return nil, err
	}
	slices.SortFunc(out, func(a, b NewProgram) int {
		if a.Admitted != b.Admitted {
			if a.Admitted {
				return 1
			}
			return -1
		}
		return cmp.Or(strings.Compare(a.Command, b.Command), strings.Compare(a.Role, b.Role))
	})
	return out, nil
}

func roleName(r uint32) string {
	switch bypassRole(r) {
	case bypassRoleROLE_SERVER:
		return "accepted"
	case bypassRoleROLE_CLIENT:
		return "connected"
	}
	return fmt.Sprintf("role %d", r)
}
