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
 *  peer egress: cgroup_skb on each cgroup an ingress peer rule names:
 *              writes down the sender's cgroups of each connection
 *              request and datagram for the receiver's ingress program
 *              (a request's also under its sequence number, which
 *              address translation leaves alone).
 *  iter/tcp, iter/udp: run by an apply in every netns; close the marked
 *              connections the new rules deny (the collector first writes
 *              every connection's cgroups down when peer rules need them).
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
#ifndef IPPROTO_UDPLITE
#define IPPROTO_UDPLITE 136
#endif
#define SOCK_RAW 3

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

/* The action of the first entry of l that matches port and proto, with its
 * counter; 0 if none does. A global function: the verifier checks it once,
 * not at each of the places the hooks call it from. */
__noinline int first_match(struct policy_list *l, __u32 port, __u32 proto, __u32 *rule)
{
	if (!l || !rule)
		return 0;
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
	return 0;
}

/* A walk over a sender's cgroups, by bpf_loop: verified once, not once per
 * cgroup level at each of the sweep's scope levels. */
struct peer_walk {
	struct policy_sender snd; /* a copy: the callback reads it off the stack */
	struct policy_peer_key k;
	__u32 rule;
	__u16 port;
	__u8 proto;
	__u8 action;
};

static long peer_step(__u64 i, void *data)
{
	struct peer_walk *w = data;
	if (i >= w->snd.n || i >= POLICY_PEER_LEVELS)
		return 1;
	/* The deepest first. */
	w->k.peer = w->snd.cgroups[(w->snd.n - 1 - i) & (POLICY_PEER_LEVELS - 1)];
	struct policy_list *l = bpf_map_lookup_elem(&policy_peer_rules, &w->k);
	if (!l)
		return 0;
	w->action = first_match(l, w->port, w->proto, &w->rule);
	return w->action ? 1 : 0;
}

/* The action of scope's peer rules for a sender in snd's cgroups: the rules
 * naming the deepest of them decide first. 0 if none matches. */
static __always_inline __u8 decide_peer(__u32 slot, __u64 scope, __u8 dir, const struct policy_sender *snd,
					__u16 port, __u8 proto, __u32 *rule)
{
	struct peer_walk w = {
		.k = { .scope = scope, .slot = slot, .dir = dir },
		.port = port,
		.proto = proto,
	};
	__builtin_memcpy(&w.snd, snd, sizeof(w.snd));
	bpf_loop(POLICY_PEER_LEVELS, peer_step, &w, 0);
	if (w.action)
		*rule = w.rule;
	return w.action;
}

/* Now in milliseconds, never 0 (0 is no stamp). */
static __always_inline __u32 now_ms(void)
{
	__u32 ms = bpf_ktime_get_ns() / 1000000;
	return ms ? ms : 1;
}

/* The stamp an entry by flow holds for the packet (struct policy_sender):
 * a connection request's sequence number (a peer program from before wrote
 * those), or now in milliseconds for a datagram; never 0. */
static __always_inline __u32 packet_stamp(__u8 proto, __u32 seq)
{
	if (proto == IPPROTO_TCP)
		return seq ? seq : 1;
	return now_ms();
}

/* The key of a connection request's sender by its sequence number alone. */
static __always_inline void isn_flow(struct policy_flow *k, __u32 isn)
{
	__builtin_memset(k, 0, sizeof(*k));
	k->family = POLICY_FLOW_BY_ISN;
	k->proto = IPPROTO_TCP;
	__builtin_memcpy(k->saddr, &isn, sizeof(isn));
}

/* The sender of the connection request with sequence number isn, when its
 * flow was translated on the way (the entry under the flow the receiver
 * sees is another's or none); NULL once stale. */
static __always_inline struct policy_sender *isn_sender(__u32 isn)
{
	struct policy_flow k;
	isn_flow(&k, isn);
	struct policy_sender *snd = bpf_map_lookup_elem(&policy_senders, &k);
	if (snd && now_ms() - snd->stamp > POLICY_ISN_SENDER_MS)
		return NULL;
	return snd;
}

/* The key of an open connection by its handshake's two sequence numbers,
 * the client's first: the same at both ends whatever translation rewrote.
 * Each end has them from what it has received and had acknowledged since:
 * TCP's byte counts include the client's SYN in what the client had
 * acknowledged, never the server's SYN-ACK, nor a SYN in what was
 * received. */
static __always_inline void isn_pair_flow(struct policy_flow *k, struct sock *sk, int connected)
{
	struct tcp_sock *tp = (struct tcp_sock *)sk;
	__u32 own = BPF_CORE_READ(tp, snd_una) - (__u32)BPF_CORE_READ(tp, bytes_acked);
	__u32 peer = BPF_CORE_READ(tp, rcv_nxt) - (__u32)BPF_CORE_READ(tp, bytes_received) - 1;
	__u32 server = connected ? peer : own - 1;
	isn_flow(k, connected ? own : peer);
	__builtin_memcpy(k->saddr + 4, &server, sizeof(server));
}

/* The sender entry was written for this packet: the same connection
 * request, or a datagram of the flow that left moments ago. */
static __always_inline int stamp_matches(const struct policy_sender *snd, __u8 proto, __u32 stamp)
{
	if (proto == IPPROTO_TCP)
		return snd->stamp == stamp;
	return stamp - snd->stamp <= POLICY_UDP_SENDER_MS;
}

/* The action scope gives a connection to (egress) or from (ingress) addr,
 * on port over proto, and the counter of the rule that gave it; 0 when the
 * scope has no rules in this slot. addr holds 4 or 16 bytes after family.
 * A scope with peer rules looks the sender up: a connection request's (seq:
 * its sequence number) by that number, anything else by the flow in
 * senders, taking the entry only if it was written for this packet. */
static __always_inline __u8 decide(__u32 slot, __u64 scope, __u8 dir, __u8 family, const __u8 addr[16],
				   __u16 port, __u8 proto, __u32 *rule, void *senders, const struct policy_flow *flow,
				   const __u32 *seq)
{
	struct policy_scope_key sk = { .scope = scope, .slot = slot };
	struct policy_scope *s = bpf_map_lookup_elem(&policy_scopes, &sk);
	if (!s)
		return 0;
	dir &= 1;
	*rule = s->default_rule[dir];
	__u8 action = s->default_action[dir];

	if (flow && s->has_peer_rules[dir]) {
		struct policy_sender *snd = NULL;
		if (seq && flow->proto == IPPROTO_TCP)
			snd = isn_sender(*seq);
		if (!snd) { /* a datagram, or a SYN a peer program from before wrote */
			snd = bpf_map_lookup_elem(senders, flow);
			if (snd && seq && !stamp_matches(snd, flow->proto, packet_stamp(flow->proto, *seq)))
				snd = NULL; /* written for another socket of that flow */
		}
		if (snd) {
			__u8 a = decide_peer(slot, scope, dir, snd, port, proto, rule);
			if (a)
				return a;
		}
	}

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
	__u8 a = first_match(l, port, proto, rule);
	return a ? a : action;
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
	__u8 action = decide(active_slot(), pcfg.scope, POLICY_EGRESS, family, addr, port, proto, &rule, NULL, NULL, NULL);
	if (!action)
		return 1;
	count(rule, h);
	if (action != POLICY_ALLOW)
		return 0;
	if (h == POLICY_HOOK_CONNECT && ctx->sk)
		mark(ctx->sk, POLICY_CONN_CONNECTED);
	return 1;
}

/* INADDR_ANY as a destination is this host (ip_route_output_key: the
 * socket's own source address if it has one, else 127.0.0.1): judged as the
 * address the packets will carry, as nftables' output hook sees them, or a
 * rule on 127.0.0.0/8 is walked around by connecting to 0.0.0.0. */
static __always_inline __u32 unspecified4(struct bpf_sock_addr *ctx, __u32 ip4)
{
	if (ip4)
		return ip4;
	struct bpf_sock *sk = ctx->sk;
	if (sk && sk->src_ip4)
		return sk->src_ip4;
	return bpf_htonl(0x7f000001);
}

static __always_inline int hook4(struct bpf_sock_addr *ctx, enum policy_hook h)
{
	__u8 a[16] = {};
	__u32 ip4 = unspecified4(ctx, ctx->user_ip4);
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
	if (family == 4) {
		/* ::ffff:0.0.0.0 connects as 0.0.0.0 does */
		__u32 ip4;
		__builtin_memcpy(&ip4, a, 4);
		ip4 = unspecified4(ctx, ip4);
		__builtin_memcpy(a, &ip4, 4);
	} else if (!(w[0] | w[1] | w[2] | w[3])) {
		/* "::" is ::1 (tcp_v6_connect, udpv6_sendmsg) */
		a[15] = 1;
	}
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

#define IPV6_EXT_HOPOPTS 0
#define IPV6_EXT_ROUTING 43
#define IPV6_EXT_FRAGMENT 44
#define IPV6_EXT_AH 51
#define IPV6_EXT_DSTOPTS 60
#define IPV6_EXT_MAX 8

/* Past the IPv6 extension headers from *l4 (next: the first one's type):
 * the transport protocol and where its header starts. 0 for a later
 * fragment (no ports) or a chain longer than IPV6_EXT_MAX, which Linux
 * would deliver all the same: such a packet is not judged. */
static __always_inline int skip_ipv6_ext(struct __sk_buff *skb, __u8 next, __u8 *proto, __u32 *l4)
{
	for (int i = 0; i < IPV6_EXT_MAX; i++) {
		if (next != IPV6_EXT_HOPOPTS && next != IPV6_EXT_ROUTING && next != IPV6_EXT_FRAGMENT &&
		    next != IPV6_EXT_AH && next != IPV6_EXT_DSTOPTS) {
			*proto = next;
			return 1;
		}
		__u8 h[4]; /* next header, length; a fragment's offset */
		if (bpf_skb_load_bytes(skb, *l4, h, sizeof(h)))
			return 0;
		if (next == IPV6_EXT_FRAGMENT) {
			if ((((__u16)h[2] << 8) | h[3]) & 0xfff8)
				return 0;
			*l4 += 8;
		} else if (next == IPV6_EXT_AH) {
			*l4 += ((__u32)h[1] + 2) * 4;
		} else {
			*l4 += ((__u32)h[1] + 1) * 8;
		}
		next = h[0];
	}
	return 0;
}

/* The flow of a connection request (a TCP SYN without ACK), or of any TCP
 * segment with every_segment, or a UDP or UDP-Lite datagram, addresses in
 * the policy's form; 0 for any other packet (the rest of a TCP connection
 * was decided at its SYN). IPv6 extension headers before the transport
 * header are walked (skip_ipv6_ext). */
static __always_inline int parse_packet(struct __sk_buff *skb, struct policy_flow *f, __u32 *seq, int every_segment)
{
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
			return 0;
		if (ip.frag & bpf_htons(0x1fff)) /* a later fragment: no ports */
			return 0;
		f->family = 4, f->proto = ip.proto, l4 = (ip.vihl & 0xf) * 4;
		__builtin_memcpy(f->saddr, &ip.saddr, 4);
		__builtin_memcpy(f->daddr, &ip.daddr, 4);
	} else if (skb->protocol == ETH_P_IPV6_BE) {
		struct {
			__u32 vtcfl;
			__u16 len;
			__u8 next, hops;
			__u8 saddr[16], daddr[16];
		} ip6;
		if (bpf_skb_load_bytes(skb, 0, &ip6, sizeof(ip6)))
			return 0;
		f->family = policy_addr(ip6.saddr, f->saddr), l4 = sizeof(ip6);
		policy_addr(ip6.daddr, f->daddr);
		if (!skip_ipv6_ext(skb, ip6.next, &f->proto, &l4))
			return 0;
	} else {
		return 0;
	}
	__u8 ports_flags[14];
	if (f->proto == IPPROTO_TCP) {
		if (bpf_skb_load_bytes(skb, l4, ports_flags, 14))
			return 0;
		if (!every_segment && (ports_flags[13] & (TCP_FLAG_SYN | TCP_FLAG_ACK)) != TCP_FLAG_SYN)
			return 0;
	} else if (f->proto == IPPROTO_UDP || f->proto == IPPROTO_UDPLITE) {
		if (bpf_skb_load_bytes(skb, l4, ports_flags, 4))
			return 0;
	} else {
		return 0;
	}
	f->sport = ((__u16)ports_flags[0] << 8) | ports_flags[1];
	f->dport = ((__u16)ports_flags[2] << 8) | ports_flags[3];
	*seq = 0;
	if (f->proto == IPPROTO_TCP)
		*seq = ((__u32)ports_flags[4] << 24) | ((__u32)ports_flags[5] << 16) | ((__u32)ports_flags[6] << 8) | ports_flags[7];
	return 1;
}

static __always_inline int parse_flow(struct __sk_buff *skb, struct policy_flow *f, __u32 *seq)
{
	return parse_packet(skb, f, seq, 0);
}

/* Who sends to a socket of the scope: a connection request to a listener
 * or a UDP datagram is judged by the ingress rules on its sender (its
 * cgroups, where a peer cgroup's program wrote them, and its address) and
 * the port it is sent to. */
SEC("cgroup_skb/ingress")
int shunt_policy_ingress(struct __sk_buff *skb)
{
	struct policy_flow f = {};
	__u32 seq;
	if (!parse_flow(skb, &f, &seq))
		return 1;
	__u32 rule = 0;
	__u8 action = decide(active_slot(), pcfg.scope, POLICY_INGRESS, f.family, f.saddr, f.dport, f.proto, &rule,
			     &policy_senders, &f, &seq);
	if (!action)
		return 1;
	count(rule, f.proto == IPPROTO_TCP ? POLICY_HOOK_CONNECT : POLICY_HOOK_SEND);
	return action == POLICY_ALLOW;
}

/* Sends the connect and sendmsg hooks never see, judged by the egress rules
 * per packet (a denied one fails the send with EPERM): a raw socket's
 * (CAP_NET_RAW: a hand-built datagram or segment), and a connected UDP-Lite
 * socket's (UDP-Lite has no pre_connect, so its connect(2) runs no cgroup
 * hook, and a connected socket's sends run no sendmsg hook). Other sockets
 * cost the loads of the two tests below. */
SEC("cgroup_skb/egress")
int shunt_policy_egress(struct __sk_buff *skb)
{
	struct bpf_sock *sk = skb->sk;
	if (!sk)
		return 1;
	sk = bpf_sk_fullsock(sk);
	if (!sk)
		return 1;
	int raw = sk->type == SOCK_RAW;
	if (!raw && (sk->protocol != IPPROTO_UDPLITE || !sk->dst_port))
		return 1;
	struct policy_flow f = {};
	__u32 seq;
	if (!parse_packet(skb, &f, &seq, raw))
		return 1;
	__u32 rule = 0;
	__u8 action = decide(active_slot(), pcfg.scope, POLICY_EGRESS, f.family, f.daddr, f.dport, f.proto, &rule, NULL, NULL, NULL);
	if (!action)
		return 1;
	count(rule, POLICY_HOOK_SEND);
	return action == POLICY_ALLOW;
}

/* Attached to each cgroup a peer rule names: writes down, for each
 * connection request and datagram its sockets send, the sender's cgroups,
 * for the receiver's ingress program to find. */
SEC("cgroup_skb/egress")
int shunt_policy_peer_egress(struct __sk_buff *skb)
{
	struct policy_flow f = {};
	__u32 seq;
	if (!parse_flow(skb, &f, &seq))
		return 1;
	__u64 own = bpf_skb_cgroup_id(skb);
	__u32 stamp = now_ms();
	/* A connection request under its sequence number alone: found so
	 * whether or not translation rewrote the flow on its way, and a later
	 * socket that reuses the port sends another. */
	if (f.proto == IPPROTO_TCP)
		isn_flow(&f, seq);
	struct policy_sender *known = bpf_map_lookup_elem(&policy_senders, &f);
	/* Written already: by a nested peer cgroup's copy of this program,
	 * or for an earlier packet (a retransmitted SYN, a datagram of the
	 * flow). A datagram renews the stamp now and then, not at each send
	 * (a map write each). */
	if (known && known->n && known->cgroups[(known->n - 1) & (POLICY_PEER_LEVELS - 1)] == own) {
		if (f.proto == IPPROTO_TCP || stamp - known->stamp > POLICY_UDP_SENDER_MS / 8)
			known->stamp = stamp;
		return 1;
	}
	struct policy_sender s = { .stamp = stamp };
	for (int l = 1; l <= POLICY_PEER_LEVELS; l++) {
		__u64 id = bpf_skb_ancestor_cgroup_id(skb, l);
		if (!id)
			break;
		s.cgroups[l - 1] = id;
		s.n = l;
	}
	bpf_map_update_elem(&policy_senders, &f, &s, BPF_ANY);
	return 1;
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

/* The sweep's walk over the scopes above a socket, by bpf_loop: each level
 * may look up address and peer rules, too much to verify unrolled. */
struct scope_walk {
	struct policy_flow f; /* the flow an accepted connection's peer sent */
	__u8 addr[16];
	__u64 cg;             /* struct cgroup *, read through CO-RE */
	__u32 slot;
	__u32 rule;           /* out: the rule that denied */
	__u16 port;
	__u8 dir, family, proto;
	__u8 denied;          /* out */
};

static long scope_step(__u64 l, void *data)
{
	struct scope_walk *w = data;
	struct cgroup *cg = (struct cgroup *)w->cg;
	if (l > BPF_CORE_READ(cg, level))
		return 1;
	struct cgroup *anc = NULL;
	bpf_core_read(&anc, sizeof(anc), &cg->ancestors[l]);
	if (!anc)
		return 0;
	__u64 id = BPF_CORE_READ(anc, kn, id);
	__u32 rule = 0;
	/* Only ingress has peer rules: egress never looks f up. */
	__u8 action = decide(w->slot, id, w->dir, w->family, w->addr, w->port, w->proto, &rule,
			     &policy_conn_senders, &w->f, NULL);
	if (!action || action == POLICY_ALLOW)
		return 0;
	w->rule = rule;
	w->denied = 1;
	return 1;
}

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
	struct scope_walk w = {
		.dir = dir,
		.proto = proto,
		.port = dir == POLICY_INGRESS ? r->local_port : r->remote_port,
		.slot = active_slot(),
	};
	w.family = policy_addr(r->remote, w.addr);
	/* An accepted connection's sender is its peer: found by the
	 * handshake's sequence numbers first (the flow it collected under is
	 * not this one if translation rewrote it, a Service's DNAT, and may be
	 * another's that shares it), else by the flow as the peer sent its
	 * SYN. Built in place: the stack holds no second key on 6.1. */
	int by_isns = 0;
	if (proto == IPPROTO_TCP && dir == POLICY_INGRESS) {
		isn_pair_flow(&w.f, sk, 0);
		by_isns = bpf_map_lookup_elem(&policy_conn_senders, &w.f) != NULL;
	}
	if (!by_isns) {
		__builtin_memset(&w.f, 0, sizeof(w.f));
		w.f.family = w.family, w.f.proto = proto, w.f.sport = r->remote_port, w.f.dport = r->local_port;
		__builtin_memcpy(w.f.saddr, w.addr, 16);
		policy_addr(r->local, w.f.daddr);
	}
	w.cg = (__u64)BPF_CORE_READ(sk, sk_cgrp_data.cgroup);
	if (!w.cg)
		return;
	bpf_loop(POLICY_MAX_DEPTH, scope_step, &w, 0);
	if (!w.denied)
		return;
	s.rule = w.rule;
	r->cookie = bpf_get_socket_cookie(sk);
	r->netns_cookie = BPF_CORE_READ(sk, __sk_common.skc_net.net, net_cookie);
	r->family = sk->__sk_common.skc_family;
	/* Finding only, user space counts what sock_diag closes. */
	if (!pcfg.sweep_finds_only) {
		r->err = bpf_sock_destroy(skc);
		if (!r->err)
			count(w.rule, POLICY_HOOK_SWEEP);
	}
	bpf_seq_write(meta->seq, &s, sizeof(s));
}

/* Before a sweep that needs them (peer rules): every TCP connection's
 * cgroups, under the flow its SYN had if it connected, or the one the
 * peer's SYN-ACK had if it accepted (the sweep looks its accepted
 * connections' peers up by the first). */
SEC("iter/tcp")
int shunt_policy_collect_tcp(struct bpf_iter__tcp *ctx)
{
	struct sock_common *skc = ctx->sk_common;
	struct sock *sk = skc ? iter_tcp_conn(skc) : NULL;
	if (!sk)
		return 0;
	struct cgroup *cg = BPF_CORE_READ(sk, sk_cgrp_data.cgroup);
	if (!cg)
		return 0;
	__u8 local[16], remote[16];
	__u16 lport, rport;
	sk_addrs(sk, local, &lport, remote, &rport);
	struct policy_flow f = { .proto = IPPROTO_TCP, .sport = lport, .dport = rport };
	f.family = policy_addr(local, f.saddr);
	policy_addr(remote, f.daddr);

	struct policy_sender snd = {};
	int level = BPF_CORE_READ(cg, level);
	/* The levels the peer egress program writes. */
	for (int l = 1; l <= POLICY_PEER_LEVELS; l++) {
		if (l > level)
			break;
		struct cgroup *anc = NULL;
		bpf_core_read(&anc, sizeof(anc), &cg->ancestors[l]);
		snd.cgroups[l - 1] = anc ? BPF_CORE_READ(anc, kn, id) : 0;
		snd.n = l;
	}
	bpf_map_update_elem(&policy_conn_senders, &f, &snd, BPF_ANY);
	/* And under its handshake's sequence numbers, as if it connected:
	 * the sweep finds an accepted connection's peer by them when
	 * translation between the ends rewrote the flow. */
	isn_pair_flow(&f, sk, 1);
	bpf_map_update_elem(&policy_conn_senders, &f, &snd, BPF_ANY);
	return 0;
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
