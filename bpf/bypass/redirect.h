// SPDX-License-Identifier: GPL-2.0
/* The send path: for each send of a held socket, sk_msg decides whether its
 * peer can take it by redirect (ordering, flow control, the peer's reader, a
 * join's shortcut) or it takes TCP.
 *
 * Part of bypass.c, which includes the parts in order: each uses what the
 * ones before it define. */

/* Decides, for one send, whether the peer can take it by redirect:
 * REDIRECT_OK, or why not. The peer's socket is reached through the pointer
 * it published; it may be closing, in which case the answer may be wrong
 * only towards TCP or towards a redirect that then finds no peer and takes
 * TCP after all. */
enum redirect_check {
	REDIRECT_OK,
	REDIRECT_NO_PEER,    /* not paired yet, or gone */
	REDIRECT_TCP_UNREAD, /* bytes we sent over TCP are not all read */
	REDIRECT_BACKLOG,    /* flow control: the reader is too far behind */
	REDIRECT_READER,     /* the peer's reader is unproven, or needs TCP */
	REDIRECT_REFUSE,     /* the peer splices with redirected bytes unread: neither path is in order */
	REDIRECT_JOINED,     /* a kernel join holds the peer: only through_join may pass it by */
};

/* The psock counts the bytes queued on it (msg_tot_len) on newer kernels;
 * on older ones (6.1) shunt counts them in the receiver's peer_ref. */
#define PSOCK_COUNTS bpf_core_field_exists(((struct sk_psock *)0)->msg_tot_len)

static __always_inline __u32 counted_unread(struct peer_ref *ref)
{
	__u64 in = ref->redirected_in, read = ref->redirected_read;
	/* A reader may take bytes before the sender counted them. */
	return read >= in ? 0 : (__u32)(in - read);
}

/* The peer's socket, read through the pointer it published. clang 14 emits
 * no BTF type tags, so the verifier sees that pointer as a number: where the
 * kernel has bpf_rdonly_cast (6.2) the cast makes its fields loadable
 * directly (fault-safe, as bpf_probe_read_kernel is, without a helper call
 * each: this runs on every send); older kernels read them with
 * bpf_probe_read_kernel. */
static __always_inline __u32 peer_copied_seq(void *sk)
{
	if (cfg.probe_reads)
		return BPF_CORE_READ((struct tcp_sock *)sk, copied_seq);
	struct tcp_sock *tp = bpf_rdonly_cast(sk, bpf_core_type_id_kernel(struct tcp_sock));
	return tp->copied_seq;
}

static __always_inline __u64 sock_cookie(void *sk)
{
	if (cfg.probe_reads)
		return BPF_CORE_READ((struct sock *)sk, __sk_common.skc_cookie.counter);
	struct sock *s = bpf_rdonly_cast(sk, bpf_core_type_id_kernel(struct sock));
	return s->__sk_common.skc_cookie.counter;
}

static __always_inline __u32 peer_write_seq(void *sk)
{
	if (cfg.probe_reads)
		return BPF_CORE_READ((struct tcp_sock *)sk, write_seq);
	struct tcp_sock *tp = bpf_rdonly_cast(sk, bpf_core_type_id_kernel(struct tcp_sock));
	return tp->write_seq;
}

/* Whether a kernel join (shunt proxy, splice, daemon) holds the socket of
 * this psock as well: its sk_skb verdict reads the socket's TCP queue and
 * never sees a redirected message, and its sends are the join's, which counts
 * them as TCP sends. Such a socket stays on TCP both ways. */
static __always_inline int psock_joined(unsigned long psock)
{
	if (cfg.probe_reads) {
		struct sk_psock *p = (struct sk_psock *)psock;
		return BPF_CORE_READ(p, progs.stream_verdict) || BPF_CORE_READ(p, progs.skb_verdict);
	}
	struct sk_psock *p = bpf_rdonly_cast((void *)psock, bpf_core_type_id_kernel(struct sk_psock));
	return p->progs.stream_verdict || p->progs.skb_verdict;
}

/* The psock of a socket in a sockmap or sockhash, 0 if none. */
static __always_inline unsigned long sock_psock(void *sk)
{
	if (cfg.probe_reads)
		return (unsigned long)BPF_CORE_READ((struct sock *)sk, sk_user_data) & SK_USER_DATA_PTRMASK;
	struct sock *s = bpf_rdonly_cast(sk, bpf_core_type_id_kernel(struct sock));
	return (unsigned long)s->sk_user_data & SK_USER_DATA_PTRMASK;
}

