/* The kernel's sk_buff behind an sk_skb program's context. Where the kernel
 * has bpf_cast_to_kern_ctx (6.2) its fields are loaded directly; older
 * kernels read them with bpf_probe_read_kernel (probe set from Go; the
 * kfunc is weak, and its calls are pruned there). */
#pragma once

#include <linux/bpf.h>
#include <bpf/bpf_helpers.h>
#include <bpf/bpf_core_read.h>

#include "kernel.h"

extern void *bpf_cast_to_kern_ctx(void *obj) __ksym __weak;

static __always_inline __u32 skb_truesize(struct __sk_buff *skb, __u32 probe)
{
	if (probe)
		return BPF_CORE_READ((struct sk_buff *)skb, truesize);
	struct sk_buff *k = bpf_cast_to_kern_ctx(skb);
	return k->truesize;
}

/* TCP_SKB_CB(skb)->seq: TCP keeps its control block at the start of cb. */
static __always_inline __u32 skb_tcp_seq(struct __sk_buff *skb, __u32 probe)
{
	if (probe) {
		__u32 seq = 0;
		bpf_probe_read_kernel(&seq, sizeof(seq), (void *)skb + bpf_core_field_offset(struct sk_buff, cb));
		return seq;
	}
	struct sk_buff *k = bpf_cast_to_kern_ctx(skb);
	return *(__u32 *)k->cb;
}
