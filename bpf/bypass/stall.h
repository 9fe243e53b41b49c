// SPDX-License-Identifier: GPL-2.0
/* Stalls and leaving: a reader that waits while bytes it cannot see are
 * queued is found (the read watch, the scan) and its connection moved back to
 * TCP, its reader woken; the peer_refs timer's callback runs both.
 *
 * Part of bypass.c, which includes the parts in order: each uses what the
 * ones before it define. */

/* Bytes TCP holds for the reader (the socket read through a probe-safe
 * pointer: the timer's untrusted one or a trusted one). */
static __always_inline __u32 tcp_queued(struct sock *sk)
{
	struct tcp_sock *tp = (struct tcp_sock *)sk;
	return BPF_CORE_READ(tp, rcv_nxt) - BPF_CORE_READ(tp, copied_seq);
}

/* The peer's end (its FIN) came. */
static __always_inline int sock_done(struct sock *sk)
{
	unsigned long flags = BPF_CORE_READ(sk, __sk_common.skc_flags);
	return (flags >> bpf_core_enum_value(enum sock_flags, SOCK_DONE)) & 1;
}

/* TCP's queued bytes, the peer's FIN (one sequence number) left out. */
static __always_inline __u32 tcp_data_queued(struct sock *sk)
{
	__u32 n = tcp_queued(sk);
	if (n && sock_done(sk))
		n--;
	return n;
}

/* Queued bytes that FIONREAD leaves out on this kernel: TCP's while the
 * socket is in a sockhash (6.18 without 04af4efde58a), redirected ones
 * where the psock does not count them (6.1), unless shunt corrects the
 * answer; and on any kernel TCP's behind a drained psock once flow control
 * sent bytes by TCP behind redirected ones. A reader that reads a full
 * buffer, asks FIONREAD and waits for the next edge when told 0 (nginx)
 * waits for ever with these queued and nothing else on the way. */
static __always_inline __u32 hidden_bytes(struct sock *sk, struct peer_ref *ref)
{
	__u32 n = 0;
	if (cfg.fionread_misses_tcp && !cfg.fionread_corrected)
		n += tcp_data_queued(sk);
	else if ((ref->reads & STATE_TCP_BEHIND) && ingress_empty(sk))
		/* Not hidden from FIONREAD, but from a reader that takes the
		 * short read which drained the psock for all there is and
		 * does not ask (nginx): the same wait for an edge. */
		n += tcp_data_queued(sk);
	if (!PSOCK_COUNTS && !cfg.fionread_corrected)
		n += unread_redirected(sk, ref);
	return n;
}

/* The peer's end (its FIN) came and the reader has not been told: TCP
 * counts the FIN as one sequence number in rcv_nxt, and a read moves
 * copied_seq past it, either returning 0 or with the last bytes before it;
 * only a read that returns 0 tells the reader (STATE_EOF_SEEN). FIONREAD
 * never counts it, on any kernel; a reader is told of it by the edge the
 * FIN's arrival raised, so one that let that edge pass (it read an earlier
 * edge's bytes to a full buffer and was told 0 more, or took its last read,
 * short and with the FIN, for all there is: nginx's stream proxy on 6.18,
 * woken by the stall watch through bytes FIONREAD hid) waits for ever. */
static __always_inline int end_unread(struct sock *sk, struct peer_ref *ref)
{
	if (!sock_done(sk))
		return 0;
	return tcp_queued(sk) != 0 || !(ref->reads & STATE_EOF_SEEN);
}

/* Someone waits on the socket: an epoll registration, or a poll, select or
 * blocking call asleep on it. With no one, any later wait sees what is
 * queued at once (poll, and epoll_ctl's add, test the socket's state). */
static __always_inline int has_waiter(struct sock *sk)
{
	struct socket *sock = BPF_CORE_READ(sk, sk_socket);
	if (!sock)
		return 0;
	struct list_head *head = __builtin_preserve_access_index(&sock->wq.wait.head);
	return BPF_CORE_READ(sock, wq.wait.head.next) != head;
}

