/* Keys and values of the policy maps, shared with Go (bpf2go -type). */
#pragma once

#include <linux/types.h>
#include "reaped.h"

/* Rules one address can meet in one scope: those of the longest prefix
 * holding it and of every shorter prefix covering that one. */
#define POLICY_LIST_LEN 32
#define POLICY_MAX_RULES 16384
#define POLICY_MAX_SCOPES 1024

enum policy_action {
	POLICY_ALLOW = 1,
	POLICY_DENY = 2,
};

/* What policy_state holds, by key. */
enum policy_state_key {
	POLICY_STATE_ACTIVE,      /* the slot in force, 0 or 1 */
	POLICY_STATE_IDLE_CLEAN,  /* 1: the idle slot holds exactly what its rule infos say */
	POLICY_STATE_FINDS_ONLY,  /* 1: the sweep finds, user space closes (no bpf_sock_destroy) */
	POLICY_STATE_KEYS,
};

/* Which way a rule looks: egress rules see where a scope's sockets connect
 * and send, ingress rules who connects and sends to them. */
enum policy_dir {
	POLICY_EGRESS = 0,
	POLICY_INGRESS = 1,
};

/* What a counter counts: which hook decided. */
enum policy_hook {
	POLICY_HOOK_CONNECT,
	POLICY_HOOK_SEND,
	POLICY_HOOK_SWEEP,
};

/* The LPM trie's key. Two rulesets live side by side (slot 0 and 1), so
 * an apply writes the new one while the old one decides, then flips
 * policy_state[POLICY_STATE_ACTIVE]. IPv4 (and IPv4-mapped IPv6) addresses are family 4 with
 * the address in addr[0..3], so an IPv6 prefix never covers them. */
struct policy_key {
	__u32 prefixlen; /* POLICY_KEY_FIXED_BITS + the CIDR's bits */
	__u8 slot;
	__u8 family; /* 4 or 6 */
	__u8 dir;    /* enum policy_dir */
	__u8 _pad;
	__u64 scope; /* cgroup id */
	__u8 addr[16];
};

#define POLICY_KEY_FIXED_BITS ((1 + 1 + 2 + 8) * 8)

/* One rule as the programs see it; ports in host order, both inclusive. */
struct policy_entry {
	__u16 port_lo;
	__u16 port_hi;
	__u8 proto; /* 0: any, else IPPROTO_TCP or IPPROTO_UDP */
	__u8 action;
	__u16 _pad;
	__u32 rule; /* counter id */
};

/* The rules of a prefix then those of the prefixes covering it, in the
 * order they take precedence: the first that matches port and protocol
 * decides. */
struct policy_list {
	__u32 n;
	__u32 _pad;
	struct policy_entry e[POLICY_LIST_LEN];
};

struct policy_scope_key {
	__u64 scope; /* cgroup id */
	__u32 slot;
	__u32 _pad;
};

/* A scope's defaults, by enum policy_dir. */
struct policy_scope {
	__u32 default_rule[2]; /* counter ids of the defaults */
	__u8 default_action[2];
	__u8 has_peer_rules[2]; /* 1: look the sender's cgroups up first */
	__u8 _pad[4];
};

/* Peer rules: those naming the sender's cgroup (a subtree) instead of an
 * address, one list per scope, direction and named cgroup, in the order
 * they take precedence. A hash, looked up once per cgroup above the
 * sender, deepest first. */
struct policy_peer_key {
	__u64 scope; /* cgroup id */
	__u64 peer;  /* cgroup id the rules name */
	__u8 slot;
	__u8 dir;
	__u8 _pad[6];
};

/* How deep a sender's cgroup may be for peer rules to see all of its
 * ancestors (the root is level 0; a kubelet pod's container is level 4). */
#define POLICY_PEER_LEVELS 16

/* A connection request or datagram as its sender put it on the wire: the
 * key under which the sender's cgroups are found by the receiver. */
/* How long a UDP sender entry vouches for the flow's datagrams after the
 * peer's last one left, in milliseconds: longer than a datagram takes from
 * a host's egress to its ingress, short enough that a socket of another
 * cgroup must reuse the port at once to be let in on the peer's word. */
#define POLICY_UDP_SENDER_MS 250

/* A connection request's sender is written under its sequence number alone
 * (family POLICY_FLOW_BY_ISN, the number in saddr's first 4 bytes, stamped
 * with the time it left): address translation on the way (a Service's DNAT,
 * masquerade) rewrites the addresses and ports the receiver sees, never the
 * sequence number. Taken within POLICY_ISN_SENDER_MS: past a SYN's
 * retransmissions (each renews it). (A peer program loaded before wrote
 * requests under their flow, stamped with the sequence number.)
 * policy_conn_senders holds open connections also by both of the
 * handshake's sequence numbers, the client's then the server's, in saddr's
 * first 8 bytes. */
#define POLICY_FLOW_BY_ISN 1
#define POLICY_ISN_SENDER_MS 10000

struct policy_flow {
	__u8 family; /* 4 (IPv4 and IPv4-mapped) or 6; or POLICY_FLOW_BY_ISN */
	__u8 proto;
	__u16 sport; /* host order */
	__u16 dport;
	__u16 _pad;
	__u8 saddr[16];
	__u8 daddr[16];
};

/* The sender's cgroup ids from the root down: cgroups[0] is its ancestor at
 * level 1, cgroups[n - 1] its own (or, deeper than POLICY_PEER_LEVELS, its
 * ancestor at that level). */
struct policy_sender {
	__u32 n;
	/* policy_senders: which packet it was written for, so that a later
	 * socket reusing the flow's source port is not taken for the sender:
	 * the time it left in milliseconds (or, in an entry by flow that a
	 * peer program from before wrote for a connection request, its
	 * sequence number). Not used in policy_conn_senders. */
	__u32 stamp;
	__u64 cgroups[POLICY_PEER_LEVELS];
};

/* Per rule, per CPU. */
struct policy_counter {
	__u64 connects; /* connect() calls (ingress: connection requests) it decided */
	__u64 sends;    /* unconnected UDP sends (ingress: datagrams) it decided */
	__u64 closed;   /* open connections an apply's sweep closed by it */
};

/* What the sweep reports for each connection it closed (or, before 6.5,
 * found for sock_diag to close): what reap reports, and the rule. */
struct policy_swept {
	struct reaped r;
	__u32 rule;
	__u32 _pad;
};

/* A rule as it was given, for `shunt policy show`: the programs never read
 * this. Keyed by struct policy_rule_key. */
struct policy_rule_key {
	__u32 slot;
	__u32 rule;
};

struct policy_rule_info {
	__u64 scope;
	__u8 addr[16]; /* family 0 (a peer rule): the peer cgroup's id in the first 8 */
	__u16 port_lo;
	__u16 port_hi;
	__u8 bits; /* prefix length */
	__u8 family; /* 4, 6, or 0 for a peer rule */
	__u8 proto;
	__u8 action;
	__u32 seq; /* position in the scope's rules; ~0 for the default */
	__u8 dir;  /* enum policy_dir */
	__u8 _pad[7];
};

/* policy_conns: how a socket of a scope got its connection. */
enum policy_conn {
	POLICY_CONN_CONNECTED = 1, /* its egress rules apply */
	POLICY_CONN_ACCEPTED = 2,  /* its ingress rules apply */
};
