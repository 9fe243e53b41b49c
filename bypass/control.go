package bypass

import (
	"fmt"
	"slices"
)

// What user space changes in a running install: the drain switch (set while
// a removal waits for readers) and the ports kept on TCP.

func (in *Install) setDraining(on bool) error {
	// Keep what the programs noted there (regs_at: they only ever set it
	// from 0 to the one value this kernel has).
	var v bypassControlWord
	if err := in.maps["control"].Lookup(uint32(0), &v); err != nil {
		return fmt.Errorf("read control word: %w", err)
	}
	v.Draining = 0
	if on {
		v.Draining = 1
	}
	if err := in.maps["control"].Put(uint32(0), v); err != nil {
		return fmt.Errorf("set control word: %w", err)
	}
	return nil
}

// Draining reports whether a removal is in progress (or was interrupted).
func (in *Install) Draining() bool {
	var v bypassControlWord
	if err := in.maps["control"].Lookup(uint32(0), &v); err != nil {
		return false
	}
	return v.Draining != 0
}

// SetExcludedPorts replaces the set of server ports whose new connections
// stay on TCP. Connections already bypassed are not affected.
func (in *Install) SetExcludedPorts(ports []uint16) error {
	m := in.maps["excluded_ports"]
	old, err := in.ExcludedPorts()
	if err != nil {
		return err
	}
	keep := map[uint16]bool{}
	for _, p := range ports {
		keep[p] = true
		if err := m.Put(p, uint8(1)); err != nil {
			return fmt.Errorf("exclude port %d: %w", p, err)
		}
	}
	for _, p := range old {
		if !keep[p] {
			if err := m.Delete(p); err != nil {
				return fmt.Errorf("include port %d again: %w", p, err)
			}
		}
	}
	return nil
}

// ExcludedPorts lists the server ports whose connections stay on TCP.
func (in *Install) ExcludedPorts() ([]uint16, error) {
	var out []uint16
	var port uint16
	var v uint8
	it := in.maps["excluded_ports"].Iterate()
	for it.Next(&port, &v) {
		out = append(out, port)
	}
	if err := it.Err(); err != nil {
		return nil, fmt.Errorf("read excluded ports: %w", err)
	}
	slices.Sort(out)
	return out, nil
}