/* What the reader may be waiting for without being told: bytes FIONREAD
 * does not count (the FIN's sequence number not among them), or the peer's
 * end, but only while someone waits on the socket. An end alone is told by
 * the edge of its arrival, which only a registration that already took that
 * edge (nginx's, edge-triggered) can have missed; a connection nobody
 * watches (a pool's idle one whose peer closed: Apache's to its origin) is
 * no stall, and over TCP would sit the same. Sets *bytes to those bytes. */
static __always_inline int may_stall(struct sock *sk, struct peer_ref *ref, __u32 *bytes)
{
	__u32 n = hidden_bytes(sk, ref);
	*bytes = n;
	return n || (end_unread(sk, ref) && has_waiter(sk));
}

/* How far the reader has read: TCP's copied_seq plus the redirected bytes
 * shunt counted it reading (6.1; 0 where the psock counts). Only grows. */
static __always_inline __u32 read_progress(struct sock *sk, struct peer_ref *ref)
{
	return BPF_CORE_READ((struct tcp_sock *)sk, copied_seq) + (__u32)ref->redirected_read;
}

/* Who reads a watched socket, for the guard to wake, and for a stall how
 * it was found. */
struct reader {
	__u64 cookie;
	__u64 ino;
	__u32 pid;
	char comm[COMM_LEN];
	__u32 found;     /* enum stall_found */
	__u32 asleep_in; /* FOUND_BY_WATCH: the system call */
	__u32 fd;        /* + 1, a hint (reader_fds); 0: unknown */
};

static __always_inline void reader_of(struct peer_ref *ref, struct reader *r)
{
	r->cookie = ref->cookie;
	r->ino = ref->reader_ino;
	r->pid = ref->reader_pid;
	__builtin_memcpy(r->comm, ref->reader_comm, sizeof(r->comm));
	__u32 *fd = bpf_map_lookup_elem(&reader_fds, &ref->cookie);
	r->fd = fd ? *fd : 0;
}

/* Tells the guard to wake the socket's reader: no BPF program can call
 * sk_data_ready, a setsockopt(SO_RCVLOWAT) from user space does. */
static __always_inline int report_stall(struct sock_key *key, struct reader *r, __u32 kind, __u32 hidden)
{
	struct guard_event *ev = bpf_ringbuf_reserve(&guard_events, sizeof(*ev), 0);
	if (!ev) {
		count(CNT_EVENTS_LOST);
		return 0;
	}
	ev->self = *key;
	ev->cookie = r->cookie;
	ev->unread = hidden;
	ev->pid = r->pid;
	ev->kind = kind;
	__builtin_memcpy(ev->comm, r->comm, sizeof(ev->comm));
	ev->ino = r->ino;
	ev->found = r->found;
	ev->asleep_in = r->asleep_in;
	ev->fd = r->fd;
	bpf_ringbuf_submit(ev, 0);
	return 1;
}

/* How often a rescued reader is looked at while it drains redirected bytes
 * FIONREAD does not count (6.1), to wake it once it has read. */
#define DRAIN_WAKE_NS (1000ULL * 1000)

/* What a reader that trusts FIONREAD reads after a wake-up: one buffer
 * (nginx's is 16 KiB). One that reads on by itself takes what is queued. */
#define ONE_BUFFER (64 << 10)

/* How long a reader that let a wake-up pass is not woken again. */
#define UNHEEDED_QUIET_NS (1000ULL * 1000 * 1000)

/* No redirect into sk can be on its way: TCP holds bytes for it and no
 * redirected one waits. A redirect is decided only when the reader has read
 * every TCP byte its peer sent, and lands inside that same sendmsg (a
 * socket's sends take turns), so none can be on its way behind TCP bytes
 * still unread. Not so for a splice reader: its peer redirects behind
 * unread redirected bytes whatever TCP holds. */
