/* Small helpers shared by the bypass programs. */
#pragma once

#include <linux/bpf.h>
#include <bpf/bpf_helpers.h>
#include <bpf/bpf_endian.h>
#include "shunt_keys.h"
#include "shunt_maps.h"

#ifndef AF_INET
#define AF_INET 2
#endif
#ifndef AF_INET6
#define AF_INET6 10
#endif

static __always_inline void count(__u32 which)
{
	__u64 *v = bpf_map_lookup_elem(&counters, &which);
	if (v)
		(*v)++;
}

/* Store an IPv4 address as ::ffff:a.b.c.d. */
static __always_inline void ip4_mapped(__u8 dst[16], __u32 ip4_be)
{
	__builtin_memset(dst, 0, 10);
	dst[10] = 0xff;
	dst[11] = 0xff;
	__builtin_memcpy(&dst[12], &ip4_be, 4);
}

/* Fill the connection tuple from a sock_ops context. is_client says which of
 * local/remote is the client. Returns 0 on success, -1 for non-IP sockets.
 */
static __always_inline int tuple_from_skops(struct bpf_sock_ops *skops, struct tuple *t, int is_client)
{
	__u8 *local_ip = is_client ? t->client_ip : t->server_ip;
	__u8 *remote_ip = is_client ? t->server_ip : t->client_ip;
	/* local_port is host order; remote_port is network order in the upper
	 * half on little-endian, so ntohl() yields host order. */
	__u16 lport = (__u16)skops->local_port;
	__u16 rport = (__u16)bpf_ntohl(skops->remote_port);

	if (skops->family == AF_INET) {
		ip4_mapped(local_ip, skops->local_ip4);
		ip4_mapped(remote_ip, skops->remote_ip4);
	} else if (skops->family == AF_INET6) {
		/* Read each word on its own: clang would merge neighbours into
		 * 8-byte loads, which the verifier rejects on this context. */
		__u32 l[4], r[4];
#pragma unroll
		for (int i = 0; i < 4; i++) {
			l[i] = *(volatile __u32 *)&skops->local_ip6[i];
			r[i] = *(volatile __u32 *)&skops->remote_ip6[i];
		}
		__builtin_memcpy(local_ip, l, 16);
		__builtin_memcpy(remote_ip, r, 16);
	} else {
		return -1;
	}
	t->client_port = is_client ? lport : rport;
	t->server_port = is_client ? rport : lport;
	return 0;
}
