/* A kernel struct cgroup's place in the hierarchy, read through BTF. */
#pragma once

#include <bpf/bpf_helpers.h>
#include <bpf/bpf_core_read.h>
#include "kernel.h"

/* Whether cg is the cgroup id, at level in the hierarchy, or below it: its
 * ancestor at that level is the one (one read, no walk). */
static __always_inline int cgroup_within(struct cgroup *cg, __u64 id, __u32 level)
{
	if (!cg || BPF_CORE_READ(cg, level) < (int)level)
		return 0;
	struct cgroup *anc = NULL;
	bpf_core_read(&anc, sizeof(anc), &cg->ancestors[level & 0xff]);
	return anc && BPF_CORE_READ(anc, kn, id) == id;
}
