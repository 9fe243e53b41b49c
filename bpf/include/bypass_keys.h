/* Keys and values shared between the BPF programs and Go (via bpf2go). */
#pragma once

#include <linux/types.h>

/* A TCP connection seen from the client (the side that called connect).
 * Addresses are always 16 bytes: IPv4 is stored IPv4-mapped (::ffff:a.b.c.d)
 * so an AF_INET socket pairs with an AF_INET6 socket using a mapped address.
 * Ports are host byte order.
 */
struct tuple {
	__u8 client_ip[16];
	__u8 server_ip[16];
	__u16 client_port;
	__u16 server_port;
};

enum role {
	ROLE_CLIENT = 1,
	ROLE_SERVER = 2,
};

/* Key of a socket in the sockhash. A socket's (netns, tuple) is unique on
 * the host while it is open, so this key can never name two live sockets:
 * identical addresses in different namespaces differ in netns.
 */
struct sock_key {
	__u64 netns;
	struct tuple tuple;
	__u32 role;
};

/* Handshake registry: the server side records each connection request by
 * its two initial sequence numbers while the handshake runs, so the client
 * learns at ESTABLISHED that its peer is on this host and enabled, and both
 * learn each other's netns and tuple.
 */
enum pending_state {
	PENDING_REGISTERED = 0, /* server saw the SYN */
	PENDING_CLAIMED = 1,    /* client joined; server may pair */
	PENDING_AMBIGUOUS = 2,  /* registered or claimed twice: never pair */
};

struct pending {
	__u64 server_netns;
	__u64 client_netns;
	__u32 state;        /* enum pending_state */
	__u32 nonce;        /* the claimant's: its handshake ACK carries it (set at its claim) */
	__u32 translated;   /* the client's tuple is not the server's (set at its claim) */
	__u32 pad;
};

/* A connection's two initial sequence numbers. Address translation (DNAT,
 * REDIRECT, SNAT, masquerade) rewrites addresses and ports, not sequence
 * numbers, so both ends see the same pair; the server's is known only to the
 * client its SYN-ACK reached. */
struct isn_pair {
	__u32 client_isn;
	__u32 server_isn;
};

/* A handshake registered by its sequence numbers (the server's request
 * socket): the two ends' tuples may differ, so each records its own for the
 * other. */
struct isn_pending {
	struct pending p;
	struct tuple server; /* as the server sees it */
	struct tuple client; /* as the client sees it, written at its claim */
};

/* Per-socket state in socket-local storage: freed with the socket, so a
 * closed connection can never leave a stale entry behind.
 */
struct sock_state {
	struct sock_key self;
	struct sock_key peer;
	__u64 created_ns;
	__u64 tx_bytes;    /* bytes this socket sent by redirect */
	__u64 tx_msgs;     /* sendmsg calls redirected */
	__u64 pass_msgs;   /* sends left on the TCP path */
	__u32 flags;       /* enum state_flags */
	__u32 claim_nonce; /* a client's nonce, while the server has not taken it */
	__u64 cgroup_id;   /* the socket's cgroup (v2 id), the key of its cgroup_sends */
	struct isn_pair claim; /* a client's handshake, the key of its claim */
	__u64 small_since; /* when its run of small sends began */
	__u32 small_run;   /* small sends TCP would gather, in a row, no read between */
	__u32 behind_run;  /* bytes sent by TCP in a row while its peer's reader was behind (reader_behind) */
};

/* What one cgroup's bypassed sockets sent, per CPU. Sends of its sockets
 * that shunt does not hold go by TCP uncounted. */
struct cgroup_traffic {
	__u64 redirected_bytes;
	__u64 redirected_sends;
	__u64 tcp_bytes;   /* sends that took TCP although the socket is held */
	__u64 tcp_sends;
};

