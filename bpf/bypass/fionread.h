// SPDX-License-Identifier: GPL-2.0
/* FIONREAD: how many bytes a psock holds, and the answer corrected where the
 * kernel's leaves some out.
 *
 * Part of bypass.c, which includes the parts in order: each uses what the
 * ones before it define. */

/* A classic tracepoint's record of a system call's return (the
 * syscalls:sys_exit_* events' format). */
struct sys_exit_record {
	__u64 common;
	__s32 nr;
	__s32 _pad;
	__s64 ret;
};

/* How many psock messages the FIONREAD correction adds up at most (one
 * bpf_loop step each: verified once, whatever the bound). */
#define FIONREAD_MSGS 4096

/* The correction's walk of a psock's ingress_msg, for bpf_loop. */
struct ingress_walk {
	struct list_head *head;
	struct list_head *pos;
	__u32 bytes;
};

static long ingress_step(__u64 i, struct ingress_walk *w)
{
	/* A local copy: inside BPF_CORE_READ, w->pos would be relocated
	 * against a kernel type of that name, which there is none of. */
	struct list_head *pos = w->pos;
	if (!pos || pos == w->head)
		return 1;
	struct sk_msg *m = (struct sk_msg *)((void *)pos - bpf_core_field_offset(struct sk_msg, list));
	w->bytes += BPF_CORE_READ(m, sg.size);
	w->pos = BPF_CORE_READ(pos, next);
	return 0;
}

/* Redirected bytes waiting on a psock's ingress_msg (kernels whose psock
 * does not count them: 6.1), added up message by message. Read without the
 * socket's lock, as FIONREAD's answer is stale the moment it is given.
 * Past FIONREAD_MSGS messages it adds the most flow control lets a reader
 * hold (--max-backlog, or the reader's own SO_RCVBUF where that is larger):
 * an answer too large costs a reader one read that finds less, one too
 * small a reader that trusts it (nginx counts the answer down read by
 * read, and once past 0 waits for an edge: it hung with about 950
 * messages queued behind an older 256-message walk). */
static __always_inline __u32 psock_queued(struct sock *sk, struct sk_psock *psock)
{
	struct ingress_walk w = {
		.head = __builtin_preserve_access_index(&psock->ingress_msg),
		.pos = BPF_CORE_READ(psock, ingress_msg.next),
	};
	bpf_loop(FIONREAD_MSGS, ingress_step, &w, 0);
	if (w.pos && w.pos != w.head) {
		__u32 bound = cfg.max_backlog;
		__u32 rcvbuf = BPF_CORE_READ(sk, sk_rcvbuf);
		w.bytes += rcvbuf > bound ? rcvbuf : bound;
	}
	return w.bytes;
}

/* What this kernel's FIONREAD leaves out of a socket with a psock: bytes
 * TCP holds (6.18 without 04af4efde58a; as tcp_inq counts them, the FIN
 * not), or redirected ones (6.1). Only where no sk_skb verdict takes the
 * socket's TCP bytes (bypass's sockets, sk_msg only): with one, every byte
 * passes through the psock's queue and the kernel's own count, which this
 * would count twice. */
static __always_inline __u32 fionread_missing(struct sock *sk)
{
	unsigned long ud = (unsigned long)BPF_CORE_READ(sk, sk_user_data);
	if (!(ud & SK_USER_DATA_PSOCK))
		return 0;
	struct sk_psock *psock = (struct sk_psock *)(ud & SK_USER_DATA_PTRMASK);
	if (BPF_CORE_READ(psock, progs.stream_verdict) || BPF_CORE_READ(psock, progs.skb_verdict))
		return 0;
	if (cfg.fionread_misses_tcp)
		return tcp_data_queued(sk);
	if (PSOCK_COUNTS)
		return 0;
	return psock_queued(sk, psock);
}

/* The TCP socket open as fd in task if it has a psock (in a sockhash or
 * sockmap), else NULL. Every FIONREAD of the host comes here: where
 * bpf_rdonly_cast loads (6.2) the chain is read by direct loads, with one
 * helper call (the descriptor table's slot) where probe reads made eleven. */
static __always_inline struct sock *fd_psock_sock(struct task_struct *task, __u32 fd)
{
	if (cfg.probe_reads) {
		struct file *f = task_file(task, fd);
		struct socket *sock = f ? file_socket(f) : 0;
		struct sock *sk = sock ? BPF_CORE_READ(sock, sk) : 0;
		if (!sk || BPF_CORE_READ(sk, sk_protocol) != IPPROTO_TCP ||
		    !((unsigned long)BPF_CORE_READ(sk, sk_user_data) & SK_USER_DATA_PSOCK))
			return 0;
		return sk;
	}
	struct fdtable *fdt = task->files->fdt;
	if (!fdt || fd >= fdt->max_fds)
		return 0;
	struct file **fds = fdt->fd;
	void *slot = 0;
	if (bpf_probe_read_kernel(&slot, sizeof(slot), &fds[fd]) || !slot)
		return 0;
	struct file *f = bpf_rdonly_cast(slot, bpf_core_type_id_kernel(struct file));
	if ((f->f_inode->i_mode & S_IFMT) != S_IFSOCK)
		return 0;
	struct socket *sock = bpf_rdonly_cast(f->private_data, bpf_core_type_id_kernel(struct socket));
	struct sock *sk = sock->sk;
	if (!sk || sk->sk_protocol != IPPROTO_TCP || !((unsigned long)sk->sk_user_data & SK_USER_DATA_PSOCK))
		return 0;
	return sk;
}

