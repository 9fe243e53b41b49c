// SPDX-License-Identifier: GPL-2.0
/* shunt policy: egress and ingress rules of a cgroup subtree (a scope).
 *
 * Each scope has its own copy of the hook programs, attached to its cgroup
 * with its id in pcfg. The kernel runs the programs of every cgroup above a
 * socket and refuses when any of them does, so nested scopes must all
 * allow. A refused connect() or sendto() fails with EPERM.
 *
 *  connect4/6: TCP connect and UDP connect (egress); an allowed socket is
 *              marked so a later apply can find it.
 *  sendmsg4/6: unconnected UDP sends (a connected socket's sends run no
 *              hook: its connect was decided).
 *  ingress:    cgroup_skb on the scope's receiving sockets: a TCP SYN to a
 *              listener, and every UDP datagram, dropped if denied.
 *  sockops:    marks accepted connections, for the sweep's ingress rules.
 *  iter/tcp, iter/udp: run by an apply in every netns; close the marked
 *              connections the new rules deny.
 */
#include <linux/bpf.h>
#include <bpf/bpf_helpers.h>
#include <bpf/bpf_endian.h>
#include <bpf/bpf_core_read.h>

#include "include/kernel.h"
#include "include/sock_addr.h"
#include "include/sk_btf.h"
#include "include/policy_keys.h"
#include "include/policy_maps.h"

char __license[] SEC("license") = "GPL";

#ifndef IPPROTO_TCP
#define IPPROTO_TCP 6
#endif
#ifndef IPPROTO_UDP
#define IPPROTO_UDP 17
#endif

/* Before 6.5 there is none: the sweep only finds (pcfg.sweep_finds_only)
 * and user space closes what it found through sock_diag. */
extern int bpf_sock_destroy(struct sock_common *sk) __ksym __weak;

/* Set from Go before load. */
volatile const struct policy_config {
	__u64 scope;             /* the scope these hook programs belong to */
	__u8 sweep_finds_only;   /* the sweep reports, sock_diag closes */
	__u8 _pad[7];
} pcfg;

/* Keeps the enums and the records in BTF for bpf2go. */
const enum policy_action unused_policy_action __attribute__((unused));
const enum policy_hook unused_policy_hook __attribute__((unused));
const enum policy_dir unused_policy_dir __attribute__((unused));
const enum policy_state_key unused_policy_state_key __attribute__((unused));
const struct policy_swept *unused_policy_swept __attribute__((unused));
const struct policy_rule_key *unused_policy_rule_key __attribute__((unused));
const struct policy_rule_info *unused_policy_rule_info __attribute__((unused));

static __always_inline __u32 active_slot(void)
{
	__u32 key = POLICY_STATE_ACTIVE;
	__u32 *s = bpf_map_lookup_elem(&policy_state, &key);
	return s ? (*s & 1) : 0;
}

/* The action scope gives a connection to addr:port over proto, and the
 * counter of the rule that gave it; 0 when the scope has no rules in this
 * slot. addr holds 4 or 16 bytes after family. */
static __always_inline __u8 decide(__u32 slot, __u64 scope, __u8 dir, __u8 family, const __u8 addr[16],
				   __u16 port, __u8 proto, __u32 *rule)
{
	struct policy_scope_key sk = { .scope = scope, .slot = slot };
	struct policy_scope *s = bpf_map_lookup_elem(&policy_scopes, &sk);
	if (!s)
		return 0;
	dir &= 1;
	*rule = s->default_rule[dir];
	__u8 action = s->default_action[dir];

	struct policy_key k = {
		.prefixlen = POLICY_KEY_FIXED_BITS + (family == 4 ? 32 : 128),
		.slot = slot,
		.family = family,
		.dir = dir,
		.scope = scope,
	};
	__builtin_memcpy(k.addr, addr, 16);
	struct policy_list *l = bpf_map_lookup_elem(&policy_rules, &k);
	if (!l)
		return action;
	__u32 n = l->n;
	for (int i = 0; i < POLICY_LIST_LEN; i++) {
		if (i >= n)
			break;
		struct policy_entry *e = &l->e[i];
		if (e->proto && e->proto != proto)
			continue;
		if (port < e->port_lo || port > e->port_hi)
			continue;
		*rule = e->rule;
		return e->action;
	}
	return action;
}

static __always_inline void count(__u32 rule, enum policy_hook hook)
{
	struct policy_counter *c = bpf_map_lookup_elem(&policy_counters, &rule);
	if (!c)
		return;
	/* Per-CPU values: no atomics needed. */
	switch (hook) {
	case POLICY_HOOK_CONNECT:
		c->connects++;
		break;
	case POLICY_HOOK_SEND:
		c->sends++;
		break;
	case POLICY_HOOK_SWEEP:
		c->closed++;
		break;
	}
}

