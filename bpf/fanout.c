// SPDX-License-Identifier: GPL-2.0
/* shunt fanout, kernel path: every subscriber has a UDP "feed" socket joined
 * to one multicast group on loopback. The relay sends each datagram once to
 * the group; the kernel's multicast delivery clones it to every feed socket,
 * and this verdict sends each clone on to its subscriber's TCP socket (sk_skb
 * redirect to the send path), adding the framing on the way. No process
 * touches a message per subscriber.
 *
 * A redirect to a send path is queued without bound and without accounting,
 * so the verdict keeps the kernel memory waiting for a subscriber's socket
 * under the queue bound and drops (counts, and marks a gap) past that: the
 * socket's send buffer plus the queue, as on the user-space paths.
 */
#include <linux/bpf.h>
#include <bpf/bpf_helpers.h>
#include <bpf/bpf_core_read.h>
#include <bpf/bpf_endian.h>

#include "include/kernel.h"
#include "include/skb_kern.h"
#include "include/fanout_maps.h"

char __license[] SEC("license") = "GPL";

volatile const struct fanout_config cfg = {};

/* Keep the shared structs in BTF for bpf2go. */
const struct fanout_sub *unused_fanout_sub __attribute__((unused));
const struct fanout_totals *unused_fanout_totals __attribute__((unused));

#define GAP_LEN 8 /* all-ones length field (4 bytes at most) + 4-byte count */
#define HDR_MAX (GAP_LEN + 4)

/* The kernel memory waiting for the subscriber's socket beyond what its
 * send buffer will take now: messages handed over that the socket has not
 * taken yet (the psock queue, which nothing else counts), less the room its
 * send buffer has left. TCP bounds the send buffer itself. The queue is
 * known in bytes (handed over less the socket's write_seq); its skbs cost
 * more than their bytes, the more so the smaller the messages, so bytes are
 * priced at the recent truesize per byte. Returns 0 if the socket is gone. */
static __always_inline int backlog_mem(struct fanout_sub *s, __u32 slot, __s64 *mem)
{
	struct bpf_sock *sk = bpf_map_lookup_elem(&targets, &slot);
	if (!sk)
		return 0;
	struct tcp_sock *tp = bpf_skc_to_tcp_sock(sk);
	if (!tp) {
		bpf_sk_release(sk);
		return 0;
	}
	__u32 write_seq = BPF_CORE_READ(tp, write_seq);
	__s32 room = BPF_CORE_READ((struct sock *)tp, sk_sndbuf) -
		     BPF_CORE_READ((struct sock *)tp, sk_wmem_queued);
	bpf_sk_release(sk);

	if (!s->base_valid) {
		/* Nothing else writes to a subscriber: its write_seq before our
		 * first message is where our bytes begin. */
		s->base = write_seq;
		s->base_valid = 1;
	}
	__s32 waiting = (__s32)(s->base + s->handed - write_seq);
	*mem = 0;
	if (waiting > 0 && s->avg_len)
		*mem = (__s64)waiting * s->avg_true / s->avg_len;
	if (room > 0)
		*mem -= room;
	return 1;
}

/* x moves an eighth of the way to v. */
static __always_inline void ewma(__u32 *x, __u32 v)
{
	if (!*x)
		*x = v;
	else
		*x = *x - (*x >> 3) + (v >> 3);
}

/* Writes the gap marker (if due) and the length prefix in front of the
 * message. Returns the bytes added, or -1. */
static __always_inline int add_header(struct __sk_buff *skb, struct fanout_sub *s, __u32 len)
{
	__u8 hdr[HDR_MAX] = {};
	__u32 n = 0;

	if (s->gap) {
		__u32 count = bpf_htonl(s->gap);
		if (cfg.framing == 2) {
			*(__u16 *)&hdr[0] = 0xffff;
			__builtin_memcpy(&hdr[2], &count, 4);
			n = 6;
		} else {
			*(__u32 *)&hdr[0] = 0xffffffff;
			__builtin_memcpy(&hdr[4], &count, 4);
			n = 8;
		}
	}
	if (cfg.framing == 2) {
		__u16 l = bpf_htons((__u16)len);
		if (n == 6)
			__builtin_memcpy(&hdr[6], &l, 2);
		else
			__builtin_memcpy(&hdr[0], &l, 2);
		n += 2;
	} else {
		__u32 l = bpf_htonl(len);
		if (n == 8)
			__builtin_memcpy(&hdr[8], &l, 4);
		else
			__builtin_memcpy(&hdr[0], &l, 4);
		n += 4;
	}
	if (n > HDR_MAX)
		return -1;
	/* adjust_room, not change_head: sk_skb's change_head refuses skbs
	 * longer than a 16 KiB allocation. */
	if (bpf_skb_adjust_room(skb, n, 0, 0))
		return -1;
	if (bpf_skb_store_bytes(skb, 0, hdr, n, 0))
		return -1;
	return n;
}

static __always_inline void flag_slow(struct fanout_sub *s)
{
	if (s->slow)
		return;
	s->slow = 1;
	__u32 zero = 0;
	struct fanout_totals *t = bpf_map_lookup_elem(&totals, &zero);
	if (t)
		__sync_fetch_and_add(&t->slow_events, 1);
}

SEC("sk_skb/verdict")
int fanout_verdict(struct __sk_buff *skb)
{
	__u64 cookie = bpf_get_socket_cookie(skb);
	__u32 *slotp = bpf_map_lookup_elem(&slots, &cookie);
	if (!slotp)
		return SK_DROP;
	__u32 slot = *slotp;
	if (slot == cfg.pacer_slot) {
		/* The relay's own feed: this message is out of the loopback
		 * queue, where the relay keeps no more than fits. */
		__u32 zero = 0;
		struct fanout_totals *t = bpf_map_lookup_elem(&totals, &zero);
		if (t)
			__sync_fetch_and_add(&t->relayed, 1);
		return SK_DROP;
	}
	struct fanout_sub *s = bpf_map_lookup_elem(&subs, &slot);
	if (!s || s->slow || s->failed)
		return SK_DROP;

	__u32 len = skb->len;
	__u32 need = len;
	if (cfg.framing) {
		need += cfg.framing;
		if (s->gap)
			need += GAP_LEN;
	}
	__u32 truesize = skb_truesize(skb, cfg.probe_reads);
	__s64 mem;
	if (!backlog_mem(s, slot, &mem))
		return SK_DROP; /* closing: user space is taking it down */
	if (mem + truesize > (__s64)cfg.queue) {
		s->dropped++;
		s->gap++;
		if (cfg.disconnect)
			flag_slow(s);
		return SK_DROP;
	}
	if (cfg.framing && add_header(skb, s, len) < 0) {
		/* Sending the message unframed would corrupt the stream. */
		s->failed = 1;
		flag_slow(s);
		return SK_DROP;
	}
	s->gap = 0; /* shown in front of this message (unframed: cannot be shown) */
	s->handed += need;
	s->bytes += need;
	ewma(&s->avg_len, need);
	ewma(&s->avg_true, truesize);
	s->msgs++;
	return bpf_sk_redirect_map(skb, &targets, slot, 0);
}
