// SPDX-License-Identifier: GPL-2.0
/* The read watch: every read of a held socket says what its reader is
 * (non-blocking recv, blocking, peeking, zerocopy), which decides whether
 * sends may be redirected to it, and notes a reader that may be stalled.
 *
 * Part of bypass.c, which includes the parts in order: each uses what the
 * ones before it define. */

#define MSG_PEEK 0x2
#define MSG_TRUNC 0x20
#define MSG_WAITALL 0x100
#define MSG_ERRQUEUE 0x2000
#define MSG_DONTWAIT 0x40

/* The read may sleep: neither MSG_DONTWAIT nor O_NONBLOCK. */
static __always_inline int may_wait(struct sock *sk, int flags)
{
	if (flags & MSG_DONTWAIT)
		return 0;
	struct socket *sock = sk->sk_socket;
	if (!sock || !sock->file)
		return 1; /* no file to say O_NONBLOCK: take the safe side */
	return !(sock->file->f_flags & O_NONBLOCK);
}

#define EAGAIN 11

/* A blocking read without SO_RCVTIMEO never fails with EAGAIN over TCP; on a
 * sockhash socket tcp_bpf_recvmsg returns it when its wait ends without data
 * (a signal, a stop, ptrace, where TCP restarts). Counted, and told to the
 * guard with pid and ports, so that the difference shows
 * (docs/TRANSPARENCY.md). */
static __always_inline void report_blocking_eagain(struct sock *sk, struct sock_state *st, int waits)
{
	if (!waits || sk->sk_rcvtimeo != MAX_SCHEDULE_TIMEOUT)
		return;
	count(CNT_EAGAIN);
	struct guard_event *ev = bpf_ringbuf_reserve(&guard_events, sizeof(*ev), 0);
	if (!ev)
		return;
	ev->self = st->self;
	ev->cookie = bpf_get_socket_cookie(sk);
	ev->unread = 0;
	ev->pid = bpf_get_current_pid_tgid() >> 32;
	ev->kind = EVENT_BLOCKING_EAGAIN;
	current_comm(ev->comm);
	bpf_ringbuf_submit(ev, 0);
}

#define PF_IO_WORKER 0x10

/* The read runs for io_uring: in one of its threads (an io-wq worker, the
 * SQPOLL thread), or inside io_uring_enter(2) (at submission, or as the
 * task work a readiness wake-up queued). Its completion tells the program
 * whether bytes are left after it (IORING_CQE_F_SOCK_NONEMPTY, from the
 * msg_inq TCP's recvmsg fills in), and event loops on io_uring end their
 * reads when it does not (Netty's io_uring transport). A psock's recvmsg
 * never fills it in: such a reader is told "empty" after every read of
 * redirected bytes and waits for an edge that may never come. Task work
 * run on the way out of another system call is not seen here; the stall
 * watch and scan remain the net for it. */
static __always_inline int uring_read(void)
{
	struct task_struct *task = bpf_get_current_task_btf();
	if (task->flags & PF_IO_WORKER)
		return 1;
	struct pt_regs *regs = (struct pt_regs *)bpf_task_pt_regs(task);
	return regs && regs->orig_ax == cfg.uring_nr;
}

/* How a read asks to be served: STATE_TCP_READER if only TCP serves it as
 * TCP would (MSG_WAITALL, MSG_OOB, MSG_TRUNC; a read that may sleep, whose
 * sleep a signal ends with EAGAIN on a sockhash socket), else STATE_READS. */
static __always_inline __u32 reader_mark(int flags, int waits)
{
	/* A psock serves MSG_OOB from its queue, in band, and copies what
	 * MSG_TRUNC asks TCP to discard (EFAULT for a NULL buffer). */
	if (flags & (MSG_WAITALL | MSG_OOB | MSG_TRUNC))
		return STATE_TCP_READER;
	if (!cfg.trust_readers && waits)
		return STATE_TCP_READER;
	return STATE_READS;
}

/* Where the psock does not count its queue: a read takes either redirected
 * bytes or TCP's (tcp_bpf_recvmsg never mixes them in one call), and only a
 * TCP read moves copied_seq. */
static __always_inline void count_read(struct sock_state *st, struct sock *sk, int ret)
{
	struct peer_ref *ref = bpf_map_lookup_elem(&peer_refs, &st->self);
	if (!ref)
		return;
	__u32 copied = BPF_CORE_READ((struct tcp_sock *)sk, copied_seq);
	if (copied != ref->tcp_copied)
		ref->tcp_copied = copied;
	else
		__sync_fetch_and_add(&ref->redirected_read, ret);
}

