/* Maps of the UDP splice program (bpf/splice_udp.c), shared with Go through
 * bpf2go. */
#pragma once

#include <linux/bpf.h>
#include <bpf/bpf_helpers.h>

/* One direction of a joined UDP pair: datagrams arriving on a socket and
 * leaving through its peer. Counters are read by user space. */
struct splice_udp_dir {
	__u64 datagrams;     /* sent on to the peer */
	__u64 bytes;
	__u64 dropped;       /* over the bound, or the peer gone */
	__u64 dropped_bytes;
	__u32 peer;          /* slot of the socket the datagrams leave through */
	__u32 max_queue;     /* kernel memory the peer's send queue may hold */
	__u32 avg_true;      /* moving average of a datagram's truesize */
	__u32 _pad;
};

/* Sockets by slot; slots 2i and 2i+1 are pair i. */
struct {
	__uint(type, BPF_MAP_TYPE_SOCKMAP);
	__uint(max_entries, 1 << 16);
	__type(key, __u32);
	__type(value, __u64);
} udp_socks SEC(".maps");

/* Direction state by the receiving socket's slot. */
struct {
	__uint(type, BPF_MAP_TYPE_ARRAY);
	__uint(max_entries, 1 << 16);
	__type(key, __u32);
	__type(value, struct splice_udp_dir);
} udp_dirs SEC(".maps");

/* Slot of each joined socket by socket cookie. */
struct {
	__uint(type, BPF_MAP_TYPE_HASH);
	__uint(max_entries, 1 << 16);
	__type(key, __u64);
	__type(value, __u32);
} udp_slots SEC(".maps");
