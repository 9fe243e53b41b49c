// SPDX-License-Identifier: GPL-2.0
/* shunt reap, iterator method: visit every TCP or UDP socket of the netns
 * the iterator was created in and destroy those connected to the backend.
 * It is the fallback when no index is enabled, and the baseline the index
 * is measured against: its cost grows with every socket of the host. */
#include <linux/bpf.h>
#include <bpf/bpf_helpers.h>
#include <bpf/bpf_core_read.h>

#include "include/kernel.h"
#include "include/sk_btf.h"
#include "include/reaped.h"
#include "include/index_keys.h"

char __license[] SEC("license") = "GPL";

/* Weak: before 6.5 there is none; the iterators then only find (dry_run
 * set, the call pruned) and user space destroys through sock_diag. */
extern int bpf_sock_destroy(struct sock_common *sk) __ksym __weak;

/* Set from Go before load. */
volatile const struct reap_config {
	__u8 addr[16];
	__u16 port;   /* 0: any port */
	__u8 dry_run; /* report, do not destroy */
	__u8 _pad;
} reap_cfg;

/* skc is the iterator's own pointer: the kfunc accepts only that. */
/* Keeps struct reaped in BTF so bpf2go generates its Go twin. */
const struct reaped *unused_reaped __attribute__((unused));

static __always_inline void reap(struct bpf_iter_meta *meta, struct sock_common *skc, struct sock *sk, __u8 proto)
{
	struct reaped r = { .proto = proto };
	sk_addrs(sk, r.local, &r.local_port, r.remote, &r.remote_port);
	if (!r.remote_port || (reap_cfg.port && r.remote_port != reap_cfg.port))
		return;
	for (int i = 0; i < 16; i++)
		if (r.remote[i] != reap_cfg.addr[i])
			return;
	r.cookie = bpf_get_socket_cookie(sk);
	r.netns_cookie = BPF_CORE_READ(sk, __sk_common.skc_net.net, net_cookie);
	r.family = sk->__sk_common.skc_family;
	if (!reap_cfg.dry_run)
		r.err = bpf_sock_destroy(skc);
	bpf_seq_write(meta->seq, &r, sizeof(r));
}

SEC("iter/tcp")
int shunt_reap_tcp(struct bpf_iter__tcp *ctx)
{
	/* One load of the pointer, checked: the kfunc takes only that. */
	struct sock_common *skc = ctx->sk_common;
	struct sock *sk = skc ? iter_tcp_conn(skc) : NULL;
	if (sk)
		reap(ctx->meta, skc, sk, IPPROTO_TCP);
	return 0;
}

SEC("iter/udp")
int shunt_reap_udp(struct bpf_iter__udp *ctx)
{
	struct sock *sk = iter_udp_conn(ctx->udp_sk);
	if (sk)
		reap(ctx->meta, (struct sock_common *)sk, sk, IPPROTO_UDP);
	return 0;
}
