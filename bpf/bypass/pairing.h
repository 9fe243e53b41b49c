// SPDX-License-Identifier: GPL-2.0
/* Pairing: sockops registers each handshake, finds a connection's two sockets
 * on this host (whatever NAT rewrote), inserts them into the sockhash and
 * publishes each to its peer (peer_refs); what keeps a connection on TCP from
 * its start (zerocopy, an upper layer, transmit timestamps, receive options).
 *
 * Part of bypass.c, which includes the parts in order: each uses what the
 * ones before it define. */

/* What reader_ports holds for the port (pid 0) or that client process's
 * connections to it, if its readers needed TCP within cfg.reader_port_ttl_s
 * (a client process's for cfg.reader_client_streak connections in a row),
 * else NULL. */
static __always_inline struct reader_port_seen *kept_port(__u64 netns, __u16 port, __u32 pid)
{
	if (!cfg.reader_port_ttl_s)
		return 0;
	struct reader_port k = { .netns = netns, .port = port, .pid = pid };
	struct reader_port_seen *s = bpf_map_lookup_elem(&reader_ports, &k);
	if (!s || bpf_ktime_get_ns() - s->seen_ns > (__u64)cfg.reader_port_ttl_s * 1000000000ULL)
		return 0;
	if (pid && s->streak < cfg.reader_client_streak)
		return 0;
	return s;
}

/* Whether a connection request (t, as the server sees it) is left
 * unpaired: the port's connections from its client address were brief
 * lately (brief_ports), and this is not the one in cfg.brief_sample paired
 * to look. */
static __always_inline int brief_port(__u64 netns, struct tuple *t)
{
	if (!cfg.brief_streak)
		return 0;
	struct brief_key k = { .netns = netns, .port = t->server_port };
	__builtin_memcpy(k.client_ip, t->client_ip, sizeof(k.client_ip));
	struct brief_port *b = bpf_map_lookup_elem(&brief_ports, &k);
	if (!b || b->streak < cfg.brief_streak ||
	    bpf_ktime_get_ns() - b->seen_ns > (__u64)cfg.reader_port_ttl_s * 1000000000ULL)
		return 0;
	if (__sync_fetch_and_add(&b->arrivals, 1) % cfg.brief_sample == cfg.brief_sample - 1)
		return 0;
	__sync_fetch_and_add(&b->kept, 1);
	return 1;
}

/* A server's paired socket closed: one that sent at most cfg.brief_sends
 * times lengthens its port's streak. (A send past that from either end
 * ended the streak already: brief_over.) */
static __always_inline void brief_close(struct sock_state *st)
{
	if (!cfg.brief_streak || st->self.role != ROLE_SERVER || st->tx_msgs + st->pass_msgs > cfg.brief_sends)
		return;
	struct brief_key k = { .netns = st->self.netns, .port = st->self.tuple.server_port };
	__builtin_memcpy(k.client_ip, st->self.tuple.client_ip, sizeof(k.client_ip));
	__u64 now = bpf_ktime_get_ns();
	struct brief_port *b = bpf_map_lookup_elem(&brief_ports, &k);
	if (b) {
		if (now - b->seen_ns > (__u64)cfg.reader_port_ttl_s * 1000000000ULL)
			b->streak = 0;
		b->streak++;
		b->seen_ns = now;
		return;
	}
	struct brief_port fresh = { .seen_ns = now, .streak = 1 };
	bpf_map_update_elem(&brief_ports, &k, &fresh, BPF_NOEXIST);
}

/* The handshake's two initial sequence numbers, from the request socket
 * behind a TIMEOUT_INIT (which the sockops context does not expose): both
 * are chosen before the callback runs, and the SYN-ACK carries them. */
