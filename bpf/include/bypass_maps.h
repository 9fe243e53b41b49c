/* Maps of the bypass object. Go pins all of them under the install dir. */
#pragma once

#include <linux/bpf.h>
#include <bpf/bpf_helpers.h>
#include "bypass_keys.h"
#include "kernel.h"

#define MAX_SOCKETS 65536
#define MAX_PENDING 16384

struct {
	__uint(type, BPF_MAP_TYPE_SOCKHASH);
	__uint(max_entries, MAX_SOCKETS);
	__type(key, struct sock_key);
	__type(value, __u64);
} sock_hash SEC(".maps");

struct {
	__uint(type, BPF_MAP_TYPE_SK_STORAGE);
	__uint(map_flags, BPF_F_NO_PREALLOC);
	__type(key, int);
	__type(value, struct sock_state);
} sock_states SEC(".maps");

/* Handshakes by sequence numbers, registered from the server's request
 * socket. LRU: a handshake that never completes is evicted, not swept. */
struct {
	__uint(type, BPF_MAP_TYPE_LRU_HASH);
	__uint(max_entries, MAX_PENDING);
	__type(key, struct isn_pair);
	__type(value, struct isn_pending);
} isn_handshakes SEC(".maps");

struct {
	__uint(type, BPF_MAP_TYPE_ARRAY);
	__uint(max_entries, 1);
	__type(key, __u32);
	__type(value, struct control_word);
} control SEC(".maps");

struct {
	__uint(type, BPF_MAP_TYPE_PERCPU_ARRAY);
	__uint(max_entries, CNT_MAX);
	__type(key, __u32);
	__type(value, __u64);
} counters SEC(".maps");

/* Per-cgroup send counts, keyed by cgroup id; an entry is made when a
 * socket of the cgroup is paired, and deleted by user space once the cgroup
 * is gone. A plain per-CPU hash: its lookup is inlined (an LRU's is not,
 * and measured dearer per send). */
#define MAX_CGROUPS 16384

struct {
	__uint(type, BPF_MAP_TYPE_PERCPU_HASH);
	__uint(max_entries, MAX_CGROUPS);
	__type(key, __u64);
	__type(value, struct cgroup_traffic);
} cgroup_sends SEC(".maps");

/* Each paired socket publishes itself here, so its peer's sk_msg can see how
 * much redirected data it has not read yet (flow control) and how its reader
 * reads (reads: STATE_READS and STATE_TCP_READER, set by shunt_reads). Its
 * timer (leave_timers) takes the socket out of the sockhash when its reader
 * needs plain TCP (leave_timer_cb; it deletes the entry as it does), and checks on
 * a reader that may be waiting for bytes it was told are not there (the
 * stall watch). */
struct peer_ref {
	struct tcp_sock __kptr_untrusted *sk;
	struct sock_key peer;  /* the peer's key: it follows once this socket left */
	__u32 timer;           /* its slot in leave_timers, plus one (0: none) */
	__u32 reads;
	__u32 leaving;         /* the leave timer was started by the peer's leave */
	__u32 splicer_pid;     /* who spliced from it (STATE_SPLICE), for the caught event */
	__u32 unheeded;        /* when its reader last read nothing after a stall watch wake-up (bpf_ktime_get_ns >> 20; 0: never) */
	__u64 cookie;          /* its socket cookie, once it spliced */
	char splicer_comm[COMM_LEN];
	/* Kernels whose psock does not count its queue (no msg_tot_len):
	 * redirected bytes its peer sent it and its reader took, and where TCP
	 * reads had brought copied_seq (a read that did not move it took
	 * redirected bytes). Unused where the kernel counts. */
	__u64 redirected_in;
	__u64 redirected_read;
	__u32 tcp_copied;
	/* Peeks in a row, nothing read between, that showed every redirected
	 * byte queued while TCP held more behind them (watch_boundary_peek). */
	__u32 boundary_peeks;
	/* The leave may not delete before this (bpf_ktime_get_ns): a redirect
	 * decided before the switch that started it lands until then. */
	__u64 leave_after;
	/* The stall watch (STATE_WATCHED): a read left bytes queued that
	 * FIONREAD does not count here, at watch_at, when the reader had
	 * consumed watch_progress (copied_seq plus redirected bytes read). */
	__u64 watch_at;
	__u32 watch_progress;
	__u32 reader_pid;      /* who read (tgid), to be woken */
	struct task_struct __kptr_untrusted *reader_task; /* the thread that read */
	__u64 reader_regs;     /* where that thread's system call registers are (bpf_task_pt_regs) */
	__u64 reader_ino;      /* its socket's inode, to find the descriptor */
	char reader_comm[COMM_LEN];
	/* The stall scan (shunt_iter_stalls): when a scan first found bytes
	 * queued with the reader at scan_progress (0: none queued). */
	__u64 scan_at;
	__u32 scan_progress;
	__u32 woke_progress;   /* the reader's progress when the stall watch woke it (STATE_WOKEN) */
	__u64 splicer_args;    /* the splicer's command line hash (struct splice_program) */
	/* Its reader's program (struct splice_program) as of its first recv
	 * (STATE_READS), with reader_comm: learning that program sends the
	 * socket back to TCP (presume_splicer). */
	__u64 reader_args;
	/* The sequence number of this socket's first byte received and sent:
	 * copied_seq - rcv_origin bytes have been read, write_seq - snd_origin
	 * written (through_join). */
	__u32 rcv_origin;
	__u32 snd_origin;
};

