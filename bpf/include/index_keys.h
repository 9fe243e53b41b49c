/* Keys and values of the backend index, shared with Go (via bpf2go). */
#pragma once

#include <linux/types.h>

/* A backend: where a socket is connected to. Address as in sock_addr.h. */
struct backend {
	__u8 addr[16];
	__u16 port;
	__u8 proto; /* IPPROTO_TCP or IPPROTO_UDP */
	__u8 _pad;
};

/* The sockets of one backend sit in slots 0..high-1 of the index, so a
 * lookup by backend visits that backend's slots only, however many sockets
 * the host has. Slots freed by closed sockets are reused. */
struct slot_key {
	struct backend backend;
	__u32 slot;
};

struct backend_state {
	__u32 high; /* slots ever handed out; all live sockets are below it */
	__u32 _pad;
	__u64 live; /* sockets indexed now */
};

enum entry_flags {
	ENTRY_LOCAL_UNKNOWN = 1, /* connected UDP that has not sent yet: no local port */
	ENTRY_SEEDED = 2,        /* found by the start-up sweep, not by a hook */
	ENTRY_BOUND = 4,         /* UDP: had its port before connect, keeps it on disconnect */
};

/* One indexed socket: what a SOCK_DESTROY request needs. */
struct entry {
	__u64 cookie;
	__u64 netns_cookie;
	__u64 since_ns;    /* CLOCK_BOOTTIME when indexed */
	__u8 local[16];
	__u16 local_port;
	__u8 family;       /* AF_INET or AF_INET6: the socket's own family */
	__u8 flags;        /* enum entry_flags */
	__u32 owner_tgid;  /* process that connected, 0 if unknown */
};

/* In and out of shunt_index_find (BPF_PROG_RUN): one run reads FIND_SLOTS
 * slots of a backend, where one map lookup per slot would be one syscall. */
#define FIND_SLOTS 32

struct find_ctx {
	struct backend backend; /* in */
	__u32 start;            /* in: first slot */
	__u32 high;             /* out: the backend's high-water mark (0: unknown backend) */
	__u32 present;          /* out: bit i set if slot start+i holds out[i] */
	struct entry out[FIND_SLOTS];
};

/* Per socket (sk_storage): where its entry is, so close can remove it. */
struct sock_slot {
	struct slot_key key;
	__u32 owner_tgid;
	__u32 indexed;     /* none, inserting or indexed; whoever clears it removes the entry */
	__u32 local_known; /* UDP: the entry has the local address (egress has no more to do) */
	__u32 _pad;
};

enum index_counter {
	ICNT_ADDED,
	ICNT_REMOVED,
	ICNT_FULL,     /* a socket could not be indexed: a map was full */
	ICNT_FILLED,   /* UDP local addresses learnt on first send */
	ICNT_NOT_REMOVED, /* a closed socket's entry stayed: its delete failed four times */
	ICNT_MAX,
};
