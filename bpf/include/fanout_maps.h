/* Maps of the fan-out program (bpf/fanout.c), shared with Go through bpf2go. */
#pragma once

#include <linux/bpf.h>
#include <bpf/bpf_helpers.h>

/* Set from Go before load. */
struct fanout_config {
	__u32 framing; /* bytes of the length prefix: 0, 2 or 4 */
	__u32 queue;   /* kernel memory a subscriber's backlog may hold beyond its send buffer */
	__u32 disconnect; /* 1: a subscriber over its bound is flagged for disconnection */
	__u32 probe_reads; /* no bpf_cast_to_kern_ctx (before 6.2): bpf_probe_read_kernel */
	__u32 pacer_slot;  /* slot of the relay's own feed, which only counts */
};

/* One subscriber. Written by the verdict alone (it runs under the feed
 * socket's lock, one datagram at a time); user space zeroes it before the
 * slot is used and reads it through a shared mapping. */
struct fanout_sub {
	__u64 msgs;      /* messages handed to the subscriber's socket */
	__u64 bytes;     /* their bytes, framing and gap markers included */
	__u64 dropped;   /* messages lost to the bound */
	__u32 base;      /* subscriber's write_seq before the first message */
	__u32 base_valid;
	__u32 handed;    /* bytes handed over since base (wraps with the sequence space) */
	__u32 gap;       /* messages lost since the last gap marker */
	__u32 slow;      /* 1: over the bound under the disconnect policy */
	__u32 failed;    /* a framing header could not be added: the stream is cut */
	__u32 avg_len;   /* moving averages of a message's bytes and of the kernel */
	__u32 avg_true;  /* memory its skb takes (truesize), to price the backlog */
};

/* Global counters; one entry. */
struct fanout_totals {
	__u64 slow_events; /* subscribers flagged slow, ever: user space polls it */
	__u64 relayed;     /* messages that reached the group's sockets */
};

/* Feed sockets (one UDP socket per subscriber, joined to the forwarder's
 * internal multicast group) by subscriber slot. The verdict is attached
 * here. */
struct {
	__uint(type, BPF_MAP_TYPE_SOCKMAP);
	__uint(max_entries, 1 << 16);
	__type(key, __u32);
	__type(value, __u64);
} feeds SEC(".maps");

/* Subscribers' TCP sockets by slot: only a redirect target, so no program
 * touches what they receive. */
struct {
	__uint(type, BPF_MAP_TYPE_SOCKMAP);
	__uint(max_entries, 1 << 16);
	__type(key, __u32);
	__type(value, __u64);
} targets SEC(".maps");

/* Subscriber state by slot; mapped into user space. */
struct {
	__uint(type, BPF_MAP_TYPE_ARRAY);
	__uint(max_entries, 1 << 16);
	__uint(map_flags, BPF_F_MMAPABLE);
	__type(key, __u32);
	__type(value, struct fanout_sub);
} subs SEC(".maps");

struct {
	__uint(type, BPF_MAP_TYPE_ARRAY);
	__uint(max_entries, 1);
	__uint(map_flags, BPF_F_MMAPABLE);
	__type(key, __u32);
	__type(value, struct fanout_totals);
} totals SEC(".maps");

/* Slot of each feed socket by socket cookie (sk_skb knows only the cookie). */
struct {
	__uint(type, BPF_MAP_TYPE_HASH);
	__uint(max_entries, 1 << 16);
	__type(key, __u64);
	__type(value, __u32);
} slots SEC(".maps");