enum state_flags {
	STATE_FALLBACK = 1,  /* this direction left the redirect path for good (shunt is being removed) */
	STATE_THROTTLED = 2, /* the peer's reader is behind: sends take TCP until it catches up */
	STATE_READS = 4,     /* this socket's reader used recv/read: its peer may redirect to it */
	STATE_TCP_READER = 8, /* its reader blocks in recv, asked for MSG_WAITALL or splices: its peer's sends stay on TCP */
	STATE_SPLICE = 16,    /* its reader called splice(2) on it (with STATE_TCP_READER) */
	STATE_CAUGHT = 32,    /* ... while redirected bytes it can never splice were queued (peer_refs only) */
	STATE_WATCHED = 64,   /* a read left bytes queued that this kernel's FIONREAD does not count: the stall watch runs (peer_refs only) */
	STATE_RESCUED = 128,  /* its reader stopped with such bytes queued: sent back to TCP and woken (peer_refs only) */
	STATE_WOKEN = 256,    /* the stall watch woke its reader, which had only redirected bytes hidden (peer_refs only) */
	STATE_MAY_SPLICE = 512, /* its reader's program was just learned splicing, or it reads by TCP_ZEROCOPY_RECEIVE or peeks in mid-stream: redirects only behind bytes still queued, past the backlog bound too (peer_refs only) */
	STATE_CUT_SHORT = 1024, /* caught, and its peer's end of stream came before the guard's reset: the splice returned it first (peer_refs only) */
	STATE_TCP_BEHIND = 2048, /* flow control sent its peer's bytes by TCP while redirected ones may have been unread: TCP bytes can wait behind a drained psock (peer_refs only) */
	STATE_SPLICE_REFUSED = 4096, /* a splice from it was refused (--refuse-splice) and its reader has not read since (peer_refs only) */
	STATE_EOF_SEEN = 8192, /* a recv returned 0 with the end come and nothing queued: its reader was told of the peer's end (peer_refs only) */
	STATE_PEEKED = 16384,  /* its reader peeked at every redirected byte queued with TCP bytes behind them, and has not read since (watch_boundary_peek; sock_state only) */
	STATE_SMALL_WRITES = 32768, /* its peer's writer streams small sends TCP would gather: its reader's next read sends the connection back to TCP (peer_refs only) */
	STATE_PROBE = 65536,   /* its reader is its program's probe: its reads tell whether the program splices after recv (admit_reader; sock_state only) */
	STATE_HELD = 131072,   /* its reader read by TCP while its program was on probation (counted once; sock_state only) */
	STATE_TOLD_SHORT = 262144, /* FIONREAD, not corrected here, told its reader fewer bytes than were queued: the stall scan of its process rescues it (peer_refs only) */
};

/* Record written by the flows iterator. */
struct flow_record {
	__u64 cookie;
	__u64 cgroup_id;
	__u32 tcp_state;
	__u32 _pad;
	struct sock_state state;
};

/* Mutable control word, one entry. */
struct control_word {
	__u32 draining; /* 1: pass every send to TCP, so receive queues drain */
	/* Where a task's system call registers sit from the base of its
	 * kernel stack (0: not known yet), noted by the reader watch for
	 * sk_msg, which has no bpf_task_pt_regs (urgent_send). */
	__u32 regs_at;
};