/* No redirected byte waits in the socket's receive queues. */
static __always_inline int ingress_empty(struct sock *sk)
{
	unsigned long ud = (unsigned long)BPF_CORE_READ(sk, sk_user_data);
	struct sk_psock *psock = (struct sk_psock *)(ud & SK_USER_DATA_PTRMASK);
	if (!psock)
		return 1;
	struct list_head *head = __builtin_preserve_access_index(&psock->ingress_msg);
	return BPF_CORE_READ(psock, ingress_msg.next) == head && !BPF_CORE_READ(psock, ingress_skb.qlen);
}

/* Redirected bytes the peer's reader has not read. */
static __always_inline __u32 peer_unread(struct peer_ref *ref, unsigned long ud)
{
	if (cfg.probe_reads) {
		if (PSOCK_COUNTS)
			return BPF_CORE_READ((struct sk_psock *)ud, msg_tot_len);
		return counted_unread(ref);
	}
	struct sk_psock *psock = bpf_rdonly_cast((void *)ud, bpf_core_type_id_kernel(struct sk_psock));
	return psock->msg_tot_len;
}

/* The most a socket's buffer may hold, sending or receiving: the size its
 * application set (SO_SNDBUF, SO_RCVBUF: *set), else what TCP grows it to,
 * its netns's tcp_wmem[2] or tcp_rmem[2]. */
static __always_inline __u32 buf_most(void *sk, int send, int *set)
{
	__u8 lock = send ? SOCK_SNDBUF_LOCK : SOCK_RCVBUF_LOCK;
	int most;
	if (cfg.probe_reads) {
		struct sock *s = sk;
		/* A 4-bit field before 6.5ish, a byte after: read it as either. */
		*set = !!(BPF_CORE_READ_BITFIELD_PROBED(s, sk_userlocks) & lock);
		if (*set)
			most = send ? BPF_CORE_READ(s, sk_sndbuf) : BPF_CORE_READ(s, sk_rcvbuf);
		else if (send)
			most = BPF_CORE_READ(s, __sk_common.skc_net.net, ipv4.sysctl_tcp_wmem[2]);
		else
			most = BPF_CORE_READ(s, __sk_common.skc_net.net, ipv4.sysctl_tcp_rmem[2]);
	} else {
		struct sock *s = bpf_rdonly_cast(sk, bpf_core_type_id_kernel(struct sock));
		*set = !!(s->sk_userlocks & lock);
		if (*set) {
			most = send ? s->sk_sndbuf : s->sk_rcvbuf;
		} else {
			struct net *net = bpf_rdonly_cast(s->__sk_common.skc_net.net, bpf_core_type_id_kernel(struct net));
			most = send ? net->ipv4.sysctl_tcp_wmem[2] : net->ipv4.sysctl_tcp_rmem[2];
		}
	}
	return most > 0 ? most : 0;
}

/* Unless the reader set SO_RCVBUF (its bound then), its redirected bytes
 * are bounded by --max-backlog and by the room its netns's tcp_rmem[2] (the
 * most TCP grows its receive buffer to) leaves once the writer's TCP bytes
 * are in: redirected bytes count in the reader's sk_rmem_alloc, and when
 * they and what a throttled writer has on the way by TCP (its send buffer)
 * pass tcp_rmem[2], TCP refuses in-window segments (PROTO_MEM), clamps the
 * window to two segments and the stream crawls on RTOs (docs/BENCHMARKS.md,
 * "Flow control against TCP's receive buffer": 2 MiB + 4 MiB against 6 MiB
 * did, 1.5 + 4 did not; 32 + 4 against 32 did, 16 + 4 did not). The margin,
 * an eighth of the send buffer (cfg.writer_margin), is for the segments'
 * overhead. Where no room is left, nothing unread is allowed: the redirect
 * carries a stream only while its reader keeps up. writer: the peer's TCP
 * sender. Read only once bytes are unread: a reader that keeps up never
 * needs it. */
static __always_inline __u32 peer_limit(void *sk, void *writer)
{
	__u32 limit = cfg.max_backlog;
	int set;
	__u64 rmem_max = buf_most(sk, 0, &set);
	if (set)
		return rmem_max; /* the reader's SO_RCVBUF */
	if (!rmem_max || !cfg.writer_margin)
		return limit;
	__u64 sending = buf_most(writer, 1, &set);
	__u64 taken = sending + sending / cfg.writer_margin;
	__u64 room = rmem_max > taken ? rmem_max - taken : 0;
	return room < limit ? (__u32)room : limit;
}