static __always_inline int request_isns(struct bpf_sock_ops *skops, struct isn_pair *k)
{
	struct tcp_request_sock *req = 0;
	if (cfg.probe_reads) {
		/* The context is the kernel's struct bpf_sock_ops_kern. */
		if (bpf_probe_read_kernel(&req, sizeof(req), (void *)skops + bpf_core_field_offset(struct bpf_sock_ops_kern, sk)) || !req)
			return -1;
		k->client_isn = BPF_CORE_READ(req, rcv_isn);
		k->server_isn = BPF_CORE_READ(req, snt_isn);
		return 0;
	}
	struct bpf_sock_ops_kern *kctx = bpf_cast_to_kern_ctx(skops);
	if (!kctx->sk)
		return -1;
	req = bpf_rdonly_cast(kctx->sk, bpf_core_type_id_kernel(struct tcp_request_sock));
	k->client_isn = req->rcv_isn;
	k->server_isn = req->snt_isn;
	return 0;
}

/* Server side, a connection request (its request socket, TIMEOUT_INIT):
 * register the handshake by its sequence numbers, with the tuple the server
 * sees. A client whose tuple differs (translated) finds it by the same
 * numbers in the SYN-ACK it receives. Unregistered, the connection is never
 * paired: its client finds nothing to claim and both ends stay plain TCP. */
static __always_inline void register_request(struct bpf_sock_ops *skops)
{
	struct isn_pending fresh = {};
	if (tuple_from_skops(skops, &fresh.server, 0))
		return;
	if (bpf_map_lookup_elem(&excluded_ports, &fresh.server.server_port)) {
		count(CNT_EXCLUDED);
		return;
	}
	__u64 netns = bpf_get_netns_cookie(skops);
	struct reader_port_seen *kept = kept_port(netns, fresh.server.server_port, 0);
	if (kept) {
		__sync_fetch_and_add(&kept->kept, 1);
		count(CNT_READER_PORT);
		return;
	}
	if (brief_port(netns, &fresh.server)) {
		count(CNT_BRIEF_PORT);
		return;
	}
	struct isn_pair k;
	if (request_isns(skops, &k))
		return;
	fresh.p.server_netns = netns;
	fresh.p.state = PENDING_REGISTERED;
	if (bpf_map_update_elem(&isn_handshakes, &k, &fresh, BPF_NOEXIST) == 0) {
		count(CNT_REGISTERED);
		return;
	}
	struct isn_pending *x = bpf_map_lookup_elem(&isn_handshakes, &k);
	if (!x) {
		count(CNT_REGISTRY_FULL);
		return;
	}
	if (x->p.server_netns == netns)
		return; /* this request, registered again */
	/* Two servers hold the same pair of sequence numbers: whichever
	 * client holds them, neither is paired. */
	__sync_fetch_and_or(&x->p.state, PENDING_AMBIGUOUS);
	count(CNT_AMBIGUOUS);
}

#define E2BIG 7

static __always_inline struct sock_state *new_state(struct bpf_sock *sk, struct sock_key *self,
						     struct sock_key *peer)
{
	struct sock_state *st = bpf_sk_storage_get(&sock_states, sk, 0, BPF_SK_STORAGE_GET_F_CREATE);
	if (!st)
		return 0;
	st->self = *self;
	st->peer = *peer;
	st->created_ns = bpf_ktime_get_ns();
	st->tx_bytes = 0;
	st->tx_msgs = 0;
	st->pass_msgs = 0;
	st->flags = 0;
	st->claim_nonce = 0;
	st->small_run = 0;
	st->cgroup_id = 0;
	struct tcp_sock *tp = bpf_skc_to_tcp_sock(sk);
	if (tp) {
		st->cgroup_id = BPF_CORE_READ((struct sock *)tp, sk_cgrp_data.cgroup, kn, id);
		struct cgroup_traffic zero = {};
		if (!bpf_map_lookup_elem(&cgroup_sends, &st->cgroup_id) &&
		    bpf_map_update_elem(&cgroup_sends, &st->cgroup_id, &zero, BPF_NOEXIST) == -E2BIG)
			count(CNT_CGROUPS_FULL);
	}
	return st;
}

static int leave_timer_cb(void *map, __u32 *slot, struct leave_timer *t);

/* A timer slot for the socket self (its number plus one; 0: none left). A
 * slot given back comes first, else the next never taken. */