struct {
	__uint(type, BPF_MAP_TYPE_HASH);
	__uint(max_entries, MAX_SOCKETS);
	__type(key, struct sock_key);
	__type(value, struct peer_ref);
} peer_refs SEC(".maps");

/* The sockets' timers, a pool: a timer in a peer_refs entry would be made at
 * each pairing and freed at each close, and on 6.18 each free costs an
 * interrupt to the freeing CPU (kfree_nolock from an RCU callback defers
 * through irq_work: a VM exit on a virtual machine): a third of what shunt
 * adds to a short connection's CPU. A slot's timer is made once, with the
 * sockops program's callback, and lives as long as the map. owner: the
 * socket it runs for now; a callback that finds the slot has changed hands
 * (a close does not cancel: bpf_timer_cancel drops the callback) checks a
 * socket that was never watched, which does nothing. */
struct leave_timer {
	struct bpf_timer timer;
	struct sock_key owner;
};

struct {
	__uint(type, BPF_MAP_TYPE_ARRAY);
	__uint(max_entries, MAX_SOCKETS);
	__type(key, __u32);
	__type(value, struct leave_timer);
} leave_timers SEC(".maps");

/* Slots given back (a stack: the latest, its timer warm in cache, first),
 * and how many were ever taken: slots are handed out in order until all
 * have been. */
struct {
	__uint(type, BPF_MAP_TYPE_STACK);
	__uint(max_entries, MAX_SOCKETS);
	__uint(value_size, sizeof(__u32));
} free_timers SEC(".maps");

struct timer_pool {
	__u32 taken;
};

struct {
	__uint(type, BPF_MAP_TYPE_ARRAY);
	__uint(max_entries, 1);
	__type(key, __u32);
	__type(value, struct timer_pool);
} timer_pool SEC(".maps");

/* A kernel join's two sockets (shunt proxy --mode kernel) whose connections
 * bypass paired: a peer's sends to one go straight to the far peer of the
 * other (through_join). Set by the proxy, one entry per socket, keyed by its
 * cookie (never reused, unlike a key: an entry a crashed proxy left behind
 * matches no later socket, and the LRU drops it in time); the proxy reads the
 * counts and deletes both entries when the join ends. */
struct shortcut {
	struct sock_key partner; /* the join's other socket */
	__u64 partner_cookie;
	/* What partner sent the far peer and this socket's peer did not send
	 * it, less what partner sent by redirect before it was joined (a
	 * PROXY header the proxy wrote, by TCP or redirect). */
	__u32 added;
	__u32 _pad;
	__u64 bytes;             /* redirected end to end */
	__u64 sends;
};

struct {
	__uint(type, BPF_MAP_TYPE_LRU_HASH);
	__uint(max_entries, MAX_SOCKETS);
	__type(key, __u64);
	__type(value, struct shortcut);
} shortcuts SEC(".maps");

/* Server ports whose connections stay on TCP, set by the user for
 * applications that read in ways a redirected flow cannot serve (splice(2),
 * MSG_WAITALL; see docs/TRANSPARENCY.md). */
#define MAX_EXCLUDED_PORTS 256

struct {
	__uint(type, BPF_MAP_TYPE_HASH);
	__uint(max_entries, MAX_EXCLUDED_PORTS);
	__type(key, __u16);
	__type(value, __u8);
} excluded_ports SEC(".maps");

/* Server ports whose readers needed TCP lately, and client processes whose
 * readers did for their connections to a port: a connection to such a port
 * (from such a process) is not paired for cfg.reader_port_ttl_s after
 * that. Paired, it would be taken out again at its first read, which costs
 * a short connection more than TCP (gunicorn's sync workers ran at 0.85x,
 * privoxy's blocking upstream reads 0.74x). Forgotten after the TTL, so a
 * port or process whose program changed is bypassed again. */
#define MAX_READER_PORTS 4096

struct {
	__uint(type, BPF_MAP_TYPE_LRU_HASH);
	__uint(max_entries, MAX_READER_PORTS);
	__type(key, struct reader_port);
	__type(value, struct reader_port_seen);
} reader_ports SEC(".maps");