static __always_inline int nothing_landing(struct sock *sk, struct peer_ref *ref)
{
	return !(ref->reads & STATE_SPLICE) && tcp_queued(sk) && ingress_empty(sk);
}

/* Takes a socket whose reader needs TCP out of the sockhash, so it runs as
 * plain TCP again (the kernel restores its own receive path: FIONREAD,
 * MSG_WAITALL, splice and signals as TCP has them), then its peer likewise.
 * Not before leave_after: a redirect the peer decided before it saw the
 * switch completes inside its sendmsg after the verdict. Waits while
 * redirected bytes are unread (deleting would drop them). */
static __always_inline int leave(struct sock_key *key, struct peer_ref *ref, struct tcp_sock *tp)
{
	__u64 now = bpf_ktime_get_ns();
	/* The settle is for redirects on their way: none can be once only
	 * TCP bytes wait (a reader told 0 for them, as nginx by its FastCGI
	 * upstream's socket while php-fpm's left, waited the settle out). */
	if (now < ref->leave_after && !nothing_landing((struct sock *)tp, ref)) {
		arm(ref, ref->leave_after - now);
		return 0;
	}
	if (!ingress_empty((struct sock *)tp)) {
		/* A splice reader never reads them: a redirect decided before
		 * it was seen splicing landed after. */
		if (ref->reads & STATE_SPLICE)
			report_caught(ref, key, (struct sock *)tp);
		/* A rescued reader not told of them (6.1) reads one buffer a
		 * wake-up: wake it again as soon as it has read, or if a wake-up
		 * went unanswered for a while. */
		if (ref->reads & STATE_RESCUED) {
			__u32 progress = read_progress((struct sock *)tp, ref);
			if (progress != ref->watch_progress || now - ref->watch_at >= cfg.stall_ns) {
				struct reader r = {};
				reader_of(ref, &r);
				report_stall(key, &r, EVENT_WAKE, hidden_bytes((struct sock *)tp, ref));
				ref->watch_progress = progress;
				ref->watch_at = now;
			}
			arm(ref, DRAIN_WAKE_NS);
			return 0;
		}
		arm(ref, cfg.settle_ns);
		return 0;
	}
	struct peer_ref *peer = bpf_map_lookup_elem(&peer_refs, &ref->peer);
	/* Out of the sockhash, this socket's sends take TCP. Not while its
	 * peer may splice and holds redirected bytes: a splice would read
	 * those sends first. Until then they queue behind in the redirect
	 * (check_peer), or fail past the bound. */
	if (peer && (peer->reads & (STATE_SPLICE | STATE_MAY_SPLICE)) && peer->sk &&
	    !ingress_empty((struct sock *)peer->sk)) {
		arm(ref, cfg.settle_ns);
		return 0;
	}
	if (peer && !__sync_fetch_and_or(&peer->leaving, 1))
		start_leave(peer, cfg.settle_ns);
	/* The entry goes with the delete: what the wake-up needs, first. A
	 * reader watched for hidden bytes may have been told 0 by FIONREAD
	 * just before the leave; out of the sockhash it is told right, once
	 * woken. With no room to tell the guard, stay until there is: gone,
	 * nothing would look at this socket again. */
	__u32 queued = tcp_queued((struct sock *)tp);
	struct reader told = {};
	if ((ref->reads & STATE_WATCHED) && queued) {
		if (!guard_has_room()) {
			arm(ref, cfg.settle_ns);
			return 0;
		}
		reader_of(ref, &told);
	}
	/* Gone from peer_refs first: the peer's sends see no peer and take TCP. */
	struct sock_key k = *key;
	unpublish(&k);
	bpf_map_delete_elem(&sock_hash, &k);
	count(CNT_LEFT);
	if (told.pid)
		report_stall(&k, &told, EVENT_WAKE, queued);
	return 0;
}