static __always_inline __u32 take_timer(struct sock_key *self)
{
	__u32 slot;
	if (bpf_map_pop_elem(&free_timers, &slot)) {
		__u32 zero = 0;
		struct timer_pool *pool = bpf_map_lookup_elem(&timer_pool, &zero);
		if (!pool || pool->taken >= MAX_SOCKETS)
			return 0;
		slot = __sync_fetch_and_add(&pool->taken, 1);
		if (slot >= MAX_SOCKETS)
			return 0;
	}
	struct leave_timer *t = bpf_map_lookup_elem(&leave_timers, &slot);
	if (!t)
		return 0;
	t->owner = *self;
	/* Made once per slot (-EBUSY after). The callback must belong to a
	 * sockops program: only those (and iterators) may delete from a
	 * sockhash. Set at each take: it is the slot's only way back. */
	bpf_timer_init(&t->timer, &leave_timers, CLOCK_MONOTONIC);
	bpf_timer_set_callback(&t->timer, leave_timer_cb);
	return slot + 1;
}

/* Takes key's entry out of peer_refs and gives its timer slot back; only the
 * one whose delete succeeds gives it, so a slot is never given twice.
 * Whether this call took it out. */
static __always_inline int unpublish(struct sock_key *key)
{
	struct peer_ref *ref = bpf_map_lookup_elem(&peer_refs, key);
	__u32 slot = ref ? ref->timer : 0;
	if (bpf_map_delete_elem(&peer_refs, key))
		return 0;
	if (slot) {
		slot--;
		bpf_map_push_elem(&free_timers, &slot, 0);
	}
	return 1;
}

/* Runs the socket's timer after ns (or now). */
static __always_inline void arm(struct peer_ref *ref, __u64 ns)
{
	__u32 slot = ref->timer - 1;
	struct leave_timer *t = bpf_map_lookup_elem(&leave_timers, &slot);
	if (t)
		bpf_timer_start(&t->timer, ns, 0);
}

/* Make this socket visible to its peer's flow control, and ask for the
 * state change that will withdraw it when the socket closes. rcv_isn and
 * snd_isn: the handshake's initial sequence numbers each way. */
static __always_inline void publish(struct bpf_sock_ops *skops, struct bpf_sock *sk, struct sock_key *self,
				    struct sock_key *peer, __u32 rcv_isn, __u32 snd_isn)
{
	struct tcp_sock *tp = bpf_skc_to_tcp_sock(sk);
	if (!tp)
		return;
	/* An entry of an earlier socket with this key (closed unseen, after
	 * its cgroup was detached) goes first, its slot given back: its timer
	 * may still run and give it back itself. */
	unpublish(self);
	__u32 slot = take_timer(self);
	if (!slot)
		return;
	struct peer_ref empty = { .timer = slot };
	if (bpf_map_update_elem(&peer_refs, self, &empty, BPF_NOEXIST)) {
		slot--;
		bpf_map_push_elem(&free_timers, &slot, 0);
		return;
	}
	struct peer_ref *ref = bpf_map_lookup_elem(&peer_refs, self);
	if (!ref)
		return;
	ref->peer = *peer;
	ref->tcp_copied = tp->copied_seq;
	ref->rcv_origin = rcv_isn + 1;
	ref->snd_origin = snd_isn + 1;
	ref->sk = tp;
	/* Its cookie exists from now on: the stall scan reads it from the
	 * socket (iter.h), as it cannot ask for one. */
	bpf_get_socket_cookie(skops);
	bpf_sock_ops_cb_flags_set(skops, skops->bpf_sock_ops_cb_flags | BPF_SOCK_OPS_STATE_CB_FLAG);
}

/* The program a socket's reader runs, as admit_reader (reads.h) keyed it. */
static __always_inline struct recv_program *reader_program(struct sock_state *st, struct peer_ref *ref)
{
	struct recv_key k = { .role = st->self.role };
	__builtin_memcpy(k.comm, ref->reader_comm, sizeof(k.comm));
	return bpf_map_lookup_elem(&recv_programs, &k);
}

/* A probe that closes, splices or leaves for TCP before it proved its
 * program lets the program's next reader be the probe. */
static __always_inline void end_probe(struct sock_state *st, __u64 cookie)
{
	if (!(st->flags & STATE_PROBE))
		return;
	struct peer_ref *ref = bpf_map_lookup_elem(&peer_refs, &st->self);
	struct recv_program *rp = ref ? reader_program(st, ref) : 0;
	if (rp)
		__sync_val_compare_and_swap(&rp->probe, cookie, 0);
}

