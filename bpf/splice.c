// SPDX-License-Identifier: GPL-2.0
/* shunt splice: two connected sockets joined in the kernel. Bytes arriving on
 * one leave through the other, with no process woken (sk_skb verdict,
 * redirect to the peer's send path).
 *
 * Flow control. A redirect to a send path is queued on the peer's psock
 * without bound and without memory accounting, and the receiving socket keeps
 * its window open, so a fast sender and a slow far reader would grow kernel
 * memory without limit. So each direction keeps its bytes in flight (handed
 * to the peer, not yet acknowledged by the far end) under max_inflight; past
 * it the verdict passes bytes to the receiving socket's own queue instead and
 * sets DIR_USER. User space then reads and writes them on like any proxy
 * (its reads are what opens the window again, so the sender is slowed as by
 * TCP), and hands the direction back with a compare-and-swap once it has read
 * every byte the verdict passed. Keeping in flight below the peer's send
 * buffer also keeps the psock worker from meeting a full buffer, where it
 * would retry only once a jiffy.
 */
#include <linux/bpf.h>
#include <bpf/bpf_helpers.h>
#include <bpf/bpf_core_read.h>

#include "include/kernel.h"
#include "include/skb_kern.h"
#include "include/splice_maps.h"

char __license[] SEC("license") = "GPL";

/* Set from Go before load. */
volatile const struct splice_config {
	__u32 probe_reads; /* no bpf_cast_to_kern_ctx (before 6.2): bpf_probe_read_kernel */
} cfg;

/* Keeps struct splice_dir in BTF for bpf2go. */
const struct splice_dir *unused_splice_dir __attribute__((unused));
const enum splice_state_bits *unused_state_bits __attribute__((unused));

/* How far the peer may be behind: its own send buffer bounds what TCP would
 * hold there; half of it, because the buffer counts skb overhead too. */
static __always_inline __u32 inflight_limit(struct splice_dir *d, struct tcp_sock *peer)
{
	__u32 half = (__u32)BPF_CORE_READ((struct sock *)peer, sk_sndbuf) / 2;

	return half < d->max_inflight ? half : d->max_inflight;
}

/* The direction's bytes go to user space from now on. */
static __always_inline int to_user(struct splice_dir *d)
{
	__sync_fetch_and_or(&d->state, DIR_USER);
	d->to_user++;
	return SK_PASS;
}

/* Forward in the kernel if the peer has room; otherwise give the direction to
 * user space. Returns the verdict. */
static __always_inline int forward(struct __sk_buff *skb, struct splice_dir *d)
{
	__u32 peer_slot = d->peer;
	/* A peer that left the map was reset or closed: user space finds out
	 * when it writes these bytes, and resets our side too. */
	struct bpf_sock *peer = bpf_map_lookup_elem(&socks, &peer_slot);
	if (!peer)
		return to_user(d);

	struct tcp_sock *tp = bpf_skc_to_tcp_sock(peer);
	if (!tp) {
		bpf_sk_release(peer);
		return to_user(d);
	}
	__u32 write_seq = BPF_CORE_READ(tp, write_seq);
	__u32 snd_una = BPF_CORE_READ(tp, snd_una);
	__u32 limit = inflight_limit(d, tp);
	bpf_sk_release(peer);

	if (!d->base_valid) {
		/* User space handed over with nothing queued in the peer's psock,
		 * so its write_seq is where our redirects begin. */
		d->base = write_seq;
		d->period = 0;
		d->base_valid = 1;
	}
	__s32 inflight = (__s32)(d->base + d->period - snd_una);
	if (inflight < 0)
		inflight = 0;
	if ((__u32)inflight + skb->len > limit)
		return to_user(d);
	d->period += skb->len;
	d->redirected += skb->len;
	return bpf_sk_redirect_map(skb, &socks, peer_slot, 0);
}

/* How many bytes at the head of skb were already seen. TCP queues a
 * retransmission that overlaps what it has received with its old bytes
 * still in front, for a reader that skips them by sequence number;
 * tcp_read_skb hands the verdict the whole skb (6.18), and forwarding it
 * would send those bytes twice. */
static __always_inline __u32 seen_before(struct __sk_buff *skb, struct splice_dir *d)
{
	__u32 seq = skb_tcp_seq(skb, cfg.probe_reads);

	if (!d->expect_valid) {
		/* First skb since the join: user space has read up to
		 * copied_seq, and nothing else reads this socket. */
		struct bpf_sock *self = skb->sk;
		struct tcp_sock *tp = self ? bpf_skc_to_tcp_sock(self) : NULL;
		if (!tp)
			return 0;
		d->expect = BPF_CORE_READ(tp, copied_seq);
		d->expect_valid = 1;
	}
	__s32 old = (__s32)(d->expect - seq);
	__u32 end = seq + skb->len;
	if ((__s32)(end - d->expect) > 0)
		d->expect = end;
	return old > 0 ? (__u32)old : 0;
}

/* Pass skb to user space, which drops its first `dup` bytes. */
static __always_inline int pass_with_skip(struct splice_dir *d, __u64 pos, __u32 dup)
{
	__u32 head = d->skip_head;
	if (head - __sync_fetch_and_add(&d->skip_tail, 0) >= SKIP_RING) {
		d->broken = 1;
		return to_user(d);
	}
	struct skip *sk = &d->skips[head & (SKIP_RING - 1)];
	sk->pos = pos;
	sk->len = dup;
	__sync_fetch_and_add(&d->skip_head, 1);
	d->overlaps++;
	return to_user(d);
}

SEC("sk_skb/verdict")
int splice_verdict(struct __sk_buff *skb)
{
	/* A FIN without data. TCP has already taken note of the FIN (user
	 * space forwards it); passed on, the empty skb would make the psock
	 * worker fail with EPIPE and break the pipe. */
	if (skb->len == 0)
		return SK_DROP;

	__u64 cookie = bpf_get_socket_cookie(skb);
	__u32 *slot = bpf_map_lookup_elem(&slots, &cookie);
	if (!slot)
		return SK_PASS;
	struct splice_dir *d = bpf_map_lookup_elem(&dirs, slot);
	if (!d)
		return SK_PASS;

	__u32 dup = seen_before(skb, d);
	if (dup >= skb->len)
		return SK_DROP; /* nothing new in it */

	/* Counting first makes the mode we read and the bytes we add one
	 * atomic step: user space's hand-back fails if any verdict ran since
	 * it last looked, so passed bytes are never left unread. */
	__u64 old = __sync_fetch_and_add(&d->state, skb->len);
	if (dup)
		return pass_with_skip(d, old & ~DIR_USER, dup);
	if (old & DIR_USER)
		return SK_PASS;
	return forward(skb, d);
}
