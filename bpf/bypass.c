// SPDX-License-Identifier: GPL-2.0
/* shunt bypass: host-local TCP connections skip the TCP/IP stack.
 *
 * Pairing (see docs/ARCHITECTURE.md):
 *  1. server side: a listener's request socket (TIMEOUT_INIT, before its
 *     SYN-ACK is sent) registers the handshake's two initial sequence
 *     numbers, with the server's netns and tuple, in `isn_handshakes`. A
 *     second registration of the same pair from another netns marks it
 *     ambiguous: those connections are never paired.
 *  2. client side, ACTIVE_ESTABLISHED: the sequence numbers of the SYN-ACK it
 *     received find the registration, so the peer is on this host and
 *     enabled, whatever NAT rewrote between them. Claim it, record our netns
 *     and tuple, insert ourselves, and bind the claim to our handshake ACK
 *     (a nonce in a TCP option).
 *  3. server side, PASSIVE_ESTABLISHED: a registration claimed once, by the
 *     socket whose nonce the ACK that established us carries, is our client.
 *     Insert ourselves; the entries are done.
 * Each side's sockhash key carries its own netns, so a key names one live
 * socket on the host. Sockets whose peer is elsewhere are never inserted.
 *
 * Ordering: the receiver reads its redirect queue before its TCP queue. So a
 * send may be redirected only when the peer's reader has read every byte this
 * socket ever sent over TCP (peer copied_seq == own write_seq): then nothing
 * older can be left behind it. Sends between a TCP send and that moment take
 * TCP too. Each socket publishes a pointer to itself (peer_refs) at pairing
 * so its peer can check this, and the peer's backlog (flow control).
 *
 * Readers: only recv/read see redirected bytes (splice(2) reads the TCP queue
 * alone; MSG_WAITALL returns what one redirected message holds; MSG_TRUNC
 * copies what TCP discards; a blocking read that a signal interrupts fails
 * with EAGAIN). So nothing is redirected to a socket until its reader has been
 * seen in a non-blocking recvmsg without MSG_WAITALL (shunt_reads); a reader
 * that blocks or asks for MSG_WAITALL, MSG_OOB or MSG_TRUNC keeps
 * its direction on TCP for good, and the connection leaves the sockhash (plain
 * TCP again) once no redirected byte is left for either reader. A reader that
 * only splices is never seen.
 */
#include <linux/bpf.h>
#include <bpf/bpf_helpers.h>
#include <bpf/bpf_core_read.h>
#include <bpf/bpf_tracing.h>

#include "include/kernel.h"
#include "include/bypass_keys.h"
#include "include/bypass_maps.h"
#include "include/bypass_helpers.h"
#include "include/cgroup_btf.h"

char __license[] SEC("license") = "GPL";

/* Weak: kernels before 6.2 lack it; there cfg.probe_reads is set and the
 * calls are never reached (the loader poisons them, the verifier prunes). */
extern void *bpf_rdonly_cast(const void *obj, __u32 btf_id) __ksym __weak;
extern void *bpf_cast_to_kern_ctx(void *obj) __ksym __weak;

/* Keep these types in BTF so bpf2go generates their Go twins. */
const struct flow_record *unused_flow_record __attribute__((unused));
const enum counter *unused_counter __attribute__((unused));
const enum state_flags *unused_state_flags __attribute__((unused));
const enum role *unused_role __attribute__((unused));
const struct guard_event *unused_guard_event __attribute__((unused));
const struct splice_program *unused_splice_program __attribute__((unused));
const struct splice_seen *unused_splice_seen __attribute__((unused));
const struct brief_port *unused_brief_port __attribute__((unused));
const struct recv_program *unused_recv_program __attribute__((unused));
const enum event_kind *unused_event_kind __attribute__((unused));
const enum stall_found *unused_stall_found __attribute__((unused));