/* An address in the policy's form: IPv4-mapped IPv6 is IPv4, as on the wire. */
static __always_inline __u8 policy_addr(const __u8 a16[16], __u8 out[16])
{
	int mapped = 1;
	for (int i = 0; i < 10; i++)
		if (a16[i])
			mapped = 0;
	if (mapped && a16[10] == 0xff && a16[11] == 0xff) {
		__builtin_memset(out, 0, 16);
		__builtin_memcpy(out, &a16[12], 4);
		return 4;
	}
	__builtin_memcpy(out, a16, 16);
	return 6;
}

static __always_inline void mark(struct bpf_sock *sk, enum policy_conn how)
{
	__u8 *m = bpf_sk_storage_get(&policy_conns, sk, 0, BPF_SK_STORAGE_GET_F_CREATE);
	if (m)
		*m = how;
}

static __always_inline int hook(struct bpf_sock_addr *ctx, __u8 family, const __u8 addr[16], enum policy_hook h)
{
	__u8 proto = ctx->protocol;
	__u16 port = bpf_ntohs(ctx->user_port);
	__u32 rule = 0;
	__u8 action = decide(active_slot(), pcfg.scope, POLICY_EGRESS, family, addr, port, proto, &rule);
	if (!action)
		return 1;
	count(rule, h);
	if (action != POLICY_ALLOW)
		return 0;
	if (h == POLICY_HOOK_CONNECT && ctx->sk)
		mark(ctx->sk, POLICY_CONN_CONNECTED);
	return 1;
}

static __always_inline int hook4(struct bpf_sock_addr *ctx, enum policy_hook h)
{
	__u8 a[16] = {};
	__u32 ip4 = ctx->user_ip4;
	__builtin_memcpy(a, &ip4, 4);
	return hook(ctx, 4, a, h);
}

static __always_inline int hook6(struct bpf_sock_addr *ctx, enum policy_hook h)
{
	/* Word by word: the verifier refuses wider loads of this context. */
	__u32 w[4];
#pragma unroll
	for (int i = 0; i < 4; i++)
		w[i] = *(volatile __u32 *)&ctx->user_ip6[i];
	__u8 a[16];
	__u8 family = policy_addr((const __u8 *)w, a);
	return hook(ctx, family, a, h);
}

SEC("cgroup/connect4")
int shunt_policy_connect4(struct bpf_sock_addr *ctx)
{
	return hook4(ctx, POLICY_HOOK_CONNECT);
}

SEC("cgroup/connect6")
int shunt_policy_connect6(struct bpf_sock_addr *ctx)
{
	return hook6(ctx, POLICY_HOOK_CONNECT);
}

SEC("cgroup/sendmsg4")
int shunt_policy_sendmsg4(struct bpf_sock_addr *ctx)
{
	return hook4(ctx, POLICY_HOOK_SEND);
}

SEC("cgroup/sendmsg6")
int shunt_policy_sendmsg6(struct bpf_sock_addr *ctx)
{
	return hook6(ctx, POLICY_HOOK_SEND);
}

#define ETH_P_IP_BE 0x0008   /* htons(ETH_P_IP) */
#define ETH_P_IPV6_BE 0xdd86 /* htons(ETH_P_IPV6) */
#define TCP_FLAG_SYN 0x02
#define TCP_FLAG_ACK 0x10

/* Who sends to a socket of the scope: a connection request (a TCP SYN
 * without ACK, to a listener) or a UDP datagram is judged by the ingress
 * rules on its source address and the port it is sent to; the rest of a
 * TCP connection was decided at its SYN. IPv6 packets whose transport
 * header does not follow the fixed header (extension headers) pass. */