static __always_inline void withdraw(struct bpf_sock_ops *skops)
{
	struct bpf_sock *sk = skops->sk;
	if (!sk)
		return;
	struct sock_state *st = bpf_sk_storage_get(&sock_states, sk, 0, 0);
	if (!st)
		return;
	end_probe(st, bpf_get_socket_cookie(skops));
	/* Still published: it never left for TCP, where its sends go uncounted. */
	if (unpublish(&st->self))
		brief_close(st);
}

/* MSG_ZEROCOPY completions are never queued for a socket whose sends go
 * through sk_msg, so a socket that may send that way (SO_ZEROCOPY, set before
 * connect or on the listener) keeps its connection on TCP. */
static __always_inline int uses_zerocopy(struct bpf_sock *sk)
{
	struct tcp_sock *tp = bpf_skc_to_tcp_sock(sk);
	if (!tp)
		return 0;
	unsigned long flags = BPF_CORE_READ((struct sock *)tp, __sk_common.skc_flags);
	return (flags >> bpf_core_enum_value(enum sock_flags, SOCK_ZEROCOPY)) & 1;
}

/* The socket has a TCP upper layer protocol: an MPTCP subflow (both ends
 * MPTCP) has one from its first moment. The kernel gives no psock to such a
 * socket, so the sockhash would refuse it: leave the connection alone. */
static __always_inline int has_upper_layer(struct bpf_sock *sk)
{
	struct tcp_sock *tp = bpf_skc_to_tcp_sock(sk);
	if (!tp)
		return 0;
	return BPF_CORE_READ((struct inet_connection_sock *)tp, icsk_ulp_ops) != 0;
}

/* SO_TIMESTAMPING's flags (include/uapi/linux/net_tstamp.h). */
#define SOF_TIMESTAMPING_TX_HARDWARE (1 << 0)
#define SOF_TIMESTAMPING_TX_SOFTWARE (1 << 1)
#define SOF_TIMESTAMPING_RX_HARDWARE (1 << 2)
#define SOF_TIMESTAMPING_RX_SOFTWARE (1 << 3)
#define SOF_TIMESTAMPING_TX_SCHED (1 << 8)
#define SOF_TIMESTAMPING_TX_ACK (1 << 9)
#define SOF_TIMESTAMPING_RX (SOF_TIMESTAMPING_RX_HARDWARE | SOF_TIMESTAMPING_RX_SOFTWARE)
#define SOF_TIMESTAMPING_TX (SOF_TIMESTAMPING_TX_HARDWARE | SOF_TIMESTAMPING_TX_SOFTWARE | \
			     SOF_TIMESTAMPING_TX_SCHED | SOF_TIMESTAMPING_TX_ACK)

/* The socket asked for transmit timestamps (SO_TIMESTAMPING with a TX
 * flag): TCP's transmit path queues them on its error queue as it sends, a
 * redirected send never passes there, and a program that polls for them
 * (POLLERR) would wait for ever. Set on a listener, an accepted socket has
 * it from its first moment. */
static __always_inline int tx_timestamps(struct bpf_sock *sk)
{
	struct tcp_sock *tp = bpf_skc_to_tcp_sock(sk);
	if (!tp)
		return 0;
	return (BPF_CORE_READ((struct sock *)tp, sk_tsflags) & SOF_TIMESTAMPING_TX) != 0;
}

/* The socket's reader set a receive option only TCP's own receive path
 * honours: SO_RCVLOWAT above 1 (a psock makes its socket readable for any
 * byte queued), TCP_INQ (a psock's data comes without the bytes-left
 * message; gRPC's core reads by it), SO_PEEK_OFF (a psock peeks from the
 * start each time), receive timestamps (SO_TIMESTAMP, SO_TIMESTAMPNS: a
 * psock's data comes without them). Set on a listener, an accepted socket
 * has it from its first moment. */
