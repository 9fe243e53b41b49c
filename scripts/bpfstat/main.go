// Command bpfstat prints the run time (ns) and run count, summed, of the
// loaded BPF programs of one name, as the kernel counts them while
// kernel.bpf_stats_enabled is 1 (scripts/bench-skmsg.sh polls it).
package main

import (
	"fmt"
	"os"

	"github.com/cilium/ebpf"
)

func main() {
	if len(os.Args) != 2 {
		fmt.Fprintln(os.Stderr, "usage: bpfstat PROGRAM_NAME")
		os.Exit(2)
	}
	var ns, runs uint64
	var id ebpf.ProgramID
	for {
		next, err := ebpf.ProgramGetNextID(id)
		if err != nil {
			break
		}
		id = next
		p, err := ebpf.NewProgramFromID(id)
		if err != nil {
			continue // unloaded since
		}
		if info, err := p.Info(); err == nil && info.Name == os.Args[1] {
			if st, err := p.Stats(); err == nil {
				ns += uint64(st.Runtime)
				runs += st.RunCount
			}
		}
		p.Close()
	}
	fmt.Println(ns, runs)
}