/* writer: the peer's TCP sender (the sending socket, or the far socket of
 * a join); sent: the end of what it has queued for TCP. */
static __always_inline int check_peer(struct peer_ref *ref, void *writer, __u32 sent)
{
	if (!ref)
		return REDIRECT_NO_PEER;
	if (!ref->sk)
		return REDIRECT_NO_PEER;
	void *peer = ref->sk;
	/* Gone from the sockhash (psock 0), or held by a join too: whatever
	 * its reader, the join reads it. */
	unsigned long psock = sock_psock(peer);
	if (!psock)
		return REDIRECT_NO_PEER;
	if (psock_joined(psock))
		return REDIRECT_JOINED;
	__u32 reads = ref->reads;
	int splicer = reads & STATE_SPLICE;
	int may_splice = reads & STATE_MAY_SPLICE;
	/* Sent back for its peer's small writes: TCP only once nothing
	 * redirected is unread (below), as for a reader that may splice, but
	 * within the bound. */
	int behind_only = may_splice || ((reads & STATE_TCP_READER) && (reads & STATE_SMALL_WRITES));
	if (!splicer) {
		if ((reads & STATE_TCP_READER) && !behind_only)
			return REDIRECT_READER;
		if (!(reads & STATE_READS) && !cfg.trust_readers)
			return REDIRECT_READER;
	}
	if (!splicer && peer_copied_seq(peer) != sent)
		return REDIRECT_TCP_UNREAD;

	/* Redirected bytes are bounded only by tcp_mem, not the receiver's
	 * buffer: without this a slow reader lets a fast writer fill memory.
	 * Over TCP the writer blocks or gets EAGAIN as TCP decides. */
	__u32 unread = peer_unread(ref, psock);
	if (splicer) {
		/* A splice reads the TCP queue alone. With nothing redirected
		 * left unread, TCP is in order and the splice reads it. Else a
		 * TCP send would reach the splice ahead of bytes it cannot
		 * read: keep redirecting behind them (the connection is
		 * caught; the guard resets it), and refuse past the bound. */
		if (!unread)
			return REDIRECT_READER;
		return unread > peer_limit(peer, writer) ? REDIRECT_REFUSE : REDIRECT_OK;
	}
	/* Its reader's program was just learned splicing (presume_splicer), or
	 * it reads by zerocopy receive or peeks in mid-stream: each sees one
	 * queue alone. With redirected bytes queued, a splice would find TCP's
	 * queue empty and be caught, never read a TCP byte ahead of them, and
	 * a peek would never reach a TCP byte behind them: redirect behind
	 * them until they are read, past the bound too (the state lasts until
	 * then), then take TCP. */
	if (behind_only && !unread && (PSOCK_COUNTS || ingress_empty((struct sock *)peer)))
		return REDIRECT_READER; /* shunt's own count is an estimate: the queue says */
	if (unread && !may_splice && unread > peer_limit(peer, writer))
		return REDIRECT_BACKLOG;
	return REDIRECT_OK;
}

/* A send to F, a socket of a kernel join whose other socket B is paired
 * with U (a proxy's two legs, both bypassed): it may go straight to U if
 * nothing this socket sent F is still on its way there. That is: the join
 * has sent out through B all this socket sent (plus what the proxy added, a
 * PROXY header), and U read all B sent by TCP. B sends only what the join
 * took from F, so the first says F's queue and the join hold none of it.
 * Each side counts what took TCP by sequence numbers (from the handshake's)
 * and what went by redirect in bypass's counts (this socket's tx_bytes, less
 * what passed the join by; B's, fixed once joined, in sc->added). Read in
 * that order, each stays true once seen true (this socket's sends wait on
 * its lock, held here; nothing else feeds the join), so both hold together.
 * x86-64 keeps loads in order; the barrier keeps clang from reordering them
 * (an arm64 build would need a fetching atomic instead). Then U's reader and
 * buffer decide as for a direct peer. Sets *far, *far_key and *via where
 * that check ran; else REDIRECT_JOINED: the send takes TCP, through the
 * join. */