static __always_inline int receive_options(struct bpf_sock *sk)
{
	struct tcp_sock *tp = bpf_skc_to_tcp_sock(sk);
	if (!tp)
		return 0;
	struct sock *s = (struct sock *)tp;
	if (BPF_CORE_READ(s, sk_rcvlowat) > 1 || BPF_CORE_READ(s, sk_peek_off) >= 0)
		return 1;
	unsigned long flags = BPF_CORE_READ(s, __sk_common.skc_flags);
	if ((flags >> bpf_core_enum_value(enum sock_flags, SOCK_RCVTSTAMP)) & 1)
		return 1;
	if (BPF_CORE_READ(s, sk_tsflags) & SOF_TIMESTAMPING_RX)
		return 1;
	return BPF_CORE_READ_BITFIELD_PROBED(tp, recvmsg_inq);
}

/* Why an end of a new connection keeps it on TCP: the counter that says so,
 * or CNT_MAX if nothing does. */
static __always_inline __u32 keeps_tcp(struct bpf_sock *sk)
{
	if (uses_zerocopy(sk))
		return CNT_ZEROCOPY;
	if (has_upper_layer(sk))
		return CNT_UPPER_LAYER;
	if (tx_timestamps(sk))
		return CNT_TX_TIMESTAMPS;
	if (receive_options(sk))
		return CNT_RECEIVE_OPTION;
	return CNT_MAX;
}

/* seq and ack_seq of the TCP segment in skops' skb (a SYN-ACK being sent or
 * received). -1 when the context has none. */
static __always_inline int skb_seqs(struct bpf_sock_ops *skops, __u32 *seq, __u32 *ack)
{
	void *data = (void *)(long)skops->skb_data;
	void *end = (void *)(long)skops->skb_data_end;
	__u32 *w = data;
	if (data + 12 > end)
		return -1;
	*seq = bpf_ntohl(w[1]);
	*ack = bpf_ntohl(w[2]);
	return 0;
}

/* The claim's header option (RFC 6994's experimental kind, shunt's ExID),
 * carrying the claimant's nonce in its handshake ACK. */
#define CLAIM_OPT_KIND 254
#define CLAIM_OPT_LEN 8
#define CLAIM_OPT_EXID 0x5348 /* "SH" */

struct claim_opt {
	__u8 kind;
	__u8 len;
	__be16 exid;
	__u32 nonce;
};

/* Client side, once claimed: bind the claim to our handshake ACK, which is
 * sent after this callback returns (write_claim). The nonce goes in the
 * registration, for the server, and in our state, for the header
 * callbacks: no map update of its own. */
static __always_inline void bind_claim(struct bpf_sock_ops *skops, struct isn_pending *x, struct isn_pair *k,
				       struct sock_state *st)
{
	__u32 nonce = bpf_get_prandom_u32() | 1;
	x->p.nonce = nonce;
	st->claim = *k;
	st->claim_nonce = nonce;
	bpf_sock_ops_cb_flags_set(skops, skops->bpf_sock_ops_cb_flags | BPF_SOCK_OPS_WRITE_HDR_OPT_CB_FLAG);
}

/* Client side, our claim's nonce while the server has not taken it (its
 * registration is still there): each segment after the claim carries it,
 * usually the handshake ACK only (the server takes it as that ACK
 * establishes it); where the server dropped that ACK (a full accept queue)
 * and sent its SYN-ACK again, the ACK that answers it carries the nonce
 * too. Once it is taken the header callbacks are switched off. */
static __always_inline struct sock_state *claim_pending(struct bpf_sock_ops *skops)
{
	struct bpf_sock *sk = skops->sk;
	struct sock_state *st = sk ? bpf_sk_storage_get(&sock_states, sk, 0, 0) : 0;
	if (st && st->claim_nonce) {
		if (bpf_map_lookup_elem(&isn_handshakes, &st->claim))
			return st;
		st->claim_nonce = 0;
	}
	bpf_sock_ops_cb_flags_set(skops, skops->bpf_sock_ops_cb_flags & ~BPF_SOCK_OPS_WRITE_HDR_OPT_CB_FLAG);
	return 0;
}

/* Room for the nonce, where there is one to write: without room reserved
 * the write callback does not run. */