/* The reader has not read for cfg.stall_ns since a read left bytes queued
 * that FIONREAD does not count, and sleeps in a wait for readiness: it may
 * be waiting for an edge that never comes (the writer is blocked on a full
 * window, or done). Its connection goes back to TCP, at once where TCP's
 * bytes are hidden (nothing can be redirected to a socket holding TCP bytes
 * unread: the ordering rule sends by TCP until they are read), and the
 * guard logs it and wakes the reader: once it has left (EVENT_WAKE), when
 * FIONREAD counts them, and while redirected bytes it is not told of stay
 * unread (6.1). */
static __always_inline void rescue(struct sock_key *key, struct peer_ref *ref, __u32 hidden, __u64 delay,
				   __u32 event, __u32 found, __u32 asleep_in)
{
	__u32 old = __sync_fetch_and_or(&ref->reads, STATE_TCP_READER | STATE_RESCUED | STATE_WATCHED);
	if (old & STATE_TCP_READER)
		return; /* leaving already */
	/* EVENT_WAKE: routine (stall_scan's end unread with nobody waiting),
	 * the guard only wakes the reader, neither counted nor logged. */
	if (event == EVENT_STALL_RESCUED)
		count(CNT_STALL_RESCUED);
	struct reader r = { .found = found, .asleep_in = asleep_in };
	reader_of(ref, &r);
	report_stall(key, &r, event, hidden);
	start_leave(ref, delay);
}

/* The socket a file is, or NULL. */
static __always_inline struct socket *file_socket(struct file *f)
{
	if ((BPF_CORE_READ(f, f_inode, i_mode) & S_IFMT) != S_IFSOCK)
		return 0;
	return BPF_CORE_READ(f, private_data);
}

/* The file open as fd in task, or NULL. */
static __always_inline struct file *task_file(struct task_struct *task, __u32 fd)
{
	struct fdtable *fdt = BPF_CORE_READ(task, files, fdt);
	if (!fdt || fd >= BPF_CORE_READ(fdt, max_fds))
		return 0;
	struct file **fds = BPF_CORE_READ(fdt, fd);
	struct file *f = 0;
	if (bpf_probe_read_kernel(&f, sizeof(f), &fds[fd]))
		return 0;
	return f;
}

#define WAITERS_LOOKED_AT 8
#define INPUT_EVENTS 0x41 /* EPOLLIN | EPOLLRDNORM: select's read set asks both */

/* Whether task's wait asks for sk's input: 1, 0, or -1 when it cannot tell
 * (more waiters on the socket than looked at). ep is the eventpoll task
 * sleeps on in epoll_wait, or NULL for poll and select. The socket's wait
 * queue holds an entry per waiter; each is taken for the kind asked about
 * and its owner compared (read fault-safe: another kind of entry compares
 * unequal), then the events it registered read. An epoll set or a poll
 * that watches the socket for output only (OpenSSH's channel, its window
 * full) does not wait for input. */
static __always_inline int awaits_input(struct task_struct *task, struct eventpoll *ep, struct sock *sk)
{
	struct socket *sock = BPF_CORE_READ(sk, sk_socket);
	if (!sock)
		return -1;
	struct list_head *head = __builtin_preserve_access_index(&sock->wq.wait.head);
	struct list_head *node = BPF_CORE_READ(sock, wq.wait.head.next);
	__u64 entry = bpf_core_field_offset(struct wait_queue_entry, entry);
	__u64 epoll_back = bpf_core_field_offset(struct eppoll_entry, wait) + entry;
	__u64 poll_back = bpf_core_field_offset(struct poll_table_entry, wait) + entry;
	for (int i = 0; i < WAITERS_LOOKED_AT; i++) {
		if (!node || node == head)
			return 0;
		__u32 events = 0;
		if (ep) {
			struct eppoll_entry *pwq = (struct eppoll_entry *)((unsigned long)node - epoll_back);
			struct epitem *epi = BPF_CORE_READ(pwq, base);
			if (BPF_CORE_READ(epi, ep) == ep)
				events = BPF_CORE_READ(epi, event.events);
		} else {
			struct poll_table_entry *pe = (struct poll_table_entry *)((unsigned long)node - poll_back);
			struct poll_wqueues *pwq = BPF_CORE_READ(pe, wait.private);
			if (pwq && BPF_CORE_READ(pwq, polling_task) == task)
				events = BPF_CORE_READ(pe, key);
		}
		if (events & INPUT_EVENTS)
			return 1;
		node = BPF_CORE_READ(node, next);
	}
	return node == head ? 0 : -1;
}

