// SPDX-License-Identifier: GPL-2.0
/* shunt index: every connected TCP and UDP socket, by backend.
 *
 * A backend is what a socket is connected to (remote address, port,
 * protocol). Each socket's entry says what an exact SOCK_DESTROY needs:
 * netns, family, local address and port, cookie. The sockets of a backend
 * occupy slots below that backend's high-water mark, so user space finds them
 * by looking at those slots only (see index_keys.h).
 *
 *  TCP: connect4/6 note who connects, sockops indexes sockets that
 *       connected (ACTIVE_ESTABLISHED), removes them at TCP_CLOSE.
 *  UDP: connect4/6 indexes (the local port is not chosen yet), the first
 *       send fills in the local address (cgroup_skb egress).
 *  Both: sock_release removes when the application closes the socket.
 *  Sockets that existed before the index are added once by iter/tcp and
 *  iter/udp, run in every netns when the index is enabled.
 */
#include <linux/bpf.h>
#include <bpf/bpf_helpers.h>
#include <bpf/bpf_endian.h>
#include <bpf/bpf_core_read.h>

#include "include/kernel.h"
#include "include/sock_addr.h"
#include "include/sk_btf.h"
#include "include/cgroup_btf.h"
#include "include/index_keys.h"
#include "include/index_maps.h"

char __license[] SEC("license") = "GPL";

/* Set from Go before load: the cgroup the hooks are attached to, so the
 * start-up sweep takes the same sockets the hooks would. */
volatile const struct index_config {
	__u64 cgroup_id;
	__u32 cgroup_level; /* 0 for the root of the hierarchy */
	__u32 _pad;
} icfg;

/* Keeps enum entry_flags in BTF so bpf2go generates its Go twin. */
const enum entry_flags unused_entry_flags __attribute__((unused));

#define ENOENT 2

/* sock_slot.indexed */
enum {
	SLOT_NONE,
	SLOT_INSERTING,
	SLOT_INDEXED,
};

static __always_inline void icount(__u32 which)
{
	__u64 *v = bpf_map_lookup_elem(&index_counters, &which);
	if (v)
		(*v)++;
}

static __always_inline struct backend_state *backend_of(struct backend *b)
{
	struct backend_state *bs = bpf_map_lookup_elem(&backends, b);
	if (bs)
		return bs;
	struct backend_state zero = {};
	bpf_map_update_elem(&backends, b, &zero, BPF_NOEXIST);
	return bpf_map_lookup_elem(&backends, b);
}

/* A socket's close reaches here once, so a delete that fails for a reason
 * other than a missing entry would leave the entry for good: since 6.15 a
 * hash map's bucket lock gives up (resilient spinlock) on a timeout or a
 * deadlock it suspects, and CI saw one entry of 100,000 left so. Try again,
 * and count what still fails. */
static __always_inline void remove_entry(struct slot_key *k)
{
	long err = 0;
	for (int i = 0; i < 4; i++) {
		err = bpf_map_delete_elem(&sock_index, k);
		if (!err || err == -ENOENT)
			break;
	}
	if (err) {
		if (err != -ENOENT)
			icount(ICNT_NOT_REMOVED);
		return;
	}
	struct backend_state *bs = bpf_map_lookup_elem(&backends, &k->backend);
	if (bs)
		__sync_fetch_and_sub(&bs->live, 1);
	icount(ICNT_REMOVED);
}

/* Takes a free slot of the backend: a few random tries below the high-water
 * mark reuse slots of closed sockets, so the mark follows the backend's peak
 * of live sockets rather than every socket it ever had; then a new slot. */
static __always_inline int take_slot(struct backend_state *bs, struct slot_key *k, struct entry *e)
{
	for (int i = 0; i < 4; i++) {
		__u32 high = *(volatile __u32 *)&bs->high;
		if (!high)
			break;
		k->slot = bpf_get_prandom_u32() % high;
		if (!bpf_map_update_elem(&sock_index, k, e, BPF_NOEXIST))
			return 0;
	}
	for (int i = 0; i < 4; i++) {
		k->slot = __sync_fetch_and_add(&bs->high, 1);
		if (!bpf_map_update_elem(&sock_index, k, e, BPF_NOEXIST))
			return 0;
	}
	return -1;
}