/* Counters for events the user may want to see in `shunt status`. */
enum counter {
	CNT_REGISTERED = 0,
	CNT_AMBIGUOUS,
	CNT_REGISTRY_FULL,
	CNT_PAIRED,
	CNT_UNPAIRED,
	CNT_INSERT_FAILED,
	CNT_FALLBACK,   /* directions moved to TCP for good */
	CNT_THROTTLED,  /* times a direction was throttled */
	CNT_ZEROCOPY,   /* connections left on TCP: an end set SO_ZEROCOPY */
	CNT_EXCLUDED,   /* connections left on TCP: server port excluded */
	CNT_TCP_READER, /* directions kept on TCP: the reader blocks in recv or used MSG_WAITALL */
	CNT_LEFT,       /* sockets moved back to plain TCP (out of the sockhash) */
	CNT_EAGAIN,     /* blocking reads that failed with EAGAIN (a signal or wake-up without data) */
	CNT_SPLICE_READER, /* sockets whose reader spliced: sent back to TCP */
	CNT_SPLICE_CAUGHT, /* ... of which had redirected bytes queued that splice cannot read */
	CNT_LEARNED_READER, /* readers kept on TCP because their program was seen splicing */
	CNT_REFUSED_SENDS,  /* sends refused (EACCES): the peer splices with redirected bytes unread */
	CNT_SPLICE_REFUSED, /* splice(2) calls from a bypassed socket refused (EINVAL) before reading: the application reads instead */
	CNT_ZEROCOPY_REFUSED, /* setsockopt(SO_ZEROCOPY) on a bypassed socket refused (EOPNOTSUPP) */
	CNT_CGROUPS_FULL,     /* sockets paired whose cgroup found no room in cgroup_sends: their sends are not counted per cgroup */
	CNT_STALL_RESCUED,    /* readers found waiting while bytes sat queued: their connection sent back to TCP and woken */
	CNT_PAIRED_TRANSLATED, /* of CNT_PAIRED: connections whose ends see different tuples (address translation between them) */
	CNT_READER_PORT,       /* connections left unpaired: their server port's reader needed TCP lately */
	CNT_PRESUMED_SPLICER,  /* sockets sent back to TCP when their reader's program was learned splicing */
	CNT_PRESUMED_QUEUED,   /* ... of which held redirected bytes: caught if their reader splices before it reads them */
	CNT_CLAIM_UNBOUND,     /* claims the server declined: the ACK that established it did not carry the claimant's nonce */
	CNT_EVENTS_LOST,       /* guard events the ring had no room for (a caught connection's is tried again) */
	CNT_SPLICE_TRUNCATED,  /* of CNT_SPLICE_CAUGHT: the peer's end of stream came before the guard's reset, and the splice returned it before the redirected bytes */
	CNT_FIONREAD_CORRECTED, /* FIONREAD answers that left out queued bytes (this kernel's, for a socket in a sockhash), corrected */
	CNT_URGENT,            /* connections sent back to TCP: urgent data (MSG_OOB) was sent */
	CNT_RECEIVE_OPTION,    /* connections kept on or sent back to TCP: an end set SO_RCVLOWAT, TCP_INQ, SO_PEEK_OFF or receive timestamps */
	CNT_SPLICE_RETRIED,    /* splices let through: the same socket's last splice was refused and its reader read nothing since */
	CNT_ULP_REFUSED,       /* setsockopt(TCP_ULP) on a bypassed socket refused (ENOENT): kernel TLS and a psock do not mix */
	CNT_UPPER_LAYER,       /* connections left on TCP: an end has an upper layer protocol at pairing (an MPTCP subflow), which a sockhash refuses */
	CNT_TX_TIMESTAMPS,     /* connections kept on or sent back to TCP: an end asked for transmit timestamps (SO_TIMESTAMPING), which only TCP's transmit path makes */
	CNT_ZEROCOPY_RECEIVE,  /* connections kept on or sent back to TCP: an end reads by getsockopt(TCP_ZEROCOPY_RECEIVE), which maps TCP's queue alone */
	CNT_ZEROCOPY_CAUGHT,   /* ... of which had redirected bytes queued that it cannot map: the guard resets them */
	CNT_PEEK_READER,       /* connections sent back to TCP: the reader peeked in mid-stream, and no peek reaches past redirected bytes into TCP's */
	CNT_PEEK_STUCK,        /* readers that peeked at every redirected byte queued three times in a row, reading nothing, with TCP bytes behind them that no peek reaches (reported) */
	CNT_URING_READER,      /* directions kept on or sent back to TCP: the reader reads through io_uring, whose completions say whether bytes are left (a psock's never do) */
	CNT_READER_CLIENT,     /* connections left unpaired: their client process's reads of its connections to that port needed TCP lately */
	CNT_SMALL_WRITES,      /* connections sent back to TCP: a writer with Nagle's algorithm on streamed small sends over a loopback-sized path, which TCP gathers into large segments */
	CNT_BRIEF_PORT,        /* connections left unpaired: their server port's connections were brief lately (a few sends each way) */
	CNT_READER_HELD,       /* readers whose peer's sends took TCP while their program was on probation (admit_reader) */
	CNT_BEHIND_READER,     /* connections sent back to TCP: their reader stayed behind a writer's TCP sends for cfg.behind_bytes in a row, once it made cfg.behind_sends */
	CNT_MAX,
};

#define COMM_LEN 16

/* How much of a process's command line (its argv, NUL-separated, as
 * /proc/PID/cmdline shows it) tells programs apart: an interpreter's
 * script and first arguments. */
#define ARGS_LEN 256
#define ARGS_SHOWN 128

/* A program seen calling splice(2) on a TCP socket: the command name of its
 * process (the thread group leader's comm) and a hash of its command line
 * (FNV-1a 64 of its first ARGS_LEN bytes), so one splicing Python script
 * keeps no other Python program on TCP. args 0 stands for any command line
 * (a program taught by name). Its readers stay on TCP. */
struct splice_program {
	char comm[COMM_LEN];
	__u64 args;
};

/* A server port in one network namespace whose accepted connections'
 * reader needed TCP lately (it blocked in recv, asked for MSG_WAITALL or
 * splices): pid 0. Or, pid set, one client process whose connections to
 * that port needed TCP lately (netns: the client's). */
struct reader_port {
	__u64 netns;
	__u16 port; /* host byte order */
	__u16 _pad;
	__u32 pid;  /* 0: the port's accepted connections; else this client process's (tgid) */
};

struct reader_port_seen {
	__u64 seen_ns; /* bpf_ktime_get_ns() when a reader on it last needed TCP */
	__u64 kept;    /* connections to it left unpaired since it was first seen */
	__u32 pid;     /* that reader's process (tgid) */
	__u32 streak;  /* a client process's: its connections to the port in a row whose reader needed TCP */
	char comm[COMM_LEN];
};

/* A server port's connections from one client address (as the server
 * sees it: a pod's own, behind a Service's translation), in brief_ports. */
