package bypass

//go:generate go run github.com/cilium/ebpf/cmd/bpf2go -cc clang -target bpfel -no-global-types -cflags "-O2 -g -Wall -Werror -mcpu=v3 -I/usr/include/x86_64-linux-gnu" -type sock_key -type sock_state -type flow_record -type tuple -type control_word -type config -type counter -type state_flags -type role -type guard_event -type splice_program -type splice_seen -type event_kind -type stall_found -type cgroup_traffic -type reader_port -type reader_port_seen -type brief_port -type brief_key -type shortcut -type recv_key -type recv_program bypass ../bpf/bypass.c