static __always_inline int through_join(__u32 sent, __u64 redirected, struct peer_ref *front,
					struct peer_ref **far, struct sock_key **far_key, struct shortcut **via)
{
	__u64 cookie = sock_cookie(front->sk);
	struct shortcut *sc = bpf_map_lookup_elem(&shortcuts, &cookie);
	if (!sc)
		return REDIRECT_JOINED;
	struct peer_ref *back = bpf_map_lookup_elem(&peer_refs, &sc->partner);
	if (!back || !back->sk || sock_cookie(back->sk) != sc->partner_cookie)
		return REDIRECT_JOINED;
	struct peer_ref *u = bpf_map_lookup_elem(&peer_refs, &back->peer);
	if (!u || !u->sk)
		return REDIRECT_JOINED;
	__u32 out = peer_write_seq(back->sk);
	__u32 to_front = (__u32)(redirected - sc->bytes);
	if (out - back->snd_origin - (sent - front->rcv_origin) - to_front != sc->added)
		return REDIRECT_JOINED;
	asm volatile("" ::: "memory");
	int r = check_peer(u, back->sk, out);
	if (r == REDIRECT_JOINED)
		return r;
	*far = u;
	*far_key = &back->peer;
	*via = sc;
	return r;
}

/* Counts a send of a held socket for its cgroup. */
static __always_inline void count_send(struct sock_state *st, __u32 size, int redirected)
{
	struct cgroup_traffic *c = bpf_map_lookup_elem(&cgroup_sends, &st->cgroup_id);
	if (!c)
		return;
	if (redirected) {
		c->redirected_bytes += size;
		c->redirected_sends++;
	} else {
		c->tcp_bytes += size;
		c->tcp_sends++;
	}
}

/* Counted a send: the first past cfg.brief_sends ends the streak of brief
 * connections to its server's port from its client's address (brief_ports). */
static __always_inline void brief_over(struct sock_state *st)
{
	if (!cfg.brief_streak || st->tx_msgs + st->pass_msgs != cfg.brief_sends + 1)
		return;
	struct sock_key *server = st->self.role == ROLE_SERVER ? &st->self : &st->peer;
	struct brief_key k = { .netns = server->netns, .port = server->tuple.server_port };
	__builtin_memcpy(k.client_ip, server->tuple.client_ip, sizeof(k.client_ip));
	struct brief_port *b = bpf_map_lookup_elem(&brief_ports, &k);
	if (b)
		b->streak = 0;
}

/* The send takes TCP. */
static __always_inline int pass(struct sock_state *st, __u32 size)
{
	st->pass_msgs++;
	brief_over(st);
	count_send(st, size, 0);
	return SK_PASS;
}

static __always_inline int fall_back(struct sock_state *st, __u32 size)
{
	if (!(__sync_fetch_and_or(&st->flags, STATE_FALLBACK) & STATE_FALLBACK))
		count(CNT_FALLBACK);
	return pass(st, size);
}

/* The sending socket's state; NULL for sockets shunt does not hold. */
static __always_inline struct sock_state *state_of(struct bpf_sock *sk)
{
	if (!sk)
		return 0;
	return bpf_sk_storage_get(&sock_states, sk, 0, 0);
}

/* Starts the socket's leave no earlier than after delay: a redirect decided
 * before the switch that calls this lands until then. */
static __always_inline void start_leave(struct peer_ref *ref, __u64 delay)
{
	ref->leave_after = bpf_ktime_get_ns() + delay;
	arm(ref, delay);
}

#define TCP_NAGLE_OFF 1
#define TCP_NAGLE_CORK 2

/* The send is one of a stream of small ones that TCP would gather into
 * large segments and its reader would take a segment at a time: Nagle's
 * algorithm is on (or the socket is corked), the send is at most
 * cfg.small_size, the path's segments are large (loopback's 32-64 KiB;
 * over veth's 1,448 bytes TCP gathers little and the redirect wins), and
 * cfg.small_run such sends came within cfg.small_window_ns with no read on
 * this socket between (a request and its answer start the run again).
 * Each redirected send is its own message and wakes its reader: such a
 * stream moved 0.31-0.70x TCP's bytes (docs/BENCHMARKS.md, "Small
 * writes"). Sends on one socket take turns (its lock). */
static __always_inline int small_write_stream(struct sock_state *st, struct tcp_sock *tp, __u32 size)
{
	if (!cfg.small_run)
		return 0;
	__u32 mss = tp->mss_cache;
	__u8 nonagle = BPF_CORE_READ_BITFIELD(tp, nonagle);
	int gathers = (nonagle & TCP_NAGLE_CORK) || !(nonagle & TCP_NAGLE_OFF);
	if (!gathers || mss < cfg.small_mss || size > cfg.small_size) {
		if (st->small_run)
			st->small_run = 0;
		return 0;
	}
	if (!st->small_run) {
		st->small_since = bpf_ktime_get_ns();
		st->small_run = 1;
		return 0;
	}
	if (++st->small_run < cfg.small_run)
		return 0;
	if (bpf_ktime_get_ns() - st->small_since <= cfg.small_window_ns)
		return 1;
	st->small_run = 0; /* a trickle, not a stream: count again */
	return 0;
}

