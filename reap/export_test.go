package reap

// Cached is how many namespaces the Reaper holds a socket in.
func (rp *Reaper) Cached() int { return len(rp.conns) }
