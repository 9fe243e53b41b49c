package sockindex

//go:generate go run github.com/cilium/ebpf/cmd/bpf2go -cc clang -target bpfel -no-global-types -cflags "-O2 -g -Wall -Werror -mcpu=v3 -I/usr/include/x86_64-linux-gnu" -type backend -type slot_key -type backend_state -type entry -type sock_slot -type index_config -type find_ctx -type entry_flags index ../bpf/index.c