/* The socket's inode number: "socket:[ino]" among its process's fds. */
static __always_inline __u64 socket_ino(struct sock *sk)
{
	struct socket *sock = BPF_CORE_READ(sk, sk_socket);
	if (!sock)
		return 0;
	struct socket_alloc *sa = container_of(sock, struct socket_alloc, socket);
	return BPF_CORE_READ(sa, vfs_inode.i_ino);
}

/* Records who reads the socket (this read's task), for the guard to wake. */
static __always_inline void note_reader(struct sock *sk, struct peer_ref *ref)
{
	ref->cookie = bpf_get_socket_cookie(sk);
	ref->reader_pid = bpf_get_current_pid_tgid() >> 32;
	ref->reader_ino = socket_ino(sk);
	current_comm(ref->reader_comm);
	/* A read names its descriptor first (read, readv, recvfrom, recvmsg);
	 * another caller (io_uring) leaves a number whose cookie the guard
	 * finds wrong, and it looks through /proc/PID/fd then. */
	struct pt_regs *regs = (struct pt_regs *)bpf_task_pt_regs(bpf_get_current_task_btf());
	__u32 fd = (__u32)BPF_CORE_READ(regs, di) + 1;
	/* Written only when it changed: an episode starts at most reads of a
	 * stream on 6.1, and an LRU update takes a lock a lookup does not. */
	__u32 *known = bpf_map_lookup_elem(&reader_fds, &ref->cookie);
	if (!known || *known != fd)
		bpf_map_update_elem(&reader_fds, &ref->cookie, &fd, BPF_ANY);
}

/* The peer's writer streams small sends (small_write_stream): the
 * connection goes back to TCP. The peer's sends queue behind the redirected
 * bytes still unread, and take TCP once those are read (check_peer), so no
 * TCP byte comes ahead of them for a splice (HAProxy reads a header, then
 * splices) nor behind them for a short read to hide; past the bound flow
 * control sends by TCP as ever. Where FIONREAD leaves out TCP's bytes
 * (6.18), a reader told 0 for them is woken by the leave once the socket
 * is out of the sockhash (STATE_WATCHED, the reader noted). */
static __always_inline void leave_small_writes(struct sock *sk, struct peer_ref *ref)
{
	note_reader(sk, ref);
	__u32 old = __sync_fetch_and_or(&ref->reads, STATE_TCP_READER | STATE_WATCHED);
	if (old & STATE_TCP_READER)
		return; /* leaving already */
	count(CNT_SMALL_WRITES);
	start_leave(ref, cfg.settle_ns);
}

/* A recv reader's read left bytes queued that FIONREAD does not count on
 * this kernel: if it reads no more within cfg.stall_ns, it may be waiting
 * for an edge that never comes (stall_check). Costs the reads below for a
 * held socket; the timer only starts once per episode. */
static __always_inline void watch_stall(struct sock *sk, struct sock_state *st)
{
	struct peer_ref *ref = bpf_map_lookup_elem(&peer_refs, &st->self);
	if (!ref)
		return;
	if (ref->reads & STATE_RESCUED) {
		/* Rescued, with redirected bytes left that FIONREAD does not
		 * count (6.1): a reader that trusts FIONREAD (nginx) reads one
		 * buffer a wake-up. The leave wakes it again when it sees
		 * progress since its last wake: run it now. Recorded here as
		 * the watch records reads, the progress would hide, and each
		 * wake wait stall_ns: one buffer per 20 ms. */
		if (!PSOCK_COUNTS && !ingress_empty(sk))
			arm(ref, 0);
		return;
	}
	if ((ref->reads & (STATE_SMALL_WRITES | STATE_TCP_READER)) == STATE_SMALL_WRITES) {
		leave_small_writes(sk, ref);
		return;
	}
	__u32 unseen;
	if (!may_stall(sk, ref, &unseen))
		return;
	ref->watch_progress = read_progress(sk, ref);
	ref->watch_at = bpf_ktime_get_ns();
	/* The thread that read last: threads of one process take turns. */
	struct task_struct *task = bpf_get_current_task_btf();
	ref->reader_task = task;
	ref->reader_regs = (__u64)bpf_task_pt_regs(task);
	/* A leave pending keeps its own time (leave_after) while a redirect
	 * may be on its way; once only TCP bytes wait, it goes now, and wakes
	 * this reader as it goes (STATE_WATCHED). */
	int hasten = ref->leaving && nothing_landing(sk, ref);
	if (ref->reads & (STATE_WATCHED | STATE_TCP_READER)) {
		if (hasten)
			arm(ref, 0);
		return;
	}
	note_reader(sk, ref);
	__u32 old = __sync_fetch_and_or(&ref->reads, STATE_WATCHED);
	if (old & (STATE_WATCHED | STATE_TCP_READER))
		return;
	if (hasten)
		arm(ref, 0);
	else if (!ref->leaving)
		arm(ref, stall_after(sk));
}

