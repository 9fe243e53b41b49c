// SPDX-License-Identifier: GPL-2.0
/* Programs that splice: who a reader is (command and arguments), learned at
 * its first splice so that its later readers stay on TCP, and the events the
 * guard is sent for a connection caught with bytes it cannot read.
 *
 * Part of bypass.c, which includes the parts in order: each uses what the
 * ones before it define. */

/* The calling process's command name (its thread group leader's). */
static __always_inline void current_comm(char *comm)
{
	struct task_struct *task = bpf_get_current_task_btf();
	struct task_struct *leader = task->group_leader;
	if (leader)
		bpf_probe_read_kernel_str(comm, COMM_LEN, leader->comm);
}

#define FNV_OFFSET 0xcbf29ce484222325ULL
#define FNV_PRIME 0x100000001b3ULL

/* Hashing a command line (current_program, struct args_walk), one byte per bpf_loop step:
 * the program is its command and the arguments up to the first that is not
 * an option ("python3 app.py", "java -jar app.jar", "python3 -m module");
 * later arguments (a port) do not make another program. */

/* bpf_loop takes its context on the stack: the walk is in a map. */
struct walk_ref {
	struct args_walk *w;
};

static long args_step(__u64 i, struct walk_ref *ref)
{
	struct args_walk *w = ref->w;
	if (!w || i >= w->len || i >= ARGS_LEN)
		return 1;
	__u8 c = w->args[i & (ARGS_LEN - 1)];
	if (w->at_start && w->arg > 0 && c != '-')
		w->last = 1;
	w->hash = (w->hash ^ c) * FNV_PRIME;
	w->end = i + 1;
	if (c)
		w->at_start = 0;
	else if (w->last)
		return 1;
	else {
		w->arg++;
		w->at_start = 1;
	}
	return 0;
}

/* The calling process as learning knows it: command name and a hash of the
 * part of its command line that names the program. Returns the walk, whose
 * args hold the start of the line (user space cuts it as the hash did). A
 * kernel thread (no mm) or an unreadable line hashes as an empty one. */
static __always_inline struct args_walk *current_program(struct splice_program *prog)
{
	current_comm(prog->comm);
	__u32 zero = 0;
	struct args_walk *w = bpf_map_lookup_elem(&args_scratch, &zero);
	if (!w)
		return 0;
	w->len = 0;
	w->hash = FNV_OFFSET;
	w->arg = 0;
	w->at_start = 1;
	w->last = 0;
	w->end = 0;
	struct task_struct *task = bpf_get_current_task_btf();
	struct mm_struct *mm = task->mm;
	if (mm) {
		unsigned long start = BPF_CORE_READ(mm, arg_start), end = BPF_CORE_READ(mm, arg_end);
		__u64 len = end > start ? end - start : 0;
		if (len > ARGS_LEN)
			len = ARGS_LEN;
		if (len && !bpf_probe_read_user(w->args, len, (void *)start))
			w->len = len;
	}
	struct walk_ref ref = { .w = w };
	bpf_loop(ARGS_LEN, args_step, &ref, 0);
	prog->args = w->hash ? w->hash : 1; /* 0 means any command line */
	return w;
}

/* What is known of a program: by its command line, or else by its
 * command taught by name. */
static __always_inline struct splice_seen *known_program(struct splice_program *prog)
{
	struct splice_seen *seen = bpf_map_lookup_elem(&splice_programs, prog);
	if (seen || !prog->args)
		return seen;
	struct splice_program by_name = { .args = 0 };
	__builtin_memcpy(by_name.comm, prog->comm, sizeof(by_name.comm));
	return bpf_map_lookup_elem(&splice_programs, &by_name);
}

/* The calling process was seen splicing from a TCP socket before: this
 * very command line, or its command taught by name. */
static __always_inline int learned_splicer(struct splice_program *prog)
{
	current_program(prog);
	return known_program(prog) != 0;
}

/* Redirected bytes waiting in the socket's psock for a reader. */
static __always_inline __u64 unread_redirected(struct sock *sk, struct peer_ref *ref)
{
	unsigned long ud = (unsigned long)BPF_CORE_READ(sk, sk_user_data);
	struct sk_psock *psock = (struct sk_psock *)(ud & SK_USER_DATA_PTRMASK);
	if (!psock)
		return 0;
	if (PSOCK_COUNTS)
		return BPF_CORE_READ(psock, msg_tot_len);
	/* shunt's own count can only be an estimate: never 0 while the
	 * queue holds anything. */
	__u32 n = counted_unread(ref);
	return n ? n : !ingress_empty(sk);
}

/* Counts what a program's splices did (on its name's entry if it was
 * taught by name); adds the program when new (with the start of its
 * command line, from the walk that hashed it) and then returns 1. */
static __always_inline int learn(struct splice_program *prog, struct args_walk *w, __u64 splices, __u64 caught)
{
	struct splice_seen *seen = known_program(prog);
	__u64 now = bpf_ktime_get_ns();
	if (!seen) {
		/* Without a walk (from a timer: not the splicer's context), an
		 * entry the LRU dropped comes back without its line. */
		__u32 zero = 0;
		int line = w != 0;
		if (!w)
			w = bpf_map_lookup_elem(&args_scratch, &zero);
		if (!w)
			return 0;
		struct splice_seen *fresh = &w->fresh;
		fresh->first_ns = now;
		fresh->last_ns = now;
		fresh->splices = splices;
		fresh->caught = caught;
		if (line)
			__builtin_memcpy(fresh->cmdline, w->args, sizeof(fresh->cmdline));
		else
			__builtin_memset(fresh->cmdline, 0, sizeof(fresh->cmdline));
		return !bpf_map_update_elem(&splice_programs, prog, fresh, BPF_NOEXIST);
	}
	seen->last_ns = now;
	__sync_fetch_and_add(&seen->splices, splices);
	if (caught)
		__sync_fetch_and_add(&seen->caught, caught);
	return 0;
}