/* Returns 0 if this call indexed the socket. */
static __always_inline int index_add(struct sock_slot *ss, struct backend *b, struct entry *e)
{
	if (__sync_val_compare_and_swap(&ss->indexed, SLOT_NONE, SLOT_INSERTING) != SLOT_NONE)
		return -1;

	struct slot_key k = {};
	k.backend = *b;
	struct backend_state *bs = backend_of(b);
	if (!bs || take_slot(bs, &k, e)) {
		__sync_val_compare_and_swap(&ss->indexed, SLOT_INSERTING, SLOT_NONE);
		icount(ICNT_FULL);
		return -1;
	}
	ss->key = k;
	__sync_fetch_and_add(&bs->live, 1);
	icount(ICNT_ADDED);
	/* A close that ran meanwhile found SLOT_INSERTING and left the entry
	 * to us. */
	if (__sync_val_compare_and_swap(&ss->indexed, SLOT_INSERTING, SLOT_INDEXED) != SLOT_INSERTING)
		remove_entry(&k);
	return 0;
}

static __always_inline void index_remove(struct sock_slot *ss)
{
	if (__sync_lock_test_and_set(&ss->indexed, SLOT_NONE) == SLOT_INDEXED)
		remove_entry(&ss->key);
}

static __always_inline __u32 current_tgid(void)
{
	return bpf_get_current_pid_tgid() >> 32;
}

static __always_inline void note_netns_owner(__u64 netns, __u32 tgid)
{
	__u32 *have = bpf_map_lookup_elem(&netns_owners, &netns);
	if (have && *have == tgid)
		return;
	bpf_map_update_elem(&netns_owners, &netns, &tgid, BPF_ANY);
}

static __always_inline void tcp_established(struct bpf_sock_ops *skops)
{
	struct bpf_sock *sk = skops->sk;
	if (!sk)
		return;
	struct sock_slot *ss = bpf_sk_storage_get(&sock_slots, sk, 0, BPF_SK_STORAGE_GET_F_CREATE);
	if (!ss)
		return;

	struct backend b = { .proto = IPPROTO_TCP };
	struct entry e = {};
	if (skops_addrs(skops, e.local, b.addr, &e.local_port, &b.port))
		return;
	e.cookie = bpf_get_socket_cookie(skops);
	e.netns_cookie = bpf_get_netns_cookie(skops);
	e.since_ns = bpf_ktime_get_boot_ns();
	e.family = skops->family;
	e.owner_tgid = ss->owner_tgid;
	index_add(ss, &b, &e);
	bpf_sock_ops_cb_flags_set(skops, skops->bpf_sock_ops_cb_flags | BPF_SOCK_OPS_STATE_CB_FLAG);
}

SEC("sockops")
int shunt_index_sockops(struct bpf_sock_ops *skops)
{
	struct sock_slot *ss;

	switch (skops->op) {
	case BPF_SOCK_OPS_ACTIVE_ESTABLISHED_CB:
		/* Only sockets that connected: an accepted socket's "backend"
		 * would be a client's ephemeral port. */
		tcp_established(skops);
		break;
	case BPF_SOCK_OPS_STATE_CB:
		if (skops->args[1] != BPF_TCP_CLOSE || !skops->sk)
			break;
		ss = bpf_sk_storage_get(&sock_slots, skops->sk, 0, 0);
		if (ss)
			index_remove(ss);
		break;
	}
	return 1;
}

/* TCP: the connect hook is the only event of an active open that runs in
 * the caller's context (sockops may read the pid only since 6.10), so it
 * notes who connected; sockops indexes the socket once it is established.
 * Connected UDP is indexed here. The hook runs before the kernel picks the
 * local port and address, so the entry says "local unknown" until the
 * first send. */
