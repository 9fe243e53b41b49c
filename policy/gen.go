package policy

//go:generate go run github.com/cilium/ebpf/cmd/bpf2go -cc clang -target bpfel -no-global-types -cflags "-O2 -g -Wall -Werror -mcpu=v3 -I/usr/include/x86_64-linux-gnu" -type policy_key -type policy_entry -type policy_list -type policy_scope_key -type policy_scope -type policy_counter -type policy_swept -type policy_rule_key -type policy_rule_info -type policy_config -type policy_action -type policy_dir -type policy_state_key -type policy_peer_key -type policy_flow -type policy_sender policy ../bpf/policy.c