static __always_inline void reserve_claim(struct bpf_sock_ops *skops)
{
	if (claim_pending(skops))
		bpf_reserve_hdr_opt(skops, CLAIM_OPT_LEN, 0);
}

static __always_inline void write_claim(struct bpf_sock_ops *skops)
{
	struct sock_state *st = claim_pending(skops);
	if (!st)
		return;
	struct claim_opt opt = { .kind = CLAIM_OPT_KIND, .len = CLAIM_OPT_LEN, .exid = bpf_htons(CLAIM_OPT_EXID), .nonce = st->claim_nonce };
	bpf_store_hdr_opt(skops, &opt, sizeof(opt), 0);
}

/* Server side, PASSIVE_ESTABLISHED: did the ACK that established us come
 * from the claimant, whose nonce is want? Only its handshake ACK carries
 * it. A socket that claimed a handshake it holds the numbers of but is not
 * the end of (a forger that saw the server's SYN-ACK to a client elsewhere)
 * sends its ACK anywhere but here, short of spoofing the client's packets,
 * which would take over a plain TCP connection too. */
static __always_inline int claim_bound(struct bpf_sock_ops *skops, __u32 want)
{
	if (!want)
		return 0;
	/* Search by kind and 16-bit ExID (len 4); the option found is
	 * copied over the search key. */
	struct claim_opt opt = { .kind = CLAIM_OPT_KIND, .len = 4, .exid = bpf_htons(CLAIM_OPT_EXID) };
	if (bpf_load_hdr_opt(skops, &opt, sizeof(opt), 0) != sizeof(opt))
		return 0;
	return opt.len == CLAIM_OPT_LEN && opt.nonce == want;
}

/* A second claim of one registration: two sockets hold what the pairing
 * keys on, and at most one is the server's client (the other forged the
 * handshake's numbers, or shares the tuple). Neither is paired: the server
 * finds the registration ambiguous and releases the first claimant. Its
 * true client claims before it sends the ACK that establishes the server,
 * so a forger that claimed first is always found out; one that claims
 * second finds it claimed and poisons it the same. */
static __always_inline void poison_claimed(__u32 *state)
{
	if (*state & PENDING_CLAIMED)
		__sync_fetch_and_or(state, PENDING_AMBIGUOUS);
}

/* Client side: claim the registration x (key k) and insert ourselves. The
 * server pairs only after our handshake ACK, which is sent after this
 * callback returns: poisoning the state cannot race with it. */
static __always_inline void join_as_client(struct bpf_sock_ops *skops, struct bpf_sock *sk, struct isn_pending *x,
					   struct isn_pair *k, struct sock_key *self, struct sock_key *peer)
{
	if (__sync_val_compare_and_swap(&x->p.state, PENDING_REGISTERED, PENDING_CLAIMED) != PENDING_REGISTERED) {
		count(CNT_UNPAIRED);
		return;
	}
	struct sock_state *st = new_state(sk, self, peer);
	if (!st) {
		__sync_fetch_and_or(&x->p.state, PENDING_AMBIGUOUS);
		count(CNT_INSERT_FAILED);
		return;
	}
	if (bpf_sock_hash_update(skops, &sock_hash, self, BPF_NOEXIST)) {
		bpf_sk_storage_delete(&sock_states, sk);
		__sync_fetch_and_or(&x->p.state, PENDING_AMBIGUOUS);
		count(CNT_INSERT_FAILED);
		return;
	}
	publish(skops, sk, self, peer, k->server_isn, k->client_isn);
	bind_claim(skops, x, k, st);
}

/* Client side, in connect(2): the one moment sockops runs in the
 * connecting process. If that process's readers needed TCP for its last
 * connections to this port (a proxy that reads its upstreams with blocking
 * calls), the socket is marked to stay unpaired. One such connection is no
 * habit: redis-benchmark asks for the server's configuration on a blocking
 * connection, then runs its load on event-loop ones. */
