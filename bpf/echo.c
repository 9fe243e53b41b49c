// SPDX-License-Identifier: GPL-2.0
/* Kernel echo for `shunt bench echo`: every byte a socket receives is sent
 * back out of the same socket by an sk_skb verdict, with no process woken.
 * The 2019 Cloudflare SOCKMAP echo experiment, reproduced.
 */
#include <linux/bpf.h>
#include <bpf/bpf_helpers.h>

char __license[] SEC("license") = "GPL";

/* Echo sockets by socket cookie: each redirects to itself. */
struct {
	__uint(type, BPF_MAP_TYPE_SOCKHASH);
	__uint(max_entries, 1024);
	__type(key, __u64);
	__type(value, __u64);
} echo_socks SEC(".maps");

SEC("sk_skb/verdict")
int echo_verdict(struct __sk_buff *skb)
{
	__u64 cookie = bpf_get_socket_cookie(skb);
	/* flags 0: to the socket's send path, i.e. back to the peer. */
	return bpf_sk_redirect_hash(skb, &echo_socks, &cookie, 0);
}