static __always_inline int on_connect(struct bpf_sock_addr *ctx, struct backend *b)
{
	struct bpf_sock *sk = ctx->sk;
	if (!sk)
		return 1;
	if (ctx->protocol == IPPROTO_TCP) {
		struct sock_slot *ss = bpf_sk_storage_get(&sock_slots, sk, 0, BPF_SK_STORAGE_GET_F_CREATE);
		if (ss) {
			ss->owner_tgid = current_tgid();
			note_netns_owner(bpf_get_netns_cookie(ctx), ss->owner_tgid);
		}
		return 1;
	}
	if (ctx->type != SOCK_DGRAM || ctx->protocol != IPPROTO_UDP)
		return 1;
	struct sock_slot *ss = bpf_sk_storage_get(&sock_slots, sk, 0, BPF_SK_STORAGE_GET_F_CREATE);
	if (!ss)
		return 1;
	/* A reconnect moves the socket to its new backend. */
	index_remove(ss);

	b->proto = IPPROTO_UDP;
	b->port = bpf_ntohs((__u16)ctx->user_port);
	struct entry e = {};
	e.cookie = bpf_get_socket_cookie(ctx);
	e.netns_cookie = bpf_get_netns_cookie(ctx);
	e.since_ns = bpf_ktime_get_boot_ns();
	e.family = ctx->user_family;
	e.flags = ENTRY_LOCAL_UNKNOWN;
	/* A socket that picked its port at connect loses it again on
	 * disconnect (AF_UNSPEC, no hook); one that had it keeps it, and
	 * SOCK_DESTROY's lookup would then still find it. */
	if (sk->src_port)
		e.flags |= ENTRY_BOUND;
	e.owner_tgid = current_tgid();
	ss->owner_tgid = e.owner_tgid;
	ss->local_known = 0;
	note_netns_owner(e.netns_cookie, e.owner_tgid);
	index_add(ss, b, &e);
	return 1;
}

SEC("cgroup/connect4")
int shunt_index_connect4(struct bpf_sock_addr *ctx)
{
	struct backend b = {};
	ip4_mapped(b.addr, ctx->user_ip4);
	return on_connect(ctx, &b);
}

SEC("cgroup/connect6")
int shunt_index_connect6(struct bpf_sock_addr *ctx)
{
	struct backend b = {};
	__u32 a[4];
#pragma unroll
	for (int i = 0; i < 4; i++)
		a[i] = *(volatile __u32 *)&ctx->user_ip6[i];
	__builtin_memcpy(b.addr, a, 16);
	return on_connect(ctx, &b);
}

/* First send of a connected UDP socket: now its local address is known. A
 * send from a socket that was disconnected (AF_UNSPEC, no hook) drops it.
 * Runs for every packet of the cgroup: after the first send of a socket it
 * stops at its own socket storage, without a lookup in the index. */
SEC("cgroup_skb/egress")
int shunt_index_egress(struct __sk_buff *skb)
{
	struct bpf_sock *sk = skb->sk;
	if (!sk)
		return 1;
	sk = bpf_sk_fullsock(sk);
	if (!sk || sk->protocol != IPPROTO_UDP)
		return 1;
	struct sock_slot *ss = bpf_sk_storage_get(&sock_slots, sk, 0, 0);
	if (!ss || ss->indexed != SLOT_INDEXED)
		return 1;
	if (!sk->dst_port) {
		index_remove(ss);
		return 1;
	}
	if (ss->local_known)
		return 1;
	ss->local_known = 1;
	struct entry *e = bpf_map_lookup_elem(&sock_index, &ss->key);
	if (!e || !(e->flags & ENTRY_LOCAL_UNKNOWN))
		return 1;
	if (sk->family == AF_INET) {
		ip4_mapped(e->local, sk->src_ip4);
	} else {
		__u32 a[4];
#pragma unroll
		for (int i = 0; i < 4; i++)
			a[i] = sk->src_ip6[i];
		__builtin_memcpy(e->local, a, 16);
	}
	e->local_port = sk->src_port;
	e->family = sk->family;
	e->flags &= ~ENTRY_LOCAL_UNKNOWN;
	icount(ICNT_FILLED);
	return 1;
}

SEC("cgroup/sock_release")
int shunt_index_release(struct bpf_sock *sk)
{
	struct sock_slot *ss = bpf_sk_storage_get(&sock_slots, sk, 0, 0);
	if (ss)
		index_remove(ss);
	return 1;
}

/* The sweep takes the sockets the hooks would: those of the indexed cgroup
 * and its descendants. */
static __always_inline int in_our_cgroup(struct sock *sk)
{
	return cgroup_within(BPF_CORE_READ(sk, sk_cgrp_data.cgroup), icfg.cgroup_id, icfg.cgroup_level);
}

/* Start-up sweep: index a socket found by an iterator. Only sockets an
 * application still holds (sk_socket set) are taken: their close runs
 * sock_release, which removes them again. Writes one byte per socket added,
 * so user space can count them. */