#define MSG_OOB 0x1

/* The send in progress asked for urgent data (MSG_OOB), which only TCP
 * carries: it marks the send's last byte urgent, out of the stream unless
 * the reader set SO_OOBINLINE. Redirected, that byte would arrive in band
 * (a Java program's sendUrgentData heartbeat in the middle of its peer's
 * stream). sk_msg is not told the send's flags: they are read from the
 * system call's registers, found from the task's kernel stack where the
 * reader watch saw them (control.regs_at). Kernel threads send no urgent
 * data; an io_uring send's flags are not in the registers (not seen). */
static __always_inline int urgent_send(struct control_word *ctl)
{
	__u32 at = ctl->regs_at;
	if (!at)
		return 0;
	struct task_struct *task = bpf_get_current_task_btf();
	if (!task->mm)
		return 0;
	void *regs = task->stack + at;
	unsigned long nr, flags;
	if (cfg.probe_reads) {
		nr = BPF_CORE_READ((struct pt_regs *)regs, orig_ax);
		if (nr == cfg.sendmsg_nr)
			flags = BPF_CORE_READ((struct pt_regs *)regs, dx);
		else if (nr == cfg.sendto_nr || nr == cfg.sendmmsg_nr)
			flags = BPF_CORE_READ((struct pt_regs *)regs, r10);
		else
			return 0;
		return flags & MSG_OOB;
	}
	struct pt_regs *r = bpf_rdonly_cast(regs, bpf_core_type_id_kernel(struct pt_regs));
	nr = r->orig_ax;
	if (nr == cfg.sendmsg_nr)
		flags = r->dx;
	else if (nr == cfg.sendto_nr || nr == cfg.sendmmsg_nr)
		flags = r->r10;
	else
		return 0;
	return flags & MSG_OOB;
}

/* ref's reader needs what only TCP gives (urgent data, a receive option a
 * psock ignores): its connection goes back to TCP, counted once under
 * counter. Redirects decided before the mark may still land: the leave
 * waits for them, the settle, unless it sees none can (nothing_landing)
 * when it first looks, after look_ns. */
static __always_inline void leave_for_tcp_at(struct peer_ref *ref, __u32 counter, __u64 look_ns)
{
	if (__sync_fetch_and_or(&ref->reads, STATE_TCP_READER) & STATE_TCP_READER)
		return;
	count(counter);
	ref->leave_after = bpf_ktime_get_ns() + cfg.settle_ns;
	arm(ref, look_ns);
}

static __always_inline void leave_for_tcp(struct peer_ref *ref, __u32 counter)
{
	leave_for_tcp_at(ref, counter, cfg.settle_ns);
}

/* A reader behind its writer has TCP bytes queued and, mostly, no
 * redirected ones: nothing can be landing, and its leave goes at the first
 * look. At the writer's pace a settle's wait took 125-250 MB more through
 * the sockhash. */
#define BEHIND_LOOK_NS (1000ULL * 1000)

/* A send takes TCP because its peer's reader is behind: it has not read
 * every byte TCP carried (a stream whose first bytes came before its first
 * read), or the redirected ones are past the bound. A reader slower than
 * its writer never catches up, and every send of the pair then runs the
 * sockhash's send and receive paths on top of TCP's: 0.62-0.75x plain TCP
 * for a reader of 4 KiB a wake-up (docs/BENCHMARKS.md). Past
 * cfg.behind_bytes in a row the connection goes back to TCP for good.
 * Only once the run is longer than all the direction ever redirected: a
 * reader that took more by redirect kept up before, and its throttles (flow
 * control) end when it catches up, however late; sending those back cost
 * bulk streams 10-40%. A download's reader that caught up for a few sends
 * at its start has not. And only once the socket made cfg.behind_sends:
 * a fast reader on its writer's CPU can trail a stream's first 32 MiB
 * (sent back in 4-5 of 6 one-second runs of 256 KiB writes, none after
 * 4096 sends). */