/* The socket a FIONREAD that just returned asked about, if it is a TCP one
 * with a psock, with where the answer went; NULL after any other ioctl
 * (every ioctl of the host passes here: the first tests end the others). */
static __always_inline struct sock *fionread_sock(struct sys_exit_record *ctx, int **answer)
{
	if (ctx->ret)
		return 0;
	struct task_struct *task = bpf_get_current_task_btf();
	struct pt_regs *regs = (struct pt_regs *)bpf_task_pt_regs(task);
	if (!regs || (__u32)regs->si != FIONREAD)
		return 0;
	*answer = (int *)regs->dx;
	return fd_psock_sock(task, regs->di);
}

/* FIONREAD made to count every queued byte, on kernels whose answer leaves
 * some out while a socket is in a sockhash (fionread_missing): a reader
 * that reads only what FIONREAD announces, and waits or sleeps while told
 * 0 (a Java available() loop, nginx after a full buffer), is told what is
 * there. Runs as the ioctl returns, adds the missing bytes to the answer
 * the kernel wrote to the caller's memory (bpf_probe_write_user: refused
 * under lockdown, where shunt_fionread_told runs instead). Any socket with
 * a psock and no sk_skb verdict is corrected, shunt's or not: the answer
 * only becomes true. Attached only where FIONREAD misses bytes. */
SEC("tracepoint/syscalls/sys_exit_ioctl")
int shunt_fionread(struct sys_exit_record *ctx)
{
	int *answer = 0;
	struct sock *sk = fionread_sock(ctx, &answer);
	if (!sk)
		return 0;
	__u32 missing = fionread_missing(sk);
	int told = 0;
	if (!missing || bpf_probe_read_user(&told, sizeof(told), answer))
		return 0;
	told += missing;
	if (!bpf_probe_write_user(answer, &told, sizeof(told)))
		count(CNT_FIONREAD_CORRECTED);
	return 0;
}

/* Where the answer cannot be corrected (lockdown), a reader FIONREAD told
 * too few bytes of a socket shunt holds is noted as it is told: it may now
 * wait for an edge that never comes (nginx) or sleep until told more (a
 * Java available() loop), and one that asked before its first read is seen
 * by nothing else until the stall scan's 0.5 s (508-579 ms for such a
 * loop's first answer). The guard, told, runs the stall scan over the
 * reader's process at once, which sends the connection back to TCP, whose
 * FIONREAD is right, and wakes the reader (shunt_iter_stalls). A classic
 * tracepoint cannot start the leave itself: tracing programs of its kind
 * may not use bpf_timer. Once a connection: the mark stays until the scan
 * has looked. */
SEC("tracepoint/syscalls/sys_exit_ioctl")
int shunt_fionread_told(struct sys_exit_record *ctx)
{
	int *answer = 0;
	struct sock *sk = fionread_sock(ctx, &answer);
	if (!sk)
		return 0;
	__u32 missing = fionread_missing(sk);
	struct sock_state st;
	if (!missing || !sock_held_state(sk, &st))
		return 0;
	/* Leaving too: the scan hastens a leave that waits out its settle
	 * with only TCP bytes queued (its peer's reader blocked in recv). */
	struct peer_ref *ref = bpf_map_lookup_elem(&peer_refs, &st.self);
	if (!ref || (ref->reads & STATE_TOLD_SHORT))
		return 0;
	if (__sync_fetch_and_or(&ref->reads, STATE_TOLD_SHORT) & STATE_TOLD_SHORT)
		return 0;
	struct guard_event *ev = bpf_ringbuf_reserve(&guard_events, sizeof(*ev), 0);
	if (!ev) {
		/* Told at the next FIONREAD, or found by the scan's time. */
		__sync_fetch_and_and(&ref->reads, ~STATE_TOLD_SHORT);
		count(CNT_EVENTS_LOST);
		return 0;
	}
	__builtin_memset(ev, 0, sizeof(*ev));
	ev->self = st.self;
	ev->cookie = held_cookie(sk);
	ev->unread = missing;
	ev->pid = bpf_get_current_pid_tgid() >> 32;
	ev->kind = EVENT_TOLD_SHORT;
	current_comm(ev->comm);
	bpf_ringbuf_submit(ev, 0);
	return 0;
}
