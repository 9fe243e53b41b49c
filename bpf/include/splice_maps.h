/* Maps of the splice programs (bpf/splice.c), shared with Go through bpf2go. */
#pragma once

#include <linux/bpf.h>
#include <bpf/bpf_helpers.h>

/* Bit DIR_USER_BIT of splice_dir.state: this direction's bytes go to user
 * space. An enum so bpf2go hands the bit to Go (clang 14 emits no 64-bit
 * enums, hence the bit number rather than the mask). */
enum splice_state_bits {
	DIR_USER_BIT = 63,
};
#define DIR_USER (1ULL << DIR_USER_BIT)

/* Bytes user space must drop: the verdict saw them twice (see splice.c). */
#define SKIP_RING 8
struct skip {
	__u64 pos; /* where they start, counted like splice_dir.state */
	__u32 len;
	__u32 _pad;
};

/* One direction of a joined pair: bytes arriving on a socket and leaving
 * through its peer. User space reads and changes `state` and `skip_tail`
 * through a shared mapping with atomic operations; every other field is
 * written by the verdict alone (it runs under the receiving socket's lock,
 * one skb at a time). */
struct splice_dir {
	__u64 state;        /* DIR_USER | bytes the verdict has seen (wraps at 2^63) */
	__u64 redirected;   /* bytes the kernel sent on to the peer, ever */
	__u32 peer;         /* slot of the socket the bytes leave through */
	__u32 base_valid;   /* 0: the next kernel verdict samples the peer's write_seq */
	__u32 base;         /* peer write_seq when kernel forwarding last began */
	__u32 period;       /* bytes redirected since base */
	__u32 max_inflight; /* cap on bytes handed to the peer and not yet acknowledged */
	__u32 to_user;      /* times flow control gave this direction to user space */
	__u32 expect;       /* sequence number of the next byte not yet seen */
	__u32 expect_valid;
	__u32 overlaps;     /* skbs that began with bytes already seen */
	__u32 broken;       /* an overlap found the skip ring full: the pair must end */
	__u32 skip_head;    /* next ring slot the verdict fills */
	__u32 skip_tail;    /* next ring slot user space reads */
	struct skip skips[SKIP_RING];
};

/* Sockets by slot. Slot 2i and 2i+1 are the two sockets of pair i. */
struct {
	__uint(type, BPF_MAP_TYPE_SOCKMAP);
	__uint(max_entries, 1 << 16);
	__type(key, __u32);
	__type(value, __u64);
} socks SEC(".maps");

/* Direction state by the receiving socket's slot; mapped into user space. */
struct {
	__uint(type, BPF_MAP_TYPE_ARRAY);
	__uint(max_entries, 1 << 16);
	__uint(map_flags, BPF_F_MMAPABLE);
	__type(key, __u32);
	__type(value, struct splice_dir);
} dirs SEC(".maps");

/* Slot of each joined socket by socket cookie (sk_skb knows only the cookie). */
struct {
	__uint(type, BPF_MAP_TYPE_HASH);
	__uint(max_entries, 1 << 16);
	__type(key, __u64);
	__type(value, __u32);
} slots SEC(".maps");