static __always_inline void client_connects(struct bpf_sock_ops *skops)
{
	struct tuple t = {};
	if (!cfg.reader_port_ttl_s || tuple_from_skops(skops, &t, 1))
		return;
	struct bpf_sock *sk = skops->sk;
	if (!sk)
		return;
	/* Not bpf_get_current_pid_tgid: sockops lacks it on 6.1. */
	struct task_struct *task = bpf_get_current_task_btf();
	__u32 pid = task->tgid;
	if (!kept_port(bpf_get_netns_cookie(skops), t.server_port, pid))
		return;
	__u32 *mark = bpf_sk_storage_get(&kept_clients, sk, 0, BPF_SK_STORAGE_GET_F_CREATE);
	if (mark)
		*mark = pid;
}

static __always_inline void client_established(struct bpf_sock_ops *skops)
{
	struct tuple t = {};
	if (tuple_from_skops(skops, &t, 1))
		return;
	struct bpf_sock *sk = skops->sk;
	if (!sk)
		return;
	__u64 netns = bpf_get_netns_cookie(skops);
	struct sock_key self = { .netns = netns, .tuple = t, .role = ROLE_CLIENT };
	struct sock_key peer = { .role = ROLE_SERVER };

	/* The sequence numbers name this very connection whatever translated
	 * its addresses, and only this client holds the server's. */
	__u32 seq, ack;
	if (skb_seqs(skops, &seq, &ack))
		return;
	struct isn_pair k = { .client_isn = ack - 1, .server_isn = seq };
	struct isn_pending *x = bpf_map_lookup_elem(&isn_handshakes, &k);
	if (!x)
		return; /* peer elsewhere or not enabled: stay out of the way */
	if (x->p.state != PENDING_REGISTERED) {
		poison_claimed(&x->p.state);
		count(CNT_UNPAIRED);
		return;
	}
	__u32 *kept_by = bpf_sk_storage_get(&kept_clients, sk, 0, 0);
	if (kept_by) {
		/* Withdrawn: the server finds nothing and stays on TCP too. */
		bpf_map_delete_elem(&isn_handshakes, &k);
		struct reader_port_seen *kept = kept_port(netns, t.server_port, *kept_by);
		if (kept)
			__sync_fetch_and_add(&kept->kept, 1);
		count(CNT_READER_CLIENT);
		return;
	}
	__u32 why = keeps_tcp(sk);
	if (why != CNT_MAX) {
		/* Unclaimed, the registration pairs nobody. */
		count(why);
		return;
	}
	peer.netns = x->p.server_netns;
	peer.tuple = x->server;
	x->client = t;
	x->p.client_netns = netns;
	x->p.translated = !same_tuple(&t, &peer.tuple);
	join_as_client(skops, sk, x, &k, &self, &peer);
}

/* The server declines a connection its client already joined: take the
 * client out of the sockhash again, so it runs as plain TCP. Safe: only this
 * server could have redirected bytes to it, and it never did. */
static __always_inline void release_client(struct sock_key *client)
{
	bpf_map_delete_elem(&sock_hash, client);
	unpublish(client);
}

