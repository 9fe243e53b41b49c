package bypass

import (
	"sync"

	"github.com/cilium/ebpf"
)

//go:generate go run github.com/cilium/ebpf/cmd/bpf2go -cc clang -target bpfel -no-global-types -cflags "-O2 -g -Wall -Werror -mcpu=v3 -I/usr/include/x86_64-linux-gnu" -type sock_key -type sock_state -type flow_record -type tuple -type control_word -type config -type counter -type state_flags -type role -type guard_event -type splice_program -type splice_seen -type event_kind -type stall_found -type cgroup_traffic -type reader_port -type reader_port_seen -type brief_port -type brief_key -type shortcut -type recv_key -type recv_program bypass ../bpf/bypass.c

// parsedSpec is the embedded object, parsed once a process: an install
// and each opening of one asked for it several times (9 ms each on the
// host, far more under qemu without KVM).
var parsedSpec = sync.OnceValues(loadBypass)

// newSpec is a copy of the parsed object for the caller to configure and load.
func newSpec() (*ebpf.CollectionSpec, error) {
	spec, err := parsedSpec()
	if err != nil {
		return nil, err
	}
	return spec.Copy(), nil
}