/* Room in the guard's ring for a few more events. Asked before a step that
 * cannot be taken back and must be followed by one (a reservation held
 * across it is refused by 6.1's verifier). Another producer may take the
 * room first: rare, and counted as lost. */
static __always_inline int guard_has_room(void)
{
	__u64 size = bpf_ringbuf_query(&guard_events, BPF_RB_RING_SIZE);
	__u64 used = bpf_ringbuf_query(&guard_events, BPF_RB_AVAIL_DATA);
	return used + 4 * (sizeof(struct guard_event) + 8) < size;
}

/* Marks a connection caught and reserves its event for the guard: 0 if it
 * was caught already, or if the ring has no room (a guard that fell behind,
 * or none yet), when it is unmarked and counted lost: caught with nobody
 * told, its reader would wait for ever, so whoever found it must report it
 * again. */
static __always_inline struct guard_event *reserve_caught(struct peer_ref *ref)
{
	if (__sync_fetch_and_or(&ref->reads, STATE_CAUGHT) & STATE_CAUGHT)
		return 0;
	struct guard_event *ev = bpf_ringbuf_reserve(&guard_events, sizeof(*ev), 0);
	if (!ev) {
		__sync_fetch_and_and(&ref->reads, ~STATE_CAUGHT);
		count(CNT_EVENTS_LOST);
	}
	return ev;
}

/* A splice reader with redirected bytes queued that splice(2) cannot read:
 * without help it waits for them for ever. Reported once, to the guard,
 * which resets the connection so the application sees an error. Unless
 * the peer's end of stream is queued already (count_cut_short): no hook
 * runs before the splice reads on these kernels, so that cannot be
 * prevented, only told (EVENT_SPLICE_TRUNCATED, CNT_SPLICE_TRUNCATED). */
static __always_inline void report_caught(struct peer_ref *ref, struct sock_key *key, struct sock *sk)
{
	/* With the ring full, the leave timer, which comes back while the
	 * bytes wait, reports it again. */
	struct guard_event *ev = reserve_caught(ref);
	if (!ev)
		return;
	count(CNT_SPLICE_CAUGHT);
	__u8 state = BPF_CORE_READ(sk, __sk_common.skc_state);
	int ended = state == TCP_CLOSE_WAIT || state == TCP_LAST_ACK || state == TCP_CLOSING;
	if (ended)
		count_cut_short(ref);
	ev->self = *key;
	ev->cookie = ref->cookie;
	ev->unread = unread_redirected(sk, ref);
	ev->pid = ref->splicer_pid;
	ev->kind = ended ? EVENT_SPLICE_TRUNCATED : EVENT_SPLICE_CAUGHT;
	__builtin_memcpy(ev->comm, ref->splicer_comm, sizeof(ev->comm));
	bpf_ringbuf_submit(ev, 0);
	/* Counted with the program once told (a catch whose event found no
	 * room comes back), and not while the reservation is held: 6.1's
	 * verifier refuses learn()'s map calls then. */
	struct splice_program prog = { .args = ref->splicer_args };
	__builtin_memcpy(prog.comm, ref->splicer_comm, sizeof(prog.comm));
	if (prog.comm[0])
		learn(&prog, 0, 0, 1);
}

/* Fills a reserved event for the guard about a reader, the calling task,
 * and the redirected bytes queued for it. */
static __always_inline void fill_reader_event(struct guard_event *ev, struct peer_ref *ref, struct sock_key *key,
					      struct sock *sk, __u32 kind, __u64 ino)
{
	__builtin_memset(ev, 0, sizeof(*ev));
	ev->self = *key;
	/* The getsockopt hook cannot make a cookie: one nothing made yet is
	 * 0, and ~0 has sock_diag match on the tuple alone, in the socket's
	 * namespace unique to an established socket. */
	__u64 cookie = ref->cookie ? ref->cookie : sock_cookie(sk);
	ev->cookie = cookie ? cookie : ~0ULL;
	ev->unread = unread_redirected(sk, ref);
	ev->pid = bpf_get_current_pid_tgid() >> 32;
	ev->kind = kind;
	ev->ino = ino;
	current_comm(ev->comm);
}

/* A zerocopy reader (shunt_getsockopt) with redirected bytes queued, which
 * its getsockopt(TCP_ZEROCOPY_RECEIVE) cannot map: reported once, to the
 * guard, which resets the connection. Told again at its next call if the
 * ring had no room. */
static __always_inline void report_zerocopy_caught(struct peer_ref *ref, struct sock_key *key, struct sock *sk)
{
	struct guard_event *ev = reserve_caught(ref);
	if (!ev)
		return;
	count(CNT_ZEROCOPY_CAUGHT);
	fill_reader_event(ev, ref, key, sk, EVENT_ZEROCOPY_CAUGHT, 0);
	bpf_ringbuf_submit(ev, 0);
}