static __always_inline void reader_behind(struct sock_state *st, struct peer_ref *ref, __u32 size)
{
	if (!cfg.behind_bytes || !ref)
		return;
	__u32 run = st->behind_run + size;
	st->behind_run = run < st->behind_run ? ~0U : run;
	if (st->behind_run >= cfg.behind_bytes && st->behind_run > st->tx_bytes &&
	    st->tx_msgs + st->pass_msgs >= cfg.behind_sends)
		leave_for_tcp_at(ref, CNT_BEHIND_READER, BEHIND_LOOK_NS);
}

SEC("sk_msg")
int shunt_sk_msg(struct sk_msg_md *msg)
{
	struct bpf_sock *sk = msg->sk;
	struct sock_state *st = state_of(sk);
	if (!st || !sk)
		return SK_PASS;
	__u32 size = msg->size;
	if (st->flags & STATE_FALLBACK)
		return pass(st, size);

	__u32 zero = 0;
	struct control_word *ctl = bpf_map_lookup_elem(&control, &zero);
	if (!ctl || ctl->draining)
		return fall_back(st, size);

	struct tcp_sock *tp = bpf_skc_to_tcp_sock(sk);
	if (!tp)
		return fall_back(st, size);
	unsigned long own = sock_psock(tp);
	if (own && psock_joined(own))
		return pass(st, size);

	/* The peer's entry: published by sockops, gone when it left. */
	struct sock_key *to = &st->peer;
	struct peer_ref *ref = bpf_map_lookup_elem(&peer_refs, to);
	struct shortcut *via = 0;
	int check = check_peer(ref, tp, tp->write_seq);
	if (check == REDIRECT_JOINED && ref) {
		struct peer_ref *far = 0;
		check = through_join(tp->write_seq, st->tx_bytes, ref, &far, &to, &via);
		if (far)
			ref = far;
	}
	switch (check) {
	case REDIRECT_OK:
		break;
	case REDIRECT_TCP_UNREAD:
		if (!via)
			reader_behind(st, ref, size);
		return pass(st, size);
	case REDIRECT_REFUSE:
		count(CNT_REFUSED_SENDS);
		return SK_DROP; /* sendmsg fails with EACCES */
	case REDIRECT_BACKLOG:
		if (!(st->flags & STATE_THROTTLED) &&
		    !(__sync_fetch_and_or(&st->flags, STATE_THROTTLED) & STATE_THROTTLED))
			count(CNT_THROTTLED);
		/* These bytes queue behind redirected ones; the read that
		 * drains those returns short (tcp_bpf_recvmsg reads the psock
		 * alone while it holds any), and a reader that takes a short
		 * read for all there is waits for an edge these raised long
		 * before: the stall watch looks at such reads (hidden_bytes). */
		if (ref && !(ref->reads & STATE_TCP_BEHIND))
			__sync_fetch_and_or(&ref->reads, STATE_TCP_BEHIND);
		if (!via)
			reader_behind(st, ref, size);
		/* fall through */
	default:
		return pass(st, size);
	}

	/* Flagged, not sent back here: its reader must be known first. Once
	 * its sends take TCP, FIONREAD leaves their bytes out while the socket
	 * is held (6.18), and a reader told 0 for them is woken only by a leave
	 * that noted it. Its next read notes it and starts the leave
	 * (leave_small_writes); check_peer then keeps these sends behind the
	 * redirected bytes still unread. */
	if (!via && ref && small_write_stream(st, tp, size) && !(ref->reads & STATE_SMALL_WRITES))
		__sync_fetch_and_or(&ref->reads, STATE_SMALL_WRITES);
	if (urgent_send(ctl)) {
		/* Through a join the urgent byte takes the join, behind
		 * what it holds; the far peer stays as it is. */
		if (!via && ref)
			leave_for_tcp(ref, CNT_URGENT);
		return pass(st, size);
	}
	/* A missing peer (closed a moment ago) leaves the send on the TCP
	 * path, where a closed peer answers as TCP would. */
	if (bpf_msg_redirect_hash(msg, &sock_hash, to, BPF_F_INGRESS) != SK_PASS)
		return pass(st, size);
	if (st->flags & STATE_THROTTLED)
		__sync_fetch_and_and(&st->flags, ~STATE_THROTTLED);
	st->behind_run = 0;
	if (!PSOCK_COUNTS && ref) /* REDIRECT_OK: ref is set */
		__sync_fetch_and_add(&ref->redirected_in, size);
	if (via) {
		__sync_fetch_and_add(&via->bytes, size);
		__sync_fetch_and_add(&via->sends, 1);
	}
	st->tx_bytes += size;
	st->tx_msgs++;
	brief_over(st);
	count_send(st, size, 1);
	return SK_PASS;
}