/* The eventpoll of the epoll file open as epfd in task, or NULL. */
static __always_inline struct eventpoll *task_eventpoll(struct task_struct *task, __u32 epfd)
{
	struct file *f = task_file(task, epfd);
	return f ? BPF_CORE_READ(f, private_data) : 0;
}

/* The thread that read last sleeps in a wait for readiness that may be
 * for this socket's input (epoll_wait on a set that watches it for input,
 * poll or select asking for its input, io_uring_enter): it may be waiting
 * for an edge. One that runs, waits for a CPU or sleeps elsewhere (a Go
 * thread parked in futex while its goroutine waits for a turn, a select
 * without descriptors used as a sleep, an epoll set that does not watch
 * this socket's input) reads on by itself. Read through the thread's saved pointers, fault-safe: a
 * thread gone reads as not waiting. */
static __always_inline int waits_for_readiness(struct peer_ref *ref, struct sock *sk, __u32 *asleep_in)
{
	struct task_struct *task = ref->reader_task;
	struct pt_regs *regs = (struct pt_regs *)ref->reader_regs;
	if (!task || !regs)
		return 0;
	if (!(BPF_CORE_READ(task, __state) & TASK_INTERRUPTIBLE))
		return 0;
	unsigned long nr = BPF_CORE_READ(regs, orig_ax);
	*asleep_in = nr;
	if (nr == cfg.uring_nr)
		return 1;
	/* An epoll set without this socket's input (PostgreSQL's latch wait,
	 * in a COPY that left bytes unread), a select or poll without it
	 * (pg_usleep's select without descriptors; OpenSSH's ppoll while its
	 * channel's window is full) waits for something else: no edge of this
	 * socket is awaited there. Where it cannot tell, it takes it as a
	 * wait. */
	if (nr == cfg.epoll_nrs[0] || nr == cfg.epoll_nrs[1] || nr == cfg.epoll_nrs[2]) {
		struct eventpoll *ep = task_eventpoll(task, BPF_CORE_READ(regs, di));
		return !ep || awaits_input(task, ep, sk) != 0;
	}
	if (nr == cfg.poll_nrs[0] || nr == cfg.poll_nrs[1] || nr == cfg.poll_nrs[2] || nr == cfg.poll_nrs[3])
		return awaits_input(task, 0, sk) != 0;
	return 0;
}

/* When a rescued socket may leave the sockhash: at once while TCP holds
 * bytes for it and no redirected one waits (a redirect is decided only when
 * the reader has read every TCP byte its peer sent, and lands inside that
 * same sendmsg, so none can be on its way behind TCP bytes still unread);
 * else after the settle, as any switch. shunt's own count of redirected
 * bytes (6.1) includes one still landing: it is no proof. */
static __always_inline __u64 move_delay(struct sock *sk, struct peer_ref *ref)
{
	return nothing_landing(sk, ref) ? 0 : cfg.settle_ns;
}

/* How long a watched reader may go without reading before it is looked
 * at. Where the read left only TCP bytes and this kernel's FIONREAD, not
 * corrected, answers 0 for them (6.18 under lockdown), a reader that trusts
 * FIONREAD waits at once, and one that does not reads again at once: it is
 * looked at sooner (an upload sent with its header in one write, which
 * nginx reads after its first buffer, took 20 ms more than over TCP). A
 * reader found running then is looked at again after stall_ns: a timer
 * every 2 ms for each busy reader would cost more than it saves. */