SEC("cgroup_skb/ingress")
int shunt_policy_ingress(struct __sk_buff *skb)
{
	__u8 addr[16] = {};
	__u8 family, proto;
	__u32 l4;
	if (skb->protocol == ETH_P_IP_BE) {
		struct {
			__u8 vihl, tos;
			__u16 len, id, frag;
			__u8 ttl, proto;
			__u16 csum;
			__u32 saddr, daddr;
		} ip;
		if (bpf_skb_load_bytes(skb, 0, &ip, sizeof(ip)))
			return 1;
		if (ip.frag & bpf_htons(0x1fff)) /* a later fragment: no ports */
			return 1;
		family = 4, proto = ip.proto, l4 = (ip.vihl & 0xf) * 4;
		__builtin_memcpy(addr, &ip.saddr, 4);
	} else if (skb->protocol == ETH_P_IPV6_BE) {
		struct {
			__u32 vtcfl;
			__u16 len;
			__u8 next, hops;
			__u8 saddr[16], daddr[16];
		} ip6;
		if (bpf_skb_load_bytes(skb, 0, &ip6, sizeof(ip6)))
			return 1;
		family = policy_addr(ip6.saddr, addr), proto = ip6.next, l4 = sizeof(ip6);
	} else {
		return 1;
	}
	__u8 ports_flags[14];
	if (proto == IPPROTO_TCP) {
		if (bpf_skb_load_bytes(skb, l4, ports_flags, 14))
			return 1;
		if ((ports_flags[13] & (TCP_FLAG_SYN | TCP_FLAG_ACK)) != TCP_FLAG_SYN)
			return 1;
	} else if (proto == IPPROTO_UDP) {
		if (bpf_skb_load_bytes(skb, l4, ports_flags, 4))
			return 1;
	} else {
		return 1;
	}
	__u16 dport = ((__u16)ports_flags[2] << 8) | ports_flags[3];
	__u32 rule = 0;
	__u8 action = decide(active_slot(), pcfg.scope, POLICY_INGRESS, family, addr, dport, proto, &rule);
	if (!action)
		return 1;
	count(rule, proto == IPPROTO_TCP ? POLICY_HOOK_CONNECT : POLICY_HOOK_SEND);
	return action == POLICY_ALLOW;
}

/* Marks the connections a listener of the scope accepted: the sweep judges
 * them by the ingress rules. */
SEC("sockops")
int shunt_policy_sockops(struct bpf_sock_ops *skops)
{
	if (skops->op == BPF_SOCK_OPS_PASSIVE_ESTABLISHED_CB && skops->sk)
		mark(skops->sk, POLICY_CONN_ACCEPTED);
	return 1;
}

#define POLICY_MAX_DEPTH 32

/* Every scope above a marked socket, from the root down: the first that
 * denies closes it. */
static __always_inline void sweep(struct bpf_iter_meta *meta, struct sock_common *skc, struct sock *sk, __u8 proto)
{
	__u8 *how = bpf_sk_storage_get(&policy_conns, sk, 0, 0);
	if (!how)
		return;
	/* Egress rules judge where it connected, ingress rules who connected
	 * to which of its ports. */
	__u8 dir = *how == POLICY_CONN_ACCEPTED ? POLICY_INGRESS : POLICY_EGRESS;
	struct policy_swept s = { .r.proto = proto };
	struct reaped *r = &s.r;
	sk_addrs(sk, r->local, &r->local_port, r->remote, &r->remote_port);
	if (!r->remote_port)
		return;
	__u16 port = dir == POLICY_INGRESS ? r->local_port : r->remote_port;
	__u8 addr[16];
	__u8 family = policy_addr(r->remote, addr);
	__u32 slot = active_slot();

	struct cgroup *cg = BPF_CORE_READ(sk, sk_cgrp_data.cgroup);
	if (!cg)
		return;
	int level = BPF_CORE_READ(cg, level);
	for (int l = 0; l < POLICY_MAX_DEPTH; l++) {
		if (l > level)
			return;
		struct cgroup *anc = NULL;
		bpf_core_read(&anc, sizeof(anc), &cg->ancestors[l]);
		if (!anc)
			continue;
		__u64 id = BPF_CORE_READ(anc, kn, id);
		__u32 rule = 0;
		__u8 action = decide(slot, id, dir, family, addr, port, proto, &rule);
		if (!action || action == POLICY_ALLOW)
			continue;
		s.rule = rule;
		r->cookie = bpf_get_socket_cookie(sk);
		r->netns_cookie = BPF_CORE_READ(sk, __sk_common.skc_net.net, net_cookie);
		r->family = sk->__sk_common.skc_family;
		/* Finding only, user space counts what sock_diag closes. */
		if (!pcfg.sweep_finds_only) {
			r->err = bpf_sock_destroy(skc);
			if (!r->err)
				count(rule, POLICY_HOOK_SWEEP);
		}
		bpf_seq_write(meta->seq, &s, sizeof(s));
		return;
	}
}

SEC("iter/tcp")
int shunt_policy_sweep_tcp(struct bpf_iter__tcp *ctx)
{
	/* One load of the pointer, checked: the kfunc takes only that. */
	struct sock_common *skc = ctx->sk_common;
	struct sock *sk = skc ? iter_tcp_conn(skc) : NULL;
	if (sk)
		sweep(ctx->meta, skc, sk, IPPROTO_TCP);
	return 0;
}

SEC("iter/udp")
int shunt_policy_sweep_udp(struct bpf_iter__udp *ctx)
{
	struct sock *sk = iter_udp_conn(ctx->udp_sk);
	if (sk)
		sweep(ctx->meta, (struct sock_common *)sk, sk, IPPROTO_UDP);
	return 0;
}
