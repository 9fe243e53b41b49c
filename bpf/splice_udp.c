// SPDX-License-Identifier: GPL-2.0
/* shunt splice for UDP: two connected UDP sockets joined in the kernel.
 * Each datagram arriving on one is sent out of the other (sk_skb verdict,
 * redirect to the peer's send path), whole: the verdict makes it linear
 * first, since the psock worker sends each piece of a paged skb with its own
 * sendmsg, which for UDP would be a datagram of its own.
 *
 * Bound. Redirected datagrams wait on the peer's psock queue, which nothing
 * limits or counts, for the psock worker to send them; it falls behind when
 * the peer's send buffer is full or its CPU is busy with receiving. So the
 * verdict prices that queue (datagrams queued times the recent truesize of
 * one) and drops past max_queue, as a full UDP socket buffer would.
 */
#include <linux/bpf.h>
#include <bpf/bpf_helpers.h>
#include <bpf/bpf_core_read.h>

#include "include/kernel.h"
#include "include/skb_kern.h"
#include "include/splice_udp_maps.h"

char __license[] SEC("license") = "GPL";

/* Weak, as in skb_kern.h: before 6.2 cfg.probe_reads is set instead. */
extern void *bpf_rdonly_cast(const void *obj, __u32 btf_id) __ksym __weak;

/* Set from Go before load. */
volatile const struct splice_udp_config {
	__u32 probe_reads; /* no kfunc casts (before 6.2): bpf_probe_read_kernel */
} cfg;

/* Keeps struct splice_udp_dir in BTF for bpf2go. */
const struct splice_udp_dir *unused_splice_udp_dir __attribute__((unused));

/* Datagrams waiting on the peer's psock queue to be sent. */
static __always_inline __u32 peer_queue(struct bpf_sock *peer)
{
	/* A sockmap lookup gives a struct bpf_sock, which shows no queue;
	 * the same pointer read as the kernel's struct sock does. */
	struct sock *sk;
	if (cfg.probe_reads) {
		/* Without the cast the verifier lets no offset be added to
		 * peer; a copy of it read back through the stack is a plain
		 * address, which the probe reads below may offset. */
		volatile struct bpf_sock *spilled = peer;
		bpf_probe_read_kernel(&sk, sizeof(sk), (void *)&spilled);
	} else {
		sk = bpf_rdonly_cast(peer, bpf_core_type_id_kernel(struct sock));
	}
	unsigned long ud = (unsigned long)BPF_CORE_READ(sk, sk_user_data);
	struct sk_psock *psock = (struct sk_psock *)(ud & SK_USER_DATA_PTRMASK);
	if (!psock)
		return 0;
	return BPF_CORE_READ(psock, ingress_skb.qlen);
}

/* x moves an eighth of the way to v. */
static __always_inline void ewma(__u32 *x, __u32 v)
{
	if (!*x)
		*x = v;
	else
		*x = *x - (*x >> 3) + (v >> 3);
}

static __always_inline int drop(struct splice_udp_dir *d, __u32 len)
{
	__sync_fetch_and_add(&d->dropped, 1);
	__sync_fetch_and_add(&d->dropped_bytes, len);
	return SK_DROP;
}

SEC("sk_skb/verdict")
int splice_udp_verdict(struct __sk_buff *skb)
{
	__u64 cookie = bpf_get_socket_cookie(skb);
	__u32 *slot = bpf_map_lookup_elem(&udp_slots, &cookie);
	if (!slot)
		return SK_PASS;
	struct splice_udp_dir *d = bpf_map_lookup_elem(&udp_dirs, slot);
	if (!d)
		return SK_PASS;
	__u32 len = skb->len;

	__u32 peer_slot = d->peer;
	struct bpf_sock *peer = bpf_map_lookup_elem(&udp_socks, &peer_slot);
	if (!peer)
		/* Not in the map (yet, or for a moment): the pair is joining,
		 * being repaired or ending. User space sends on what waits on
		 * the socket once both are in. */
		return SK_PASS;
	__u64 queued = (__u64)peer_queue(peer) * d->avg_true;
	bpf_sk_release(peer);

	__u32 truesize = skb_truesize(skb, cfg.probe_reads);
	if (queued + truesize > d->max_queue)
		return drop(d, len);
	if (bpf_skb_pull_data(skb, len))
		return drop(d, len); /* cannot be made linear: it would be cut */
	ewma(&d->avg_true, truesize);
	__sync_fetch_and_add(&d->datagrams, 1);
	__sync_fetch_and_add(&d->bytes, len);
	return bpf_sk_redirect_map(skb, &udp_socks, peer_slot, 0);
}