static __always_inline __u64 stall_after(struct sock *sk)
{
	if (cfg.fionread_misses_tcp && !cfg.fionread_corrected && ingress_empty(sk) && tcp_data_queued(sk))
		return cfg.told_zero_ns;
	return cfg.stall_ns;
}

/* SOCK_NOSPACE in a struct socket's flags (include/linux/net.h), the same
 * bit on every kernel: a send found the buffer full, and its writer waits
 * to be told of room (EPOLLOUT). */
#define SOCK_NOSPACE_BIT 2

/* How many descriptor slots one look of writer_blocked reads (a bpf_loop
 * step each, a few fault-safe reads for a socket), and how often a process
 * is looked through at most: a process with many sockets stuck at once
 * (nginx told 0 on each new upstream) pays one look per ROOM_LOOK_NS, not
 * one per socket. */
#define FDS_PER_LOOK 4096
#define ROOM_LOOK_NS (10ULL * 1000 * 1000)

/* A socket whose writer waits for room now. TCP clears the bit once there
 * is (sk_stream_write_space); AF_UNIX and UDP leave it set, so for them the
 * buffer must still be full by AF_UNIX's measure (a quarter of SO_SNDBUF). */
static __always_inline int waits_for_room(struct socket *sock)
{
	if (!(BPF_CORE_READ(sock, flags) & (1UL << SOCK_NOSPACE_BIT)))
		return 0;
	struct sock *sk = BPF_CORE_READ(sock, sk);
	if (!sk)
		return 0;
	if (BPF_CORE_READ(sk, sk_protocol) == IPPROTO_TCP)
		return 1;
	__s64 held = BPF_CORE_READ(sk, sk_wmem_alloc.refs.counter);
	return held * 4 > BPF_CORE_READ(sk, sk_sndbuf);
}

/* Whether descriptor fd of the table is a socket waiting for room. */
static __always_inline int fd_waits_for_room(struct file **fds, __u32 fd)
{
	struct file *f = 0;
	if (bpf_probe_read_kernel(&f, sizeof(f), &fds[fd]) || !f)
		return 0;
	struct socket *sock = file_socket(f);
	return sock && waits_for_room(sock);
}

/* writer_blocked's look through a descriptor table, for bpf_loop. */
struct room_walk {
	struct file **fds;
	__u32 from;
	__u32 to;
	__u32 found; /* 1 + the descriptor, or 0 */
};

static long room_step(__u64 i, struct room_walk *w)
{
	__u32 fd = w->from + (__u32)i;
	if (fd >= w->to)
		return 1;
	if (fd_waits_for_room(w->fds, fd)) {
		w->found = fd + 1;
		return 1;
	}
	return 0;
}

/* Whether the process of the thread that read last waits for room to write
 * on one of its sockets, or may (not looked through whole yet). Asleep so,
 * it may wait for a write to go through: a proxy whose client is a moment
 * slow (tokio's copy reads one buffer and waits on its write; Go's io.Copy,
 * nats-server) reads on once it does; a wake-up would make it read one
 * buffer more and wait again, which looks like nginx told 0, and moves it
 * to TCP. So stall_check gives such a reader stall_ns more before it wakes
 * it, once a watch: which of its sockets a process fills cannot be told
 * apart here, and nginx told 0 while another client of its worker is slow
 * waited the stall scan's time, twice, when this held it back until then
 * (1.27 s for a 1 MiB download; a proxy whose client stays slow is moved to
 * TCP, where it loses nothing: the client sets the pace).
 * Looked up only here, when a reader seems stuck: a tracepoint on every
 * send of the host that noted each EAGAIN cost plain TCP streams of small
 * writes 15-31%, shunt's or not (docs/BENCHMARKS.md). The socket found is
 * looked at first next time (a slow client stays slow for a while). Else
 * one look reads FDS_PER_LOOK descriptor slots, at most one a ROOM_LOOK_NS
 * per process, the next going on where this one stopped: until a pass
 * from slot 0 to the end has found none, the answer is "may", and a reader
 * stuck for want of an edge (nginx told 0) in a process with more than
 * FDS_PER_LOOK descriptors is woken a look or two later. */
