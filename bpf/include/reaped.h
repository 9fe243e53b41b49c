/* Shared with Go (bpf2go -type reaped). */
#pragma once

#include <linux/types.h>

/* What a socket iterator reports for each socket it destroyed (or, without
 * bpf_sock_destroy, found for sock_diag to destroy). */
struct reaped {
	__u64 cookie;
	__u64 netns_cookie;
	__u8 local[16];
	__u8 remote[16];
	__u16 local_port;
	__u16 remote_port;
	__u8 family;
	__u8 proto;
	__u8 _pad[2];
	__s32 err; /* bpf_sock_destroy's result */
	__u32 _pad2;
};
