package fanout

//go:generate go run github.com/cilium/ebpf/cmd/bpf2go -cc clang -target bpfel -no-global-types -cflags "-O2 -g -Wall -Werror -mcpu=v3 -I/usr/include/x86_64-linux-gnu" -type fanout_sub -type fanout_totals -type fanout_config kfanout ../bpf/fanout.c