/* A socket's reader needs TCP: the next connections to its server port
 * (a server's socket), or the next ones its process makes to that port (a
 * client's), are left unpaired for a while (reader_ports). */
static __always_inline void learn_reader_port(struct sock_state *st)
{
	__u32 pid = bpf_get_current_pid_tgid() >> 32;
	struct reader_port k = { .netns = st->self.netns, .port = st->self.tuple.server_port,
				 .pid = st->self.role == ROLE_CLIENT ? pid : 0 };
	__u64 now = bpf_ktime_get_ns();
	struct reader_port_seen *s = bpf_map_lookup_elem(&reader_ports, &k);
	if (s) {
		/* After the TTL a client's streak starts again. */
		s->streak = now - s->seen_ns > (__u64)cfg.reader_port_ttl_s * 1000000000ULL ? 1 : s->streak + 1;
		s->seen_ns = now;
		s->pid = pid;
		current_comm(s->comm);
		return;
	}
	struct reader_port_seen fresh = { .seen_ns = now, .pid = pid, .streak = 1 };
	current_comm(fresh.comm);
	bpf_map_update_elem(&reader_ports, &k, &fresh, BPF_NOEXIST);
}

/* A client socket's reader reads without blocking: its process's streak
 * of connections to that port that needed TCP ends (reader_ports). */
static __always_inline void forget_reader_client(struct sock_state *st)
{
	if (!cfg.reader_port_ttl_s || st->self.role != ROLE_CLIENT)
		return;
	struct reader_port k = { .netns = st->self.netns, .port = st->self.tuple.server_port,
				 .pid = bpf_get_current_pid_tgid() >> 32 };
	bpf_map_delete_elem(&reader_ports, &k);
}

/* Notes where a task's system call registers sit from the base of its
 * kernel stack (x86-64: at its top, which THREAD_SIZE places), once per
 * install and after each attach (which rewrites the control word), for
 * sk_msg's urgent_send. Every redirect follows a read seen here (its
 * reader's), except with --trust-readers. */
static __always_inline void note_regs_at(void)
{
	__u32 zero = 0;
	struct control_word *ctl = bpf_map_lookup_elem(&control, &zero);
	if (!ctl || ctl->regs_at)
		return;
	struct task_struct *task = bpf_get_current_task_btf();
	/* The verifier forbids math on the pointer (before 6.18): take its
	 * value through a fault-safe read of the stack slot holding it. */
	struct pt_regs *regs = (struct pt_regs *)bpf_task_pt_regs(task);
	__u64 addr = 0;
	if (bpf_probe_read_kernel(&addr, sizeof(addr), &regs))
		return;
	__u64 at = addr - (__u64)task->stack;
	if (at && at < (1 << 20))
		ctl->regs_at = at;
}

/* A recv returned 0 with the end come and nothing left before it: its
 * reader knows of the peer's end (end_unread). A zero-length read returns 0
 * too, before the end or with bytes queued, and tells the reader nothing. */
static __always_inline void note_eof(struct sock *sk, struct sock_state *st)
{
	if (!sock_done(sk) || tcp_queued(sk))
		return;
	struct peer_ref *ref = bpf_map_lookup_elem(&peer_refs, &st->self);
	if (ref && !(ref->reads & STATE_EOF_SEEN))
		__sync_fetch_and_or(&ref->reads, STATE_EOF_SEEN);
}

/* A reader that sees one queue alone (zerocopy receive maps TCP's; a peek
 * stops at the psock's) goes back to TCP, its peer's sends queued behind
 * the redirected bytes still unread, past the backlog bound too
 * (STATE_MAY_SPLICE), so no TCP byte ever comes behind them; also when it
 * is on its way to TCP for another reason already (a stall rescue). Each
 * later call of such a reader costs three tests. */