static __always_inline void seed(struct bpf_iter_meta *meta, struct sock *sk, __u8 proto)
{
	if (!BPF_CORE_READ(sk, sk_socket) || !in_our_cgroup(sk))
		return;
	struct sock_slot *ss = bpf_sk_storage_get(&sock_slots, sk, 0, BPF_SK_STORAGE_GET_F_CREATE);
	if (!ss || ss->indexed != SLOT_NONE)
		return;

	struct backend b = { .proto = proto };
	struct entry e = {};
	sk_addrs(sk, e.local, &e.local_port, b.addr, &b.port);
	if (!b.port)
		return;
	e.cookie = bpf_get_socket_cookie(sk);
	e.netns_cookie = BPF_CORE_READ(sk, __sk_common.skc_net.net, net_cookie);
	e.since_ns = bpf_ktime_get_boot_ns();
	e.family = BPF_CORE_READ(sk, __sk_common.skc_family);
	e.flags = ENTRY_SEEDED;
	if (proto == IPPROTO_UDP)
		e.flags |= ENTRY_BOUND; /* cannot tell: check before destroying */
	ss->local_known = 1;
	if (!index_add(ss, &b, &e))
		bpf_seq_write(meta->seq, &proto, 1);
}

/* The sweep cannot ask a socket whether it connected or was accepted. The
 * TCP iterator visits listeners before connected sockets, so it notes their
 * ports and takes a connected socket on a listening port as accepted. */
struct listen_key {
	__u64 netns;
	__u16 port;
	__u16 _pad[3];
};

struct {
	__uint(type, BPF_MAP_TYPE_HASH);
	__uint(map_flags, BPF_F_NO_PREALLOC);
	__uint(max_entries, 1 << 18);
	__type(key, struct listen_key);
	__type(value, __u8);
} sweep_listeners SEC(".maps");

SEC("iter/tcp")
int shunt_index_seed_tcp(struct bpf_iter__tcp *ctx)
{
	struct sock *sk = iter_tcp_sock(ctx->sk_common);
	if (!sk)
		return 0;
	struct listen_key lk = {
		.netns = BPF_CORE_READ(sk, __sk_common.skc_net.net, net_cookie),
		.port = sk->__sk_common.skc_num,
	};
	__u8 one = 1;
	if (sk->__sk_common.skc_state == TCP_LISTEN) {
		bpf_map_update_elem(&sweep_listeners, &lk, &one, BPF_ANY);
		return 0;
	}
	if (bpf_map_lookup_elem(&sweep_listeners, &lk))
		return 0;
	switch (sk->__sk_common.skc_state) {
	case TCP_ESTABLISHED:
	case TCP_FIN_WAIT1:
	case TCP_FIN_WAIT2:
	case TCP_CLOSE_WAIT:
	case TCP_LAST_ACK:
	case TCP_CLOSING:
		seed(ctx->meta, sk, IPPROTO_TCP);
	}
	return 0;
}

SEC("iter/udp")
int shunt_index_seed_udp(struct bpf_iter__udp *ctx)
{
	struct sock *sk = (struct sock *)ctx->udp_sk;
	if (!sk)
		return 0;
	/* Connected UDP sockets are in state ESTABLISHED. */
	if (sk->__sk_common.skc_state == TCP_ESTABLISHED)
		seed(ctx->meta, sk, IPPROTO_UDP);
	return 0;
}

/* Reads FIND_SLOTS slots of a backend in one BPF_PROG_RUN. Each output has
 * a fixed place in the context (variable context offsets are not allowed). */
SEC("syscall")
int shunt_index_find(struct find_ctx *ctx)
{
	struct backend b;
	__builtin_memcpy(&b, &ctx->backend, sizeof(b));
	ctx->present = 0;
	struct backend_state *bs = bpf_map_lookup_elem(&backends, &b);
	if (!bs) {
		ctx->high = 0;
		return 0;
	}
	__u32 high = bs->high;
	ctx->high = high;

	struct slot_key k = {};
	k.backend = b;
	__u32 start = ctx->start;
	__u32 present = 0;
#pragma unroll
	for (int i = 0; i < FIND_SLOTS; i++) {
		k.slot = start + i;
		if (k.slot >= high)
			break;
		struct entry *e = bpf_map_lookup_elem(&sock_index, &k);
		if (e) {
			__builtin_memcpy(&ctx->out[i], e, sizeof(*e));
			present |= 1u << i;
		}
	}
	ctx->present = present;
	return 0;
}
