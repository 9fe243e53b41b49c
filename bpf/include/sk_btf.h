/* Addresses of a kernel struct sock, read through BTF (iterators). */
#pragma once

#include <bpf/bpf_helpers.h>
#include <bpf/bpf_core_read.h>
#include "kernel.h"
#include "sock_addr.h"

/* Local and remote address of a socket in shunt's 16-byte form. */
static __always_inline void sk_addrs(struct sock *sk, __u8 local[16], __u16 *lport, __u8 remote[16],
				     __u16 *rport)
{
	struct sock_common *c = &sk->__sk_common;

	if (c->skc_family == AF_INET) {
		ip4_mapped(local, c->skc_rcv_saddr);
		ip4_mapped(remote, c->skc_daddr);
	} else {
		/* Explicit sizes: local and remote are pointers here. */
		bpf_core_read(local, 16, &c->skc_v6_rcv_saddr);
		bpf_core_read(remote, 16, &c->skc_v6_daddr);
	}
	*lport = c->skc_num;
	*rport = bpf_ntohs(c->skc_dport);
}

/* The full TCP socket an iter/tcp program is at, or NULL for request and
 * timewait sockets (no owner, and kfuncs want full sockets). */
static __always_inline struct sock *iter_tcp_sock(struct sock_common *skc)
{
	if (!skc)
		return NULL;
	return (struct sock *)bpf_skc_to_tcp_sock(skc);
}

/* The TCP socket an iter/tcp program is at if it is a connection (not a
 * listener, not closed), else NULL. */
static __always_inline struct sock *iter_tcp_conn(struct sock_common *skc)
{
	struct sock *sk = iter_tcp_sock(skc);
	if (!sk)
		return NULL;
	__u8 st = sk->__sk_common.skc_state;
	if (st == TCP_LISTEN || st == TCP_CLOSE)
		return NULL;
	return sk;
}

/* The UDP socket an iter/udp program is at if it is connected, else NULL. */
static __always_inline struct sock *iter_udp_conn(struct udp_sock *udp)
{
	struct sock *sk = (struct sock *)udp;
	if (!sk || sk->__sk_common.skc_state != TCP_ESTABLISHED /* connected */)
		return NULL;
	return sk;
}