static __always_inline void one_queue_reader(struct sock_state *st, struct peer_ref *ref, __u32 counter)
{
	if (!(ref->reads & STATE_MAY_SPLICE))
		__sync_fetch_and_or(&ref->reads, STATE_MAY_SPLICE);
	/* The socket's own sends update flags too (sk_msg): atomics. */
	if (!(st->flags & STATE_TCP_READER))
		__sync_fetch_and_or(&st->flags, STATE_TCP_READER);
	if (!(ref->reads & STATE_TCP_READER))
		leave_for_tcp(ref, counter);
}

/* A psock's read never reaches past its own bytes into TCP's queue, peeks
 * included: with bytes by TCP behind redirected ones, a peek asking for
 * more than the redirected bytes queued gets just those, and while they
 * are unread its peer's sends stay on TCP, so the view never grows. A
 * reader that peeks until a whole message shows, reading nothing before,
 * would see the same short view for ever (by hand on 6.18: a framed reader
 * peeking for whole frames stuck at 374 of 3,000 frames, 1.5 million peeks
 * in 5 s; over TCP all in 0.02 s). So a reader that peeks in mid-stream
 * (after it read) goes back to TCP at that peek, as a zerocopy reader does:
 * its peer's sends queue behind the redirected bytes still unread (past
 * the backlog bound too: STATE_MAY_SPLICE), then take TCP, and no TCP byte
 * is ever behind redirected ones. A peek before the first read (nginx and
 * HAProxy sniff a new connection so) takes TCP's first bytes anyway. */
static __always_inline void peeks_mid_stream(struct sock_state *st)
{
	struct peer_ref *ref = bpf_map_lookup_elem(&peer_refs, &st->self);
	if (ref)
		one_queue_reader(st, ref, CNT_PEEK_READER);
}

/* What the rule above cannot prevent: TCP bytes behind redirected ones
 * before the reader's first peek in mid-stream (flow control, or a stall
 * rescue, sent them so while it read plainly). The third peek in a row at
 * every redirected byte queued, with TCP's behind and nothing read
 * between, is reported to the guard, with the reader's pid and command:
 * nothing can bring the two queues together for it, and a reset would
 * leave its psock, and the bytes it peeks at, in place. */
static __always_inline void watch_boundary_peek(struct sock *sk, struct sock_state *st, int ret, int flags)
{
	struct peer_ref *ref = bpf_map_lookup_elem(&peer_refs, &st->self);
	if (!(flags & MSG_PEEK)) {
		/* A read (ret > 0, STATE_PEEKED): the count starts again. */
		__sync_fetch_and_and(&st->flags, ~STATE_PEEKED);
		if (ref)
			ref->boundary_peeks = 0;
		return;
	}
	/* TCP bytes queued with redirected ones are behind them: a redirect
	 * waits until its peer read every TCP byte (REDIRECT_TCP_UNREAD). */
	if (ret <= 0 || !ref || !tcp_data_queued(sk) || ingress_empty(sk))
		return;
	if ((__u64)ret < unread_redirected(sk, ref))
		return; /* it asked for less than the psock holds */
	if (!(st->flags & STATE_PEEKED))
		__sync_fetch_and_or(&st->flags, STATE_PEEKED);
	if (__sync_fetch_and_add(&ref->boundary_peeks, 1) != 2)
		return;
	ref->cookie = bpf_get_socket_cookie(sk);
	struct guard_event *ev = bpf_ringbuf_reserve(&guard_events, sizeof(*ev), 0);
	if (!ev) {
		count(CNT_EVENTS_LOST);
		return;
	}
	count(CNT_PEEK_STUCK);
	struct sock_key self = st->self;
	fill_reader_event(ev, ref, &self, sk, EVENT_PEEK_STUCK, socket_ino(sk));
	bpf_ringbuf_submit(ev, 0);
}

/* Whether a reader seen reading without blocking may take redirected bytes
 * (be marked STATE_READS). Not while its program (by command name) is new
 * to the install: its readers of one role (accepted, connected) read by
 * TCP until the first of them, its probe, has read cfg.probation_reads
 * times without splicing, or cfg.probation_ns passed since the probe
 * began and the probe read cfg.probation_time_reads times (two: again
 * after its first read).
 * A program that reads a header and then splices (HAProxy, a Go proxy's
 * io.Copy) splices within that, from a socket holding nothing splice cannot
 * read: learned at that splice with no connection caught, where each of its
 * connections holding redirected bytes then was (HAProxy, 20 concurrent
 * connections: 2 and 4 resets in 2 of 14 runs; 7-20 of 20 in a test). Time
 * alone proves nothing: a probe that read its header and waits for a slow
 * upstream's body has not shown it reads rather than splices, and another
 * connection admitted then would be caught at its splice. A reader kept
 * waiting is asked again at its next read. */