struct brief_key {
	__u64 netns;          /* the server's */
	__u8 client_ip[16];
	__u16 port;           /* host byte order */
	__u16 _pad[3];
};

/* Such connections were brief lately. */
struct brief_port {
	__u64 seen_ns;  /* bpf_ktime_get_ns() when a brief connection to it last closed */
	__u64 arrivals; /* connection requests while its streak held */
	__u64 kept;     /* ... of which left unpaired */
	__u32 streak;   /* its paired connections in a row that closed brief */
	__u32 _pad;
};

/* A program's readers of one role (a proxy's accepted and connected
 * sockets are each on probation apart: admit_reader), by command name
 * alone: a server that writes its title over its command line per
 * connection (PostgreSQL's backends: "postgres: user db 127.0.0.1(53412)")
 * would be a new program at each. */
struct recv_key {
	char comm[COMM_LEN];
	__u32 role; /* enum role */
	__u32 _pad;
};

/* A program's readers and redirected bytes (recv_programs). */
struct recv_program {
	__u64 probe;    /* socket cookie of the reader whose reads count (0: none now) */
	__u64 since_ns; /* bpf_ktime_get_ns() when the first probe began */
	__u64 held;     /* its readers kept on TCP meanwhile, the probes too */
	__u32 reads;    /* the probe's reads so far */
	__u32 proven;   /* 1: a probe read cfg.probation_reads times without splicing, or cfg.probation_time_reads times and cfg.probation_ns passed */
};

struct splice_seen {
	__u64 first_ns; /* bpf_ktime_get_ns() when first seen splicing */
	__u64 last_ns;
	__u64 splices;  /* splice calls seen on TCP sockets (counted once per socket for shunt's) */
	__u64 caught;   /* connections caught with redirected bytes queued */
	char cmdline[ARGS_SHOWN]; /* the start of its command line, NULs between arguments */
};

enum event_kind {
	EVENT_SPLICE_CAUGHT = 1,    /* a splice reader with redirected bytes it cannot read */
	EVENT_BLOCKING_EAGAIN = 2,  /* a blocking read failed with EAGAIN where TCP restarts it */
	EVENT_STALL_RESCUED = 3,    /* a reader stopped with bytes queued: wake it (the connection is on its way to TCP) */
	EVENT_WAKE = 4,             /* a socket left with bytes queued that its reader may have been told are not there: wake it */
	EVENT_SPLICE_TRUNCATED = 5, /* a splice reader caught after its peer's end of stream: the splice returned end of stream before the redirected bytes */
	EVENT_ZEROCOPY_CAUGHT = 6,  /* a TCP_ZEROCOPY_RECEIVE reader with redirected bytes it cannot map */
	EVENT_PEEK_STUCK = 7,       /* a reader peeking again and again at redirected bytes, with TCP's behind them out of its sight */
	EVENT_TOLD_SHORT = 8,       /* FIONREAD told a reader fewer bytes than were queued (not corrected here): the guard runs the stall scan over its process */
};

/* What the guard (user space) hears of: a splice reader caught with
 * redirected bytes it cannot read (it resets the connection, so the
 * application sees an error instead of waiting for bytes that never come),
 * a blocking read that a signal, stop or ptrace ended with EAGAIN (it
 * logs it: nothing on 6.18 can give that read TCP's answer), or a reader
 * that waits while bytes sit queued (it wakes the socket from user space:
 * no BPF program can). */
struct guard_event {
	struct sock_key self;  /* the reading socket */
	__u64 cookie;          /* its socket cookie */
	__u64 unread;          /* bytes queued: redirected (caught), or hidden from FIONREAD (stalls) */
	__u32 pid;             /* the process that read */
	__u32 kind;            /* enum event_kind */
	char comm[COMM_LEN];
	__u64 ino;             /* the socket's inode (stalls, a peek caught): finds its descriptor in /proc/PID/fd */
	__u32 found;           /* stalls: enum stall_found */
	__u32 asleep_in;       /* FOUND_BY_WATCH: the system call the reader slept in */
	__u32 fd;              /* stalls: the descriptor + 1 its reader last read it through (a hint; 0: unknown) */
};

/* How a stall was found (0: not said, an install older than the field). */
enum stall_found {
	FOUND_BY_WATCH = 1, /* a read left bytes FIONREAD misses, then cfg.stall_ns asleep in a wait for the socket */
	FOUND_BY_SCAN = 2,  /* the stall scan: nothing read for cfg.scan_stall_ns */
	FOUND_BY_FIONREAD = 3, /* FIONREAD told its reader fewer bytes than were queued (EVENT_TOLD_SHORT), and the stall scan of its process found them still there */
};