/* Server ports whose paired connections from one client address closed
 * brief (at most cfg.brief_sends sends each way), cfg.brief_streak in a
 * row (keyed by client address so that one pod's brief connections leave
 * another's long ones to the same port bypassed): a pairing
 * costs a short connection more than its few redirected sends win back
 * (mini_httpd behind nginx's stream proxy, a connection per request: 0.92x
 * plain TCP), so the port's next connections are left unpaired, all but one
 * in cfg.brief_sample, which looks whether they still are. A send past
 * cfg.brief_sends on any connection to the port ends its streak at once;
 * forgotten cfg.reader_port_ttl_s after the last brief close. */
struct {
	__uint(type, BPF_MAP_TYPE_LRU_HASH);
	__uint(max_entries, MAX_READER_PORTS);
	__type(key, struct brief_key);
	__type(value, struct brief_port);
} brief_ports SEC(".maps");

/* Client sockets whose process's reads of its connections to the same port
 * needed TCP lately (reader_ports with its pid), marked at connect, where
 * the process is known, for the handshake's end, where it is not. */
struct {
	__uint(type, BPF_MAP_TYPE_SK_STORAGE);
	__uint(map_flags, BPF_F_NO_PREALLOC);
	__type(key, int);
	__type(value, __u32);
} kept_clients SEC(".maps");

/* Programs whose readers take redirected bytes: until one of a program's
 * readers of a role (its probe) has read a while by TCP without splicing,
 * all its readers of that role read by TCP (admit_reader in
 * bpf/bypass/reads.h). */
#define MAX_RECV_PROGRAMS 1024

struct {
	__uint(type, BPF_MAP_TYPE_LRU_HASH);
	__uint(max_entries, MAX_RECV_PROGRAMS);
	__type(key, struct recv_key);
	__type(value, struct recv_program);
} recv_programs SEC(".maps");

/* Programs seen splicing from TCP sockets. Pinned beside the install, not
 * in it, so what shunt learned outlives `disable --all`. */
#define MAX_SPLICE_PROGRAMS 1024

struct {
	__uint(type, BPF_MAP_TYPE_LRU_HASH);
	__uint(max_entries, MAX_SPLICE_PROGRAMS);
	__type(key, struct splice_program);
	__type(value, struct splice_seen);
} splice_programs SEC(".maps");

/* A command line being hashed (current_program in bpf/bypass/learn.h), in a per-CPU
 * map: more than a program's stack holds. */
struct args_walk {
	char args[ARGS_LEN];
	__u64 len;  /* bytes read into args */
	__u64 hash;
	__u32 arg;  /* which argument the walk is in */
	__u32 at_start;
	__u32 last; /* in the last argument taken */
	__u32 end;  /* bytes taken */
	struct splice_seen fresh; /* a new entry of splice_programs, built here */
};

struct {
	__uint(type, BPF_MAP_TYPE_PERCPU_ARRAY);
	__uint(max_entries, 1);
	__type(key, __u32);
	__type(value, struct args_walk);
} args_scratch SEC(".maps");

/* Per process (tgid), where writer_blocked left off in its descriptors and
 * the socket it last found waiting for room: a hint, raced over by the
 * timers of the process's sockets. */
struct room_seen {
	__u64 files;     /* the descriptor table looked through; another starts over */
	__u64 looked_at; /* when the last look through it began (bpf_ktime_get_ns) */
	__u32 next;      /* the slot the next look starts at */
	__u32 found;     /* 1 + the descriptor last found waiting for room, or 0 */
	__u32 clean;     /* the looks since slot 0 found none */
	__u32 clear;     /* the last whole pass, slot 0 to the end, found none */
};

struct {
	__uint(type, BPF_MAP_TYPE_LRU_HASH);
	__uint(max_entries, 4096);
	__type(key, __u32);
	__type(value, struct room_seen);
} room_seen SEC(".maps");

/* The descriptor, + 1, a socket's reader last read it through, by socket
 * cookie: the guard takes it from the reader's process to wake it at once,
 * where finding it in /proc/PID/fd took 20 ms with 5,000 descriptors open.
 * A hint: the guard checks the cookie of what it took. */
struct {
	__uint(type, BPF_MAP_TYPE_LRU_HASH);
	__uint(max_entries, 16384);
	__type(key, __u64);
	__type(value, __u32);
} reader_fds SEC(".maps");

/* When the guard delivered its last wake-up to a socket (socket cookie to
 * bpf_ktime_get_ns), written by the guard: a reader the stall watch woke is
 * given its time to answer from then, not from the report, since the guard
 * may be behind (in a stall scan, or waiting for a CPU). */
struct {
	__uint(type, BPF_MAP_TYPE_LRU_HASH);
	__uint(max_entries, 4096);
	__type(key, __u64);
	__type(value, __u64);
} wakes_delivered SEC(".maps");

/* What the guard hears of (struct guard_event). */
struct {
	__uint(type, BPF_MAP_TYPE_RINGBUF);
	__uint(max_entries, 64 << 10);
} guard_events SEC(".maps");