static __always_inline int proven_by_time(struct recv_program *rp, __u32 reads, __u64 now)
{
	return reads >= cfg.probation_time_reads && now - rp->since_ns > cfg.probation_ns;
}

static __always_inline int admit_reader(struct sock *sk, struct sock_state *st, struct peer_ref *ref,
					struct splice_program *prog, int ret)
{
	if (!cfg.probation_reads)
		return 1;
	__u64 now = bpf_ktime_get_ns();
	__u64 cookie = bpf_get_socket_cookie(sk);
	struct recv_key k = { .role = st->self.role };
	__builtin_memcpy(k.comm, prog->comm, sizeof(k.comm));
	struct recv_program *rp = bpf_map_lookup_elem(&recv_programs, &k);
	if (!rp) {
		struct recv_program fresh = { .probe = cookie, .since_ns = now };
		if (!bpf_map_update_elem(&recv_programs, &k, &fresh, BPF_NOEXIST)) {
			rp = bpf_map_lookup_elem(&recv_programs, &k);
			if (!rp)
				return 1;
			goto probe;
		}
		rp = bpf_map_lookup_elem(&recv_programs, &k);
		if (!rp)
			return 1;
	}
	if (rp->proven)
		return 1;
	if (rp->probe == cookie)
		goto probe;
	if (proven_by_time(rp, rp->reads, now)) {
		rp->proven = 1;
		return 1;
	}
	/* The last probe closed, spliced or left before it read enough. */
	if (!rp->probe && !__sync_val_compare_and_swap(&rp->probe, 0, cookie)) {
		rp->reads = 0;
		goto probe;
	}
	goto held;
probe:
	if (!(st->flags & STATE_PROBE)) {
		/* Its command, for end_probe at its close. */
		__builtin_memcpy(ref->reader_comm, prog->comm, sizeof(ref->reader_comm));
		__sync_fetch_and_or(&st->flags, STATE_PROBE);
	}
	if (ret > 0) {
		__u32 reads = __sync_fetch_and_add(&rp->reads, 1) + 1;
		if (reads >= cfg.probation_reads || proven_by_time(rp, reads, now)) {
			rp->proven = 1;
			return 1;
		}
	}
held:
	if (!(st->flags & STATE_HELD)) {
		__sync_fetch_and_or(&st->flags, STATE_HELD);
		__sync_fetch_and_add(&rp->held, 1);
		count(CNT_READER_HELD);
	}
	return 0;
}

/* A read after a refused splice (shunt_refuse_splice): the program reads
 * instead, and a splice after this read is refused again. */
static __always_inline void forget_refusal(struct sock_state *st)
{
	struct peer_ref *ref = bpf_map_lookup_elem(&peer_refs, &st->self);
	if (ref && (ref->reads & STATE_SPLICE_REFUSED))
		__sync_fetch_and_and(&ref->reads, ~STATE_SPLICE_REFUSED);
}

/* Runs after every recvmsg on the host (read, recv, recvmsg, io_uring recv):
 * records how the reader of a paired socket reads, for its peer's sk_msg.
 * A reader that blocks or asks for MSG_WAITALL (MSG_OOB, MSG_TRUNC), or
 * reads through io_uring, sends its connection back to TCP; event-loop
 * readers (non-blocking) keep the bypass.
 * Sockets shunt does not hold have no storage and cost one pointer test;
 * those it sent back to TCP, a psock test more where the entry can see them
 * (any_socket). */