static __always_inline int writer_blocked(struct peer_ref *ref, __u64 now)
{
	struct task_struct *task = ref->reader_task;
	if (!task)
		return 0;
	struct files_struct *files = BPF_CORE_READ(task, files);
	if (!files)
		return 0;
	struct fdtable *fdt = BPF_CORE_READ(files, fdt);
	if (!fdt)
		return 0;
	struct file **fds = BPF_CORE_READ(fdt, fd);
	__u32 max_fds = BPF_CORE_READ(fdt, max_fds);
	__u32 tgid = BPF_CORE_READ(task, tgid);
	struct room_seen *seen = bpf_map_lookup_elem(&room_seen, &tgid);
	if (!seen || seen->files != (__u64)files) {
		/* A process not looked at before, or a pid used again. */
		struct room_seen fresh = { .files = (__u64)files };
		bpf_map_update_elem(&room_seen, &tgid, &fresh, BPF_ANY);
		seen = bpf_map_lookup_elem(&room_seen, &tgid);
		if (!seen)
			return 0;
	}
	__u32 last = seen->found;
	if (last && last <= max_fds && fd_waits_for_room(fds, last - 1))
		return 1;
	if (seen->looked_at && now - seen->looked_at < ROOM_LOOK_NS)
		return !seen->clear;
	seen->looked_at = now;
	struct room_walk w = { .fds = fds, .from = seen->next < max_fds ? seen->next : 0 };
	w.to = max_fds - w.from > FDS_PER_LOOK ? w.from + FDS_PER_LOOK : max_fds;
	if (!w.from)
		seen->clean = 1;
	bpf_loop(FDS_PER_LOOK, room_step, &w, 0);
	seen->found = w.found;
	if (w.found) {
		seen->clean = 0;
		seen->clear = 0;
		seen->next = w.found < max_fds ? w.found : 0;
		return 1;
	}
	if (w.to < max_fds) {
		seen->next = w.to;
		return !seen->clear;
	}
	seen->next = 0;
	seen->clear = seen->clean;
	return !seen->clear;
}

/* How much longer a reader woken by the stall watch (at ref->watch_at) is
 * given to answer before it counts as waiting for something else: stall_ns
 * from when the guard delivered the wake-up, and until then, looked at
 * every stall_ns, the scan's time from the report. Counted from the report,
 * a guard 60 ms behind made a reader that read at once look unheeding, left
 * to the scan. 0: its time is up. */
static __always_inline __u64 answer_time_left(struct peer_ref *ref, __u64 now)
{
	__u64 *delivered = bpf_map_lookup_elem(&wakes_delivered, &ref->cookie);
	if (delivered && *delivered >= ref->watch_at)
		return now - *delivered < cfg.stall_ns ? cfg.stall_ns - (now - *delivered) : 0;
	return now - ref->watch_at < cfg.scan_stall_ns ? cfg.stall_ns : 0;
}

