/* Socket addresses as shunt stores them: always 16 bytes, IPv4 as
 * ::ffff:a.b.c.d, so AF_INET and dual-stack AF_INET6 sockets compare equal.
 * Ports are host byte order. */
#pragma once

#include <linux/bpf.h>
#include <bpf/bpf_endian.h>

#ifndef AF_INET
#define AF_INET 2
#endif
#ifndef AF_INET6
#define AF_INET6 10
#endif

static __always_inline void ip4_mapped(__u8 dst[16], __u32 ip4_be)
{
	__builtin_memset(dst, 0, 10);
	dst[10] = 0xff;
	dst[11] = 0xff;
	__builtin_memcpy(&dst[12], &ip4_be, 4);
}

/* Local and remote address of a sock_ops socket. Returns -1 for non-IP. */
static __always_inline int skops_addrs(struct bpf_sock_ops *skops, __u8 local[16], __u8 remote[16],
				       __u16 *lport, __u16 *rport)
{
	/* local_port is host order; remote_port is network order in the upper
	 * half on little-endian, so ntohl() yields host order. */
	*lport = (__u16)skops->local_port;
	*rport = (__u16)bpf_ntohl(skops->remote_port);

	if (skops->family == AF_INET) {
		ip4_mapped(local, skops->local_ip4);
		ip4_mapped(remote, skops->remote_ip4);
		return 0;
	}
	if (skops->family == AF_INET6) {
		/* Read each word on its own: clang would merge neighbours into
		 * 8-byte loads, which the verifier rejects on this context. */
		__u32 l[4], r[4];
#pragma unroll
		for (int i = 0; i < 4; i++) {
			l[i] = *(volatile __u32 *)&skops->local_ip6[i];
			r[i] = *(volatile __u32 *)&skops->remote_ip6[i];
		}
		__builtin_memcpy(local, l, 16);
		__builtin_memcpy(remote, r, 16);
		return 0;
	}
	return -1;
}