static __always_inline int watch_read(struct sock *sk, int ret, int flags, const int any_socket)
{
	if (flags & MSG_ERRQUEUE)
		return 0; /* completions and errors, not the stream */
	struct sock_state *st = bpf_sk_storage_get(&sock_states, sk, 0, 0);
	if (!st)
		return 0;
	/* Out of the sockhash (sent back to TCP, or never in it): plain TCP,
	 * nothing left to record. A connection sent back behind a slow reader
	 * paid the whole watch on each read: 130-170 ns a run against 78-86
	 * (bpf_stats, 4 KiB reads). */
	if (any_socket && !sock_psock(sk))
		return 0;
	note_regs_at();
	/* A read ends its socket's run of small sends (small_write_stream). */
	if (ret > 0 && st->small_run)
		st->small_run = 0;
	if (ret == 0)
		note_eof(sk, st);
	if (cfg.refuse_splice)
		forget_refusal(st);
	if (!PSOCK_COUNTS && ret > 0 && !(flags & MSG_PEEK))
		count_read(st, sk, ret);
	if (flags & MSG_PEEK || (ret > 0 && (st->flags & STATE_PEEKED)))
		watch_boundary_peek(sk, st, ret, flags);
	/* Also on its way to TCP for another reason (a stall rescue): from
	 * now on no TCP byte may come behind redirected ones. */
	if ((flags & MSG_PEEK) && ret > 0 && (st->flags & STATE_READS)) {
		peeks_mid_stream(st);
		return 0;
	}
	if (st->flags & STATE_TCP_READER)
		return 0; /* on its way back to TCP: nothing more to record */
	int waits = may_wait(sk, flags);
	if (ret == -EAGAIN)
		report_blocking_eagain(sk, st, waits);
	__u32 mark = reader_mark(flags, waits);
	int uring = 0;
	if (mark == STATE_READS && uring_read()) {
		/* Told what is left by each completion: only TCP tells it. */
		mark = STATE_TCP_READER;
		uring = 1;
	}
	if (st->flags & mark) {
		if (mark == STATE_READS && ret > 0)
			watch_stall(sk, st);
		return 0;
	}
	struct splice_program prog = {};
	if (mark == STATE_READS && learned_splicer(&prog)) {
		/* This program splices: its first recv may be followed by a
		 * splice that could not read redirected bytes. */
		mark = STATE_TCP_READER;
		count(CNT_LEARNED_READER);
	}
	struct peer_ref *ref = bpf_map_lookup_elem(&peer_refs, &st->self);
	if (!ref)
		return 0; /* left already, or closing */
	if (mark == STATE_READS && !cfg.trust_readers && !admit_reader(sk, st, ref, &prog, ret)) {
		/* Its peer's sends take TCP for now, into a socket still in
		 * the sockhash, whose FIONREAD leaves them out (6.18): watched
		 * as any reader. Unwatched, nginx held on its first connection
		 * waited for the stall scan, told 0 after its second read. */
		if (ret > 0)
			watch_stall(sk, st);
		return 0;
	}
	if (mark == STATE_READS) {
		/* Who reads it, for presume_splicer: set before the mark, so a
		 * learn that sees the mark sees them. */
		ref->reader_args = prog.args;
		__builtin_memcpy(ref->reader_comm, prog.comm, sizeof(ref->reader_comm));
	}
	/* The socket's own sends update flags too (sk_msg): atomics. */
	__sync_fetch_and_or(&st->flags, mark);
	__u32 old = __sync_fetch_and_or(&ref->reads, mark);
	if (mark != STATE_TCP_READER) {
		forget_reader_client(st);
		if (ret > 0)
			watch_stall(sk, st);
		return 0;
	}
	if (old & mark)
		return 0;
	end_probe(st, bpf_get_socket_cookie(sk)); /* it reads as its program's probe no more */
	count(uring ? CNT_URING_READER : CNT_TCP_READER);
	/* A discard is mostly a drain before close (HAProxy's), no habit
	 * of the port's other readers. */
	if (!(flags & MSG_TRUNC))
		learn_reader_port(st);
	/* Never seen in recv before: the peer never redirected to it, so
	 * nothing can be on the way. */
	start_leave(ref, (old & STATE_READS) ? cfg.settle_ns : 0);
	return 0;
}

SEC("tp_btf/sock_recv_length")
int BPF_PROG(shunt_reads, struct sock *sk, int ret, int flags)
{
	return watch_read(sk, ret, flags, 1);
}

/* Kernels before 6.3 have no sock_recv_length tracepoint. Every read of a
 * socket in the sockhash (with sk_msg only, as shunt's) goes through
 * tcp_bpf_recvmsg, with the flags recvmsg got (MSG_DONTWAIT included):
 * watched on its way out where fexit programs load. Only a socket with a
 * psock reads through it: no psock test (a probe read on those kernels). */
SEC("fexit/tcp_bpf_recvmsg")
int BPF_PROG(shunt_reads_fexit, struct sock *sk, void *msg, __u64 len, int flags, int *addr_len, int ret)
{
	return watch_read(sk, ret, flags, 0);
}
