// SPDX-License-Identifier: GPL-2.0
/* shunt policy: egress rules of a cgroup subtree (a scope).
 *
 * Each scope has its own copy of the four sock_addr programs, attached to
 * its cgroup with its id in pcfg. The kernel runs the programs of every
 * cgroup above a socket and refuses when any of them does, so nested
 * scopes must all allow. A refused connect() or sendto() fails with EPERM.
 *
 *  connect4/6: TCP connect and UDP connect; an allowed socket is marked so
 *              a later apply can find it.
 *  sendmsg4/6: unconnected UDP sends (a connected socket's sends run no
 *              hook: its connect was decided).
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
const struct policy_swept *unused_policy_swept __attribute__((unused));
const struct policy_rule_key *unused_policy_rule_key __attribute__((unused));
const struct policy_rule_info *unused_policy_rule_info __attribute__((unused));

static __always_inline __u32 active_slot(void)
{
	__u32 zero = 0;
	__u32 *s = bpf_map_lookup_elem(&policy_active, &zero);
	return s ? (*s & 1) : 0;
}

/* The action scope gives a connection to addr:port over proto, and the
 * counter of the rule that gave it; 0 when the scope has no rules in this
 * slot. addr holds 4 or 16 bytes after family. */
static __always_inline __u8 decide(__u32 slot, __u64 scope, __u8 family, const __u8 addr[16], __u16 port,
				   __u8 proto, __u32 *rule)
{
	struct policy_scope_key sk = { .scope = scope, .slot = slot };
	struct policy_scope *s = bpf_map_lookup_elem(&policy_scopes, &sk);
	if (!s)
		return 0;
	*rule = s->default_rule;
	__u8 action = s->default_action;

	struct policy_key k = {
		.prefixlen = POLICY_KEY_FIXED_BITS + (family == 4 ? 32 : 128),
		.slot = slot,
		.family = family,
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

static __always_inline int hook(struct bpf_sock_addr *ctx, __u8 family, const __u8 addr[16], enum policy_hook h)
{
	__u8 proto = ctx->protocol;
	__u16 port = bpf_ntohs(ctx->user_port);
	__u32 rule = 0;
	__u8 action = decide(active_slot(), pcfg.scope, family, addr, port, proto, &rule);
	if (!action)
		return 1;
	count(rule, h);
	if (action != POLICY_ALLOW)
		return 0;
	if (h == POLICY_HOOK_CONNECT && ctx->sk)
		bpf_sk_storage_get(&policy_conns, ctx->sk, 0, BPF_SK_STORAGE_GET_F_CREATE);
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

#define POLICY_MAX_DEPTH 32

/* Every scope above a marked socket, deepest last, as the kernel runs the
 * hooks: the first that denies closes it. */
static __always_inline void sweep(struct bpf_iter_meta *meta, struct sock_common *skc, struct sock *sk, __u8 proto)
{
	if (!bpf_sk_storage_get(&policy_conns, sk, 0, 0))
		return;
	struct policy_swept s = { .r.proto = proto };
	struct reaped *r = &s.r;
	sk_addrs(sk, r->local, &r->local_port, r->remote, &r->remote_port);
	if (!r->remote_port)
		return;
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
		__u8 action = decide(slot, id, family, addr, r->remote_port, proto, &rule);
		if (!action || action == POLICY_ALLOW)
			continue;
		s.rule = rule;
		r->cookie = bpf_get_socket_cookie(sk);
		r->netns_cookie = BPF_CORE_READ(sk, __sk_common.skc_net.net, net_cookie);
		r->family = sk->__sk_common.skc_family;
		if (!pcfg.sweep_finds_only)
			r->err = bpf_sock_destroy(skc);
		if (!r->err)
			count(rule, POLICY_HOOK_SWEEP);
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
