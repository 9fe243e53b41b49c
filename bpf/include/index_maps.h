/* Maps of the backend index. Go pins all of them under the index's dir. */
#pragma once

#include <linux/bpf.h>
#include <bpf/bpf_helpers.h>
#include "index_keys.h"

/* Hash maps cost 16 bytes per bucket up front (one per max entry, rounded
 * up to a power of two) and about 128 bytes per entry in use. */
#define MAX_INDEXED (2 << 20)
#define MAX_BACKENDS (1 << 18)
#define MAX_NETNS 65536

/* Entries are allocated on demand: a preallocated 2M-entry map would pin
 * hundreds of MiB whether or not it is used. */
struct {
	__uint(type, BPF_MAP_TYPE_HASH);
	__uint(map_flags, BPF_F_NO_PREALLOC);
	__uint(max_entries, MAX_INDEXED);
	__type(key, struct slot_key);
	__type(value, struct entry);
} sock_index SEC(".maps");

struct {
	__uint(type, BPF_MAP_TYPE_HASH);
	__uint(map_flags, BPF_F_NO_PREALLOC);
	__uint(max_entries, MAX_BACKENDS);
	__type(key, struct backend);
	__type(value, struct backend_state);
} backends SEC(".maps");

struct {
	__uint(type, BPF_MAP_TYPE_SK_STORAGE);
	__uint(map_flags, BPF_F_NO_PREALLOC);
	__type(key, int);
	__type(value, struct sock_slot);
} sock_slots SEC(".maps");

/* A process last seen connecting from each netns (by netns cookie): user
 * space opens /proc/<tgid>/ns/net to reach a netns it holds no handle to. */
struct {
	__uint(type, BPF_MAP_TYPE_LRU_HASH);
	__uint(max_entries, MAX_NETNS);
	__type(key, __u64);
	__type(value, __u32);
} netns_owners SEC(".maps");

struct {
	__uint(type, BPF_MAP_TYPE_PERCPU_ARRAY);
	__uint(max_entries, ICNT_MAX);
	__type(key, __u32);
	__type(value, __u64);
} index_counters SEC(".maps");
