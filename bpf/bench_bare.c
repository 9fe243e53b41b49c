// SPDX-License-Identifier: GPL-2.0
/* For `shunt bench` only: the least a redirect needs with shunt's pairing.
 * Find the peer, redirect; no ordering guard, drain switch, flow control or
 * counters, and a missing peer drops the send. Swapped in for the install's
 * sk_msg program to measure what those checks cost; never for real traffic,
 * which is why it is not in the object users load (bpf/bypass.c). It uses
 * the install's own maps (bench/bare replaces them at load). */
#include <linux/bpf.h>
#include <bpf/bpf_helpers.h>

#include "include/bypass_keys.h"
#include "include/bypass_maps.h"

char __license[] SEC("license") = "GPL";

SEC("sk_msg")
int shunt_sk_msg_bare(struct sk_msg_md *msg)
{
	struct bpf_sock *sk = msg->sk;
	if (!sk)
		return SK_PASS;
	struct sock_state *st = bpf_sk_storage_get(&sock_states, sk, 0, 0);
	if (!st)
		return SK_PASS;
	return bpf_msg_redirect_hash(msg, &sock_hash, &st->peer, BPF_F_INGRESS);
}
