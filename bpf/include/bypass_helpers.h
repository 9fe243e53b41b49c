/* Small helpers shared by the bypass programs. */
#pragma once

#include <linux/bpf.h>
#include <bpf/bpf_helpers.h>
#include <bpf/bpf_endian.h>
#include "bypass_keys.h"
#include "bypass_maps.h"
#include "sock_addr.h"

static __always_inline void count_n(__u32 which, __u64 n)
{
	__u64 *v = bpf_map_lookup_elem(&counters, &which);
	if (v)
		*v += n;
}

static __always_inline void count(__u32 which)
{
	count_n(which, 1);
}

/* Fill the connection tuple from a sock_ops context. is_client says which of
 * local/remote is the client. Returns 0 on success, -1 for non-IP sockets.
 */
static __always_inline int tuple_from_skops(struct bpf_sock_ops *skops, struct tuple *t, int is_client)
{
	__u16 lport, rport;

	if (skops_addrs(skops, is_client ? t->client_ip : t->server_ip,
			is_client ? t->server_ip : t->client_ip, &lport, &rport))
		return -1;
	t->client_port = is_client ? lport : rport;
	t->server_port = is_client ? rport : lport;
	return 0;
}

/* Whether two tuples are the same (BPF has no memcmp). Compared a 16-bit
 * word at a time (a tuple is 2-aligned), in a loop: unrolled, the
 * comparisons' spills took sockops past the 512-byte stack. */
static __always_inline int same_tuple(const struct tuple *a, const struct tuple *b)
{
	const __u16 *x = (const __u16 *)a, *y = (const __u16 *)b;
#pragma clang loop unroll(disable)
	for (int i = 0; i < (int)(sizeof(struct tuple) / 2); i++)
		if (x[i] != y[i])
			return 0;
	return 1;
}
