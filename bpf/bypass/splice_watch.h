// SPDX-License-Identifier: GPL-2.0
/* The splice watch: a splice from a held socket (splice(2), or io_uring's in
 * a worker thread) sends it back to TCP, is caught if redirected bytes are
 * queued, and teaches shunt its program.
 *
 * Part of bypass.c, which includes the parts in order: each uses what the
 * ones before it define. */

#define IORING_OP_SPLICE 30

/* io_uring runs a splice (IORING_OP_SPLICE) in one of its worker threads
 * (io-wq), whose registers name no system call: the request the worker
 * runs says. Its fields are read through bpf_probe_read_kernel on every
 * kernel: only io_uring's workers get here. */
static __always_inline int io_worker_splices(struct task_struct *task)
{
	/* A kernel without io_uring has no such types: the check is folded
	 * at load, and the reads below with it. */
	if (!bpf_core_type_exists(struct io_kiocb) || !bpf_core_field_exists(task->worker_private))
		return 0;
	struct io_worker *w = BPF_CORE_READ(task, worker_private);
	if (!w)
		return 0;
	struct io_wq_work *work = BPF_CORE_READ(w, cur_work);
	if (!work)
		return 0;
	struct io_kiocb *req = (void *)work - bpf_core_field_offset(struct io_kiocb, work);
	return BPF_CORE_READ(req, opcode) == IORING_OP_SPLICE;
}

/* The calling task is in splice(2), or runs an io_uring splice. */
static __always_inline int in_splice(void)
{
	struct task_struct *task = bpf_get_current_task_btf();
	if (task->flags & PF_IO_WORKER)
		return io_worker_splices(task);
	struct pt_regs *regs = (struct pt_regs *)bpf_task_pt_regs(task);
	if (!regs)
		return 0;
	/* A direct load (a trusted pointer): this runs on every TCP read. */
	return regs->orig_ax == cfg.splice_nr;
}

/* The program being learned, and how many of its sockets were sent back. */
struct presume_ctx {
	struct splice_program prog;
	__u64 moved;
	__u64 queued; /* of which held redirected bytes unread */
};

static __always_inline int same_comm(const char *a, const char *b)
{
	const __u64 *x = (const __u64 *)a, *y = (const __u64 *)b;
	return x[0] == y[0] && x[1] == y[1];
}

/* A socket whose reader's program was just learned splicing goes back to
 * TCP before its peer's next bytes, as its later sockets stay there from
 * their first recv: else it is caught at its own first splice, and a
 * program that serves many connections at once (HAProxy) loses one
 * connection per socket bypassed before the first splice was seen. One
 * that holds redirected bytes keeps getting them behind those until they
 * are read (STATE_MAY_SPLICE): a TCP byte must never reach a splice ahead
 * of them. */
static long presume_splicer(void *map, struct sock_key *key, struct peer_ref *ref, struct presume_ctx *ctx)
{
	__u32 reads = ref->reads;
	if (!(reads & STATE_READS) || (reads & (STATE_TCP_READER | STATE_SPLICE)))
		return 0;
	if (!same_comm(ref->reader_comm, ctx->prog.comm))
		return 0;
	if (ctx->prog.args && ref->reader_args != ctx->prog.args)
		return 0;
	if (__sync_fetch_and_or(&ref->reads, STATE_MAY_SPLICE | STATE_TCP_READER) & STATE_TCP_READER)
		return 0;
	ctx->moved++;
	if (ref->sk && !ingress_empty((struct sock *)ref->sk))
		ctx->queued++;
	/* Seen reading: a redirect decided before the mark may still land. */
	start_leave(ref, cfg.settle_ns);
	return 0;
}

/* Runs when TCP accounts for what a reader took, in recvmsg and inside a
 * splice(2) read before it waits (tcp_splice_read -> __tcp_read_sock). A
 * splice reads the TCP queue alone, never the bytes redirected into the
 * socket's psock. So a socket shunt holds whose reader splices goes back
 * to TCP (and its peer's sends with it) at once; if redirected bytes were
 * queued already, the connection is caught (report_caught). The program is
 * learned: its later readers stay on TCP from their first recv
 * (shunt_reads). Only splices from sockets shunt holds are looked at:
 * checking every TCP read of the host for splice cost ~100 ns each. */
SEC("tp_btf/tcp_rcv_space_adjust")
int BPF_PROG(shunt_splices, struct sock *sk)
{
	/* Sockets shunt does not hold cost one pointer test, as in
	 * shunt_reads: the system call check below costs a helper call. */
	struct sock_state *st = bpf_sk_storage_get(&sock_states, sk, 0, 0);
	if (!st)
		return 0;
	if (st->flags & STATE_SPLICE)
		return 0;
	if (!in_splice())
		return 0;
	struct presume_ctx learning = {};
	int learned = learn(&learning.prog, current_program(&learning.prog), 1, 0);
	/* The socket's own sends update flags too (sk_msg): atomics. */
	__sync_fetch_and_or(&st->flags, STATE_SPLICE | STATE_TCP_READER);
	count(CNT_SPLICE_READER);
	struct peer_ref *ref = bpf_map_lookup_elem(&peer_refs, &st->self);
	if (ref) {
		/* Who splices, before the mark: once marked, the leave timer
		 * on another CPU may report the catch while the walk below
		 * runs (it did, as pid 0 with no command). */
		ref->cookie = bpf_get_socket_cookie(sk);
		ref->splicer_pid = bpf_get_current_pid_tgid() >> 32;
		__builtin_memcpy(ref->splicer_comm, learning.prog.comm, sizeof(learning.prog.comm));
		ref->splicer_args = learning.prog.args;
		__sync_fetch_and_or(&ref->reads, STATE_SPLICE);
		/* A probe that splices proves nothing for another program
		 * of its command name: the next reader is the probe. */
		end_probe(st, ref->cookie);
	}
	if (learned) {
		/* Once per program: its other sockets (this one is marked). */
		bpf_for_each_map_elem(&peer_refs, presume_splicer, &learning, 0);
		count_n(CNT_PRESUMED_SPLICER, learning.moved);
		count_n(CNT_PRESUMED_QUEUED, learning.queued);
	}
	if (!ref)
		return 0; /* left already, or closing */
	__u32 old = __sync_fetch_and_or(&ref->reads, STATE_SPLICE | STATE_TCP_READER);
	struct sock_key self = st->self;
	if (!ingress_empty(sk))
		report_caught(ref, &self, sk);
	if (!(old & STATE_TCP_READER)) {
		count(CNT_TCP_READER);
		/* Unseen in recv: nothing was ever redirected to it. Else
		 * wait for redirects decided before the mark (leave_timer_cb
		 * reports them if they land). */
		start_leave(ref, (old & STATE_READS) ? cfg.settle_ns : 0);
	}
	return 0;
}