static __always_inline int stall_check(struct sock_key *key, struct peer_ref *ref, struct tcp_sock *tp)
{
	if (!(ref->reads & STATE_WATCHED))
		return 0;
	struct sock *sk = (struct sock *)tp;
	__u32 hidden;
	if (!may_stall(sk, ref, &hidden)) {
		__sync_fetch_and_and(&ref->reads, ~(STATE_WATCHED | STATE_WOKEN));
		/* A read may have left some between the test and the clear
		 * and found the watch on. */
		if (!may_stall(sk, ref, &hidden) || (__sync_fetch_and_or(&ref->reads, STATE_WATCHED) & STATE_WATCHED))
			return 0;
	}
	__u64 now = bpf_ktime_get_ns();
	__u32 progress = read_progress(sk, ref);
	__u64 wait = stall_after(sk);
	if (progress != ref->watch_progress) {
		/* Read since, and some still hidden: watch on from now. */
		ref->watch_progress = progress;
		ref->watch_at = now;
		arm(ref, wait);
		return 0;
	}
	if (now - ref->watch_at < wait) {
		arm(ref, wait - (now - ref->watch_at));
		return 0;
	}
	__u32 asleep_in = 0;
	if (!waits_for_readiness(ref, sk, &asleep_in)) {
		arm(ref, cfg.stall_ns);
		return 0;
	}
	int woken = ref->reads & STATE_WOKEN;
	if (!woken && now - ref->watch_at < wait + cfg.stall_ns && writer_blocked(ref, now)) {
		/* Not woken yet, not moved: looked at again when its write has
		 * had stall_ns more to go through. */
		arm(ref, wait + cfg.stall_ns - (now - ref->watch_at));
		return 0;
	}
	if (!woken && ref->unheeded && (__u32)((now >> 20) - ref->unheeded) < (UNHEEDED_QUIET_NS >> 20)) {
		/* It let a wake-up pass a moment ago: it reads when what it
		 * waits for comes. Not woken again within the quiet time (a
		 * Go proxy pauses at each write to a slow client; each wake
		 * costs the guard a few system calls, and a look through its
		 * descriptors where it does not know which to take). */
		__sync_fetch_and_and(&ref->reads, ~STATE_WATCHED);
		return 0;
	}
	if (!woken || progress - ref->woke_progress > ONE_BUFFER) {
		/* A pause looks the same as a wait for an edge (nats-server
		 * stops reading a publisher while its subscribers are slow; a
		 * Go proxy blocks in a write to a slow client), so it is no
		 * proof of a reader misled. Wake it: one that reads on by
		 * itself takes what is queued; one that trusts FIONREAD, or
		 * took a short read for all there is, reads one buffer and
		 * stops again, and is moved to TCP at that stop; one that
		 * waits for something else reads nothing (below). Looked at
		 * again as soon as after a read (2 ms where FIONREAD answers 0
		 * for TCP's bytes: nginx on 6.18). Not woken while the guard's
		 * ring has no room: tried again. */
		struct reader r = { .found = FOUND_BY_WATCH, .asleep_in = asleep_in };
		reader_of(ref, &r);
		if (report_stall(key, &r, EVENT_WAKE, hidden)) {
			ref->woke_progress = progress;
			__sync_fetch_and_or(&ref->reads, STATE_WOKEN);
		}
		ref->watch_at = now;
		arm(ref, wait);
		return 0;
	}
	if (progress == ref->woke_progress) {
		/* Woken, and nothing read: it waits for something else (its
		 * own writes, held back by their reader), not for this
		 * socket's edge, which it got. Given stall_ns to answer the
		 * wake-up once the guard has delivered it (up to the scan's
		 * time while it has not); then watched again from its next
		 * read, and the stall scan still looks at it. */
		__u64 wait_more = answer_time_left(ref, now);
		if (wait_more) {
			arm(ref, wait_more);
			return 0;
		}
		ref->unheeded = (now >> 20) | 1;
		__sync_fetch_and_and(&ref->reads, ~(STATE_WATCHED | STATE_WOKEN));
		return 0;
	}
	rescue(key, ref, hidden, move_delay(sk, ref), EVENT_STALL_RESCUED, FOUND_BY_WATCH, asleep_in);
	return leave(key, ref, tp);
}

/* A socket's timer: the leave once the socket's reader needs TCP (or its
 * peer left), else the stall watch. Nothing if the slot changed hands. */
static int leave_timer_cb(void *map, __u32 *slot, struct leave_timer *t)
{
	struct sock_key key = t->owner;
	struct peer_ref *ref = bpf_map_lookup_elem(&peer_refs, &key);
	if (!ref || ref->timer != *slot + 1)
		return 0;
	struct tcp_sock *tp = ref->sk;
	if (!tp)
		return 0;
	if (ref->leaving || (ref->reads & STATE_TCP_READER))
		return leave(&key, ref, tp);
	return stall_check(&key, ref, tp);
}