static __always_inline void server_established(struct bpf_sock_ops *skops)
{
	/* A child inherits its listener's flags (an install before this one
	 * asked for the listener's header callbacks); its own segments need
	 * none. */
	if (skops->bpf_sock_ops_cb_flags & BPF_SOCK_OPS_WRITE_HDR_OPT_CB_FLAG)
		bpf_sock_ops_cb_flags_set(skops, skops->bpf_sock_ops_cb_flags & ~BPF_SOCK_OPS_WRITE_HDR_OPT_CB_FLAG);
	struct tuple t = {};
	if (tuple_from_skops(skops, &t, 0))
		return;
	struct bpf_sock *sk = skops->sk;
	if (!sk)
		return;
	__u64 netns = bpf_get_netns_cookie(skops);
	struct sock_key self = { .netns = netns, .tuple = t, .role = ROLE_SERVER };
	struct sock_key peer = { .role = ROLE_CLIENT };

	/* Nothing but the SYN-ACK sent yet, and the ACK's own data not queued
	 * yet: snd_una - 1 and rcv_nxt - 1 are the handshake's initial
	 * sequence numbers (a TFO child, made at the SYN, counts the SYN's
	 * data in rcv_nxt: it finds no registration and stays on TCP). */
	struct isn_pair k = { .client_isn = skops->rcv_nxt - 1, .server_isn = skops->snd_una - 1 };
	struct isn_pending *x = bpf_map_lookup_elem(&isn_handshakes, &k);
	if (!x || x->p.server_netns != netns)
		return;
	__u32 state = x->p.state;
	peer.netns = x->p.client_netns;
	peer.tuple = x->client;
	int translated = x->p.translated;
	__u32 nonce = x->p.nonce;
	bpf_map_delete_elem(&isn_handshakes, &k);
	if (state != PENDING_CLAIMED) {
		if (state & PENDING_CLAIMED) {
			/* Claimed twice (poison_claimed): the first
			 * claimant joined; take it out again. */
			release_client(&peer);
		}
		count(CNT_UNPAIRED);
		return;
	}
	if (!claim_bound(skops, nonce)) {
		release_client(&peer);
		count(CNT_CLAIM_UNBOUND);
		return;
	}
	__u32 why = keeps_tcp(sk);
	if (why != CNT_MAX) {
		release_client(&peer);
		count(why);
		return;
	}
	if (!new_state(sk, &self, &peer)) {
		release_client(&peer);
		count(CNT_INSERT_FAILED);
		return;
	}
	if (bpf_sock_hash_update(skops, &sock_hash, &self, BPF_NOEXIST)) {
		bpf_sk_storage_delete(&sock_states, sk);
		release_client(&peer);
		count(CNT_INSERT_FAILED);
		return;
	}
	publish(skops, sk, &self, &peer, k.client_isn, k.server_isn);
	count(CNT_PAIRED);
	if (translated)
		count(CNT_PAIRED_TRANSLATED);
}

/* A caught splice reader's connection is cut short, not reset, if the
 * peer's end of stream (FIN, which comes by TCP) comes before the guard's
 * reset: the splice returns it at once, before the redirected bytes it
 * cannot read, whether it had come at the catch (report_caught) or comes
 * after it while the splice waits (here, at CLOSE_WAIT). Counted once. */
static __always_inline void count_cut_short(struct peer_ref *ref)
{
	if (!(__sync_fetch_and_or(&ref->reads, STATE_CUT_SHORT) & STATE_CUT_SHORT))
		count(CNT_SPLICE_TRUNCATED);
}

static __always_inline void peer_ended(struct bpf_sock_ops *skops)
{
	struct bpf_sock *sk = skops->sk;
	if (!sk)
		return;
	struct sock_state *st = bpf_sk_storage_get(&sock_states, sk, 0, 0);
	if (!st)
		return;
	struct peer_ref *ref = bpf_map_lookup_elem(&peer_refs, &st->self);
	if (ref && (ref->reads & STATE_CAUGHT))
		count_cut_short(ref);
}

SEC("sockops")
int shunt_sockops(struct bpf_sock_ops *skops)
{
	switch (skops->op) {
	case BPF_SOCK_OPS_TIMEOUT_INIT:
		/* Runs for the client's own socket too; only the server's
		 * request socket (not a full socket) registers. */
		if (!skops->is_fullsock)
			register_request(skops);
		break;
	case BPF_SOCK_OPS_HDR_OPT_LEN_CB:
		/* Asked for by a client that claimed (bind_claim): its ACK.
		 * A request socket's SYN-ACK asks where an install before
		 * this one armed its listener: nothing to write there. */
		if (skops->is_fullsock)
			reserve_claim(skops);
		break;
	case BPF_SOCK_OPS_WRITE_HDR_OPT_CB:
		if (skops->is_fullsock)
			write_claim(skops);
		break;
	case BPF_SOCK_OPS_TCP_CONNECT_CB:
		client_connects(skops);
		break;
	case BPF_SOCK_OPS_ACTIVE_ESTABLISHED_CB:
		client_established(skops);
		break;
	case BPF_SOCK_OPS_PASSIVE_ESTABLISHED_CB:
		server_established(skops);
		break;
	case BPF_SOCK_OPS_STATE_CB:
		if (skops->args[1] == BPF_TCP_CLOSE)
			withdraw(skops);
		else if (skops->args[1] == BPF_TCP_CLOSE_WAIT)
			peer_ended(skops);
		break;
	}
	return 1;
}
