/* Maps of the policy. Go pins all of them under the policy's dir; each
 * scope's programs and the sweep reuse them. */
#pragma once

#include <linux/bpf.h>
#include <bpf/bpf_helpers.h>
#include "policy_keys.h"

struct {
	__uint(type, BPF_MAP_TYPE_LPM_TRIE);
	__uint(map_flags, BPF_F_NO_PREALLOC);
	__uint(max_entries, 2 * POLICY_MAX_RULES);
	__type(key, struct policy_key);
	__type(value, struct policy_list);
} policy_rules SEC(".maps");

struct {
	__uint(type, BPF_MAP_TYPE_HASH);
	__uint(max_entries, 2 * POLICY_MAX_SCOPES);
	__type(key, struct policy_scope_key);
	__type(value, struct policy_scope);
} policy_scopes SEC(".maps");

/* Indexed by enum policy_state_key; the programs read the slot in force. */
struct {
	__uint(type, BPF_MAP_TYPE_ARRAY);
	__uint(max_entries, POLICY_STATE_KEYS);
	__type(key, __u32);
	__type(value, __u32);
} policy_state SEC(".maps");

/* Created by Go for every rule and scope default it installs; the programs
 * only look up, so a rule's counts start at zero and outlive no rule. */
struct {
	__uint(type, BPF_MAP_TYPE_PERCPU_HASH);
	__uint(max_entries, 2 * (POLICY_MAX_RULES + POLICY_MAX_SCOPES));
	__type(key, __u32);
	__type(value, struct policy_counter);
} policy_counters SEC(".maps");

/* Marks sockets that connected while a scope held them: the sweep closes
 * only those (an accepted connection was never the scope's egress). */
struct {
	__uint(type, BPF_MAP_TYPE_SK_STORAGE);
	__uint(map_flags, BPF_F_NO_PREALLOC);
	__type(key, int);
	__type(value, __u8);
} policy_conns SEC(".maps");

struct {
	__uint(type, BPF_MAP_TYPE_HASH);
	__uint(max_entries, 2 * (POLICY_MAX_RULES + POLICY_MAX_SCOPES));
	__type(key, struct policy_rule_key);
	__type(value, struct policy_rule_info);
} policy_rule_infos SEC(".maps");

struct {
	__uint(type, BPF_MAP_TYPE_HASH);
	__uint(map_flags, BPF_F_NO_PREALLOC);
	__uint(max_entries, 2 * POLICY_MAX_RULES);
	__type(key, struct policy_peer_key);
	__type(value, struct policy_list);
} policy_peer_rules SEC(".maps");

/* Senders of connection requests and datagrams in flight, written by the
 * peer cgroups' egress program, read by the receivers' ingress program.
 * An entry is needed only until its packet is received: least recently
 * used ones go. */
struct {
	__uint(type, BPF_MAP_TYPE_LRU_HASH);
	__uint(max_entries, 16384);
	__type(key, struct policy_flow);
	__type(value, struct policy_sender);
} policy_senders SEC(".maps");

/* Senders of the open connections, by flow as their peer sees it: written
 * by the collecting iterator before a sweep that needs them, emptied by
 * user space after it. */
struct {
	__uint(type, BPF_MAP_TYPE_HASH);
	__uint(map_flags, BPF_F_NO_PREALLOC);
	__uint(max_entries, 1 << 20);
	__type(key, struct policy_flow);
	__type(value, struct policy_sender);
} policy_conn_senders SEC(".maps");
