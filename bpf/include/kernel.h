/* Minimal kernel type definitions for CO-RE reads.
 *
 * Only the fields shunt reads are declared; preserve_access_index makes
 * clang emit relocations so libbpf/cilium-ebpf patch the offsets against the
 * running kernel's BTF at load time. This avoids committing a vmlinux.h.
 */
#pragma once

#include <linux/types.h>

#pragma clang attribute push(__attribute__((preserve_access_index)), apply_to = record)

struct list_head {
	struct list_head *next;
	struct list_head *prev;
};

struct sk_buff_head {
	__u32 qlen;
};

struct kernfs_node {
	__u64 id;
};

struct cgroup {
	struct kernfs_node *kn;
};

struct sock_cgroup_data {
	struct cgroup *cgroup;
};

struct sock_common {
	unsigned char skc_state;
};

struct sock {
	struct sock_common __sk_common;
	struct sock_cgroup_data sk_cgrp_data;
	void *sk_user_data;
	__u8 sk_userlocks;
	int sk_rcvbuf;
};

struct tcp_sock {
	__u32 write_seq;  /* end of what this socket's sends queued for TCP */
	__u32 copied_seq; /* end of what its reader has read from TCP */
};

/* The psock hangs off sk_user_data; only its receive queues matter to us. */
struct sk_psock {
	struct list_head ingress_msg;
	struct sk_buff_head ingress_skb;
	__u32 msg_tot_len; /* bytes queued on ingress_msg */
};

struct seq_file;

struct bpf_iter_meta {
	struct seq_file *seq;
	__u64 session_id;
	__u64 seq_num;
};

struct bpf_map;

struct bpf_iter__sockmap {
	struct bpf_iter_meta *meta;
	struct bpf_map *map;
	void *key;
	struct sock *sk;
};

struct bpf_iter__bpf_sk_storage_map {
	struct bpf_iter_meta *meta;
	struct bpf_map *map;
	struct sock *sk;
	void *value;
};

#pragma clang attribute pop

/* Low bits of sk_user_data are flags (include/net/sock.h). */
#define SK_USER_DATA_PTRMASK (~7UL)

/* sk_userlocks: the application set SO_RCVBUF (include/net/sock.h). */
#define SOCK_RCVBUF_LOCK 2

/* A pointer the verifier lets BPF keep in a map without holding a reference:
 * reads through it are fault-safe but may see a socket that is going away. */
#define __kptr_untrusted __attribute__((btf_type_tag("kptr_untrusted")))