/* Set from Go before load. */
volatile const struct config {
	__u64 settle_ns;      /* how long a redirect decided before a switch may still be landing */
	__u32 max_backlog;    /* unread redirected bytes a receiver may hold, unless it set SO_RCVBUF */
	__u32 trust_readers;  /* redirect before the reader was seen in recv (no splice readers here) */
	__u32 splice_nr;      /* this architecture's system call number of splice(2) */
	__u32 probe_reads;    /* no bpf_rdonly_cast (before 6.2): read the peer with bpf_probe_read_kernel */
	__u64 stall_ns;       /* a reader that has not read for this long, told bytes are not there, is stalled */
	__u64 scan_stall_ns;  /* the stall scan: bytes queued and nothing read for this long */
	__u32 fionread_misses_tcp; /* FIONREAD of a sockhash socket leaves out bytes that came by TCP (6.18) */
	__u32 fionread_corrected;  /* shunt_fionread adds what FIONREAD leaves out: no byte is hidden from it */
	__u32 reader_port_ttl_s;   /* how long a server port (a client process's port) whose reader needed TCP stays unpaired (0: never) */
	__u32 uring_nr;       /* io_uring_enter(2): may wait for the socket's readiness */
	__u32 epoll_nrs[3];   /* epoll_wait, epoll_pwait, epoll_pwait2: the epoll file is the first argument */
	__u32 poll_nrs[4];    /* poll, ppoll, select, pselect6: their entries on the socket's wait queue say what they ask */
	__u32 sendto_nr;      /* send(2) and sendto(2): flags are the fourth argument */
	__u32 sendmsg_nr;     /* sendmsg(2): flags are the third */
	__u32 sendmmsg_nr;    /* sendmmsg(2): flags are the fourth */
	__u64 told_zero_ns;   /* stall_ns for a reader FIONREAD tells 0 while TCP holds bytes for it (stall_after) */
	__u32 reader_client_streak; /* a client process's connections to a port in a row whose reader needed TCP before its next stay unpaired */
	__u32 small_run;      /* this many sends of at most small_size bytes that TCP would gather, in a row with no read between ... (0: never) */
	__u32 small_size;
	__u32 small_mss;      /* ... on a path whose segment size is at least this (loopback's, not veth's) ... */
	__u32 small_pad;
	__u64 small_window_ns; /* ... within this long send their connection back to TCP */
	__u32 brief_streak;   /* paired connections in a row to a server port, each closed brief, before the next stay unpaired (0: never) */
	__u32 brief_sends;    /* brief: at most this many sends from each end */
	__u32 brief_sample;   /* one connection in this many to a brief port is paired anyway, to see whether they still are */
	__u32 brief_pad;
	__u32 probation_reads; /* a program's readers read by TCP until one of them, its probe, read this many times ... (0: no probation) */
	__u32 probation_time_reads; /* ... or the probe read this many times (0: any) ... */
	__u64 probation_ns;   /* ... and this long passed since the first probe began */
	__u32 behind_bytes;   /* a socket's sends that took TCP in a row because its peer's reader was behind: past this many bytes the connection goes back to TCP (0: never) ... */
	__u32 behind_sends;   /* ... once the socket made this many sends */
	__u32 writer_margin;  /* a reader's unread redirected bytes leave room in its netns's tcp_rmem[2] for its writer's send buffer and 1/this of it more (0: no such bound) */
	__u32 refuse_splice;  /* an LSM hook refuses splices (--refuse-splice): each read forgets a refusal */
	__u32 no_fionread_watch; /* --no-fionread-watch: shunt_fionread_told left out where it would run (read by Go only: the install's record) */
} cfg = {
	.settle_ns = 100ULL * 1000 * 1000,
	.max_backlog = 8 << 20,
	.writer_margin = 8,
	.stall_ns = 20ULL * 1000 * 1000,
	.told_zero_ns = 2ULL * 1000 * 1000,
	.scan_stall_ns = 500ULL * 1000 * 1000,
};

/* The programs, by role (bpf/bypass/). */
#include "bypass/pairing.h"
#include "bypass/redirect.h"
#include "bypass/learn.h"
#include "bypass/stall.h"
#include "bypass/reads.h"
#include "bypass/splice_watch.h"
#include "bypass/sockopt.h"
#include "bypass/fionread.h"
#include "bypass/iter.h"
