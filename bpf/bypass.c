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
	__u32 reader_port_ttl_s;   /* how long a server port whose reader needed TCP stays unpaired (0: never) */
	__u32 uring_nr;       /* io_uring_enter(2): may wait for the socket's readiness */
	__u32 epoll_nrs[3];   /* epoll_wait, epoll_pwait, epoll_pwait2: the epoll file is the first argument */
	__u32 poll_nrs[4];    /* poll, ppoll, select, pselect6: their entries on the socket's wait queue say what they ask */
	__u32 sendto_nr;      /* send(2) and sendto(2): flags are the fourth argument */
	__u32 sendmsg_nr;     /* sendmsg(2): flags are the third */
	__u32 sendmmsg_nr;    /* sendmmsg(2): flags are the fourth */
	__u64 told_zero_ns;   /* stall_ns for a reader FIONREAD tells 0 while TCP holds bytes for it (stall_after) */
} cfg = {
	.settle_ns = 100ULL * 1000 * 1000,
	.max_backlog = 8 << 20,
	.stall_ns = 20ULL * 1000 * 1000,
	.told_zero_ns = 2ULL * 1000 * 1000,
	.scan_stall_ns = 500ULL * 1000 * 1000,
};

/* The port's readers needed TCP within cfg.reader_port_ttl_s: what
 * reader_ports holds for it, else NULL. */
static __always_inline struct reader_port_seen *kept_port(__u64 netns, __u16 port)
{
	if (!cfg.reader_port_ttl_s)
		return 0;
	struct reader_port k = { .netns = netns, .port = port };
	struct reader_port_seen *s = bpf_map_lookup_elem(&reader_ports, &k);
	if (!s || bpf_ktime_get_ns() - s->seen_ns > (__u64)cfg.reader_port_ttl_s * 1000000000ULL)
		return 0;
	return s;
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
	struct reader_port_seen *kept = kept_port(netns, fresh.server.server_port);
	if (kept) {
		__sync_fetch_and_add(&kept->kept, 1);
		count(CNT_READER_PORT);
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

static int leave_cb(void *map, struct sock_key *key, struct peer_ref *ref);

/* Make this socket visible to its peer's flow control, and ask for the
 * state change that will withdraw it when the socket closes. rcv_isn and
 * snd_isn: the handshake's initial sequence numbers each way. */
static __always_inline void publish(struct bpf_sock_ops *skops, struct bpf_sock *sk, struct sock_key *self,
				    struct sock_key *peer, __u32 rcv_isn, __u32 snd_isn)
{
	struct tcp_sock *tp = bpf_skc_to_tcp_sock(sk);
	if (!tp)
		return;
	struct peer_ref empty = {};
	if (bpf_map_update_elem(&peer_refs, self, &empty, BPF_ANY))
		return;
	struct peer_ref *ref = bpf_map_lookup_elem(&peer_refs, self);
	if (!ref)
		return;
	ref->peer = *peer;
	/* The callback must belong to a sockops program: only those (and
	 * iterators) may delete from a sockhash. */
	bpf_timer_init(&ref->leave, &peer_refs, CLOCK_MONOTONIC);
	bpf_timer_set_callback(&ref->leave, leave_cb);
	ref->tcp_copied = tp->copied_seq;
	ref->rcv_origin = rcv_isn + 1;
	ref->snd_origin = snd_isn + 1;
	ref->sk = tp;
	bpf_sock_ops_cb_flags_set(skops, skops->bpf_sock_ops_cb_flags | BPF_SOCK_OPS_STATE_CB_FLAG);
}

static __always_inline void withdraw(struct bpf_sock_ops *skops)
{
	struct bpf_sock *sk = skops->sk;
	if (!sk)
		return;
	struct sock_state *st = bpf_sk_storage_get(&sock_states, sk, 0, 0);
	if (st)
		bpf_map_delete_elem(&peer_refs, &st->self);
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
	bpf_map_delete_elem(&peer_refs, client);
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

/* What the peer's receive side holds for flow control. */
struct peer_buffer {
	__u32 unread;        /* redirected bytes its reader has not read */
	__u32 rcvbuf;
	int rcvbuf_locked;   /* the reader set SO_RCVBUF: its bound, not ours */
};

static __always_inline void peer_buffer(struct peer_ref *ref, unsigned long ud, struct peer_buffer *b)
{
	void *sk = ref->sk;
	if (cfg.probe_reads) {
		struct sock *peer = sk;
		/* Through a local: an access through b would be relocated
		 * against a kernel type named peer_buffer. */
		struct sk_psock *psock = (struct sk_psock *)ud;
		if (PSOCK_COUNTS)
			b->unread = BPF_CORE_READ(psock, msg_tot_len);
		else
			b->unread = counted_unread(ref);
		/* A 4-bit field before 6.5ish, a byte after: read it as either. */
		b->rcvbuf_locked = BPF_CORE_READ_BITFIELD_PROBED(peer, sk_userlocks) & SOCK_RCVBUF_LOCK;
		b->rcvbuf = BPF_CORE_READ(peer, sk_rcvbuf);
		return;
	}
	struct sock *peer = bpf_rdonly_cast(sk, bpf_core_type_id_kernel(struct sock));
	struct sk_psock *psock = bpf_rdonly_cast((void *)ud, bpf_core_type_id_kernel(struct sk_psock));
	b->unread = psock->msg_tot_len;
	b->rcvbuf_locked = peer->sk_userlocks & SOCK_RCVBUF_LOCK;
	b->rcvbuf = peer->sk_rcvbuf;
}

/* sent: the end of what the peer's TCP sender (the sending socket, or the
 * far socket of a join) has queued for TCP. */
static __always_inline int check_peer(struct peer_ref *ref, __u32 sent)
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
	if (!splicer) {
		if ((reads & STATE_TCP_READER) && !may_splice)
			return REDIRECT_READER;
		if (!(reads & STATE_READS) && !cfg.trust_readers)
			return REDIRECT_READER;
	}
	if (!splicer && peer_copied_seq(peer) != sent)
		return REDIRECT_TCP_UNREAD;

	/* Redirected bytes are bounded only by tcp_mem, not the receiver's
	 * buffer: without this a slow reader lets a fast writer fill memory.
	 * Over TCP the writer blocks or gets EAGAIN as TCP decides. */
	struct peer_buffer buf = {};
	peer_buffer(ref, psock, &buf);
	__u32 limit = cfg.max_backlog;
	if (buf.rcvbuf_locked)
		limit = buf.rcvbuf;
	__u32 unread = buf.unread;
	if (splicer) {
		/* A splice reads the TCP queue alone. With nothing redirected
		 * left unread, TCP is in order and the splice reads it. Else a
		 * TCP send would reach the splice ahead of bytes it cannot
		 * read: keep redirecting behind them (the connection is
		 * caught; the guard resets it), and refuse past the bound. */
		if (!unread)
			return REDIRECT_READER;
		return unread > limit ? REDIRECT_REFUSE : REDIRECT_OK;
	}
	/* Its reader's program was just learned splicing (presume_splicer), or
	 * it reads by zerocopy receive or peeks in mid-stream: each sees one
	 * queue alone. With redirected bytes queued, a splice would find TCP's
	 * queue empty and be caught, never read a TCP byte ahead of them, and
	 * a peek would never reach a TCP byte behind them: redirect behind
	 * them until they are read, past the bound too (the state lasts until
	 * then), then take TCP. */
	if (may_splice && !unread && (PSOCK_COUNTS || ingress_empty((struct sock *)peer)))
		return REDIRECT_READER; /* shunt's own count is an estimate: the queue says */
	if (unread > limit && !may_splice)
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
	int r = check_peer(u, out);
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

/* The send takes TCP. */
static __always_inline int pass(struct sock_state *st, __u32 size)
{
	st->pass_msgs++;
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
	bpf_timer_start(&ref->leave, delay, 0);
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
 * waits for them. */
static __always_inline void leave_for_tcp(struct peer_ref *ref, __u32 counter)
{
	if (__sync_fetch_and_or(&ref->reads, STATE_TCP_READER) & STATE_TCP_READER)
		return;
	count(counter);
	start_leave(ref, cfg.settle_ns);
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
	int check = check_peer(ref, tp->write_seq);
	if (check == REDIRECT_JOINED && ref) {
		struct peer_ref *far = 0;
		check = through_join(tp->write_seq, st->tx_bytes, ref, &far, &to, &via);
		if (far)
			ref = far;
	}
	switch (check) {
	case REDIRECT_OK:
		break;
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
		/* fall through */
	default:
		return pass(st, size);
	}

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
	if (!PSOCK_COUNTS && ref) /* REDIRECT_OK: ref is set */
		__sync_fetch_and_add(&ref->redirected_in, size);
	if (via) {
		__sync_fetch_and_add(&via->bytes, size);
		__sync_fetch_and_add(&via->sends, 1);
	}
	st->tx_bytes += size;
	st->tx_msgs++;
	count_send(st, size, 1);
	return SK_PASS;
}

#define MSG_PEEK 0x2
#define MSG_TRUNC 0x20
#define MSG_WAITALL 0x100
#define MSG_ERRQUEUE 0x2000


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
};

static __always_inline void reader_of(struct peer_ref *ref, struct reader *r)
{
	r->cookie = ref->cookie;
	r->ino = ref->reader_ino;
	r->pid = ref->reader_pid;
	__builtin_memcpy(r->comm, ref->reader_comm, sizeof(r->comm));
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
		bpf_timer_start(&ref->leave, ref->leave_after - now, 0);
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
			bpf_timer_start(&ref->leave, DRAIN_WAKE_NS, 0);
			return 0;
		}
		bpf_timer_start(&ref->leave, cfg.settle_ns, 0);
		return 0;
	}
	struct peer_ref *peer = bpf_map_lookup_elem(&peer_refs, &ref->peer);
	/* Out of the sockhash, this socket's sends take TCP. Not while its
	 * peer may splice and holds redirected bytes: a splice would read
	 * those sends first. Until then they queue behind in the redirect
	 * (check_peer), or fail past the bound. */
	if (peer && (peer->reads & (STATE_SPLICE | STATE_MAY_SPLICE)) && peer->sk &&
	    !ingress_empty((struct sock *)peer->sk)) {
		bpf_timer_start(&ref->leave, cfg.settle_ns, 0);
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
			bpf_timer_start(&ref->leave, cfg.settle_ns, 0);
			return 0;
		}
		reader_of(ref, &told);
	}
	/* Gone from peer_refs first: the peer's sends see no peer and take TCP. */
	struct sock_key k = *key;
	bpf_map_delete_elem(&peer_refs, &k);
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

#define EAGAIN 11

/* Whether the thread that read last got EAGAIN from a send since that read,
 * within the stall scan's time (the send watch; kernels with the
 * sock_send_length tracepoint, 6.3). Asleep so, it waits for room to write:
 * a proxy whose client is slow (tokio's copy reads one buffer and waits on
 * its write; Go's io.Copy, nats-server) reads on once its write goes
 * through; a wake-up would only make it read one buffer more and wait
 * again, which looks like nginx told 0. Past the scan's time it is woken
 * as any other (the scan would move it then anyway): nginx told 0 while its
 * client is slow waits that long at most. */
static __always_inline int writer_blocked(struct peer_ref *ref, __u64 now)
{
	struct task_struct *task = ref->reader_task;
	if (!task)
		return 0;
	__u32 tid = BPF_CORE_READ(task, pid);
	struct send_blocked *b = bpf_map_lookup_elem(&send_blocked, &tid);
	if (!b || b->start_time != BPF_CORE_READ(task, start_time))
		return 0;
	return b->at >= ref->watch_at && now - b->at < cfg.scan_stall_ns;
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
		bpf_timer_start(&ref->leave, wait, 0);
		return 0;
	}
	if (now - ref->watch_at < wait) {
		bpf_timer_start(&ref->leave, wait - (now - ref->watch_at), 0);
		return 0;
	}
	__u32 asleep_in = 0;
	if (!waits_for_readiness(ref, sk, &asleep_in)) {
		bpf_timer_start(&ref->leave, cfg.stall_ns, 0);
		return 0;
	}
	if (writer_blocked(ref, now)) {
		/* Not woken, not moved: looked at again after stall_ns (and
		 * the stall scan still looks at it). */
		bpf_timer_start(&ref->leave, cfg.stall_ns, 0);
		return 0;
	}
	int woken = ref->reads & STATE_WOKEN;
	if (!woken && ref->unheeded && (__u32)((now >> 20) - ref->unheeded) < (UNHEEDED_QUIET_NS >> 20)) {
		/* It let a wake-up pass a moment ago: it reads when what it
		 * waits for comes. Not woken again within the quiet time (a
		 * Go proxy pauses at each write to a slow client; each wake
		 * costs the guard a look through its descriptors). */
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
		bpf_timer_start(&ref->leave, wait, 0);
		return 0;
	}
	if (progress == ref->woke_progress) {
		/* Woken, and nothing read: it waits for something else (its
		 * own writes, held back by their reader), not for this
		 * socket's edge, which it got. Given stall_ns to answer the
		 * wake-up; then watched again from its next read, and the
		 * stall scan still looks at it. */
		if (now - ref->watch_at < cfg.stall_ns) {
			bpf_timer_start(&ref->leave, cfg.stall_ns - (now - ref->watch_at), 0);
			return 0;
		}
		ref->unheeded = (now >> 20) | 1;
		__sync_fetch_and_and(&ref->reads, ~(STATE_WATCHED | STATE_WOKEN));
		return 0;
	}
	rescue(key, ref, hidden, move_delay(sk, ref), EVENT_STALL_RESCUED, FOUND_BY_WATCH, asleep_in);
	return leave(key, ref, tp);
}

/* The peer_ref's timer: the leave once the socket's reader needs TCP (or
 * its peer left), else the stall watch. */
static int leave_cb(void *map, struct sock_key *key, struct peer_ref *ref)
{
	struct tcp_sock *tp = ref->sk;
	if (!tp)
		return 0;
	if (ref->leaving || (ref->reads & STATE_TCP_READER))
		return leave(key, ref, tp);
	return stall_check(key, ref, tp);
}

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

/* Runs after every recvmsg on the host (read, recv, recvmsg, io_uring recv):
 * records how the reader of a paired socket reads, for its peer's sk_msg.
 * A reader that blocks or asks for MSG_WAITALL (MSG_OOB, MSG_TRUNC) sends
 * its connection back to TCP; event-loop readers (non-blocking) keep the
 * bypass.
 * Sockets shunt does not hold have no storage and cost one pointer test. */
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
			bpf_timer_start(&ref->leave, 0, 0);
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
			bpf_timer_start(&ref->leave, 0, 0);
		return;
	}
	ref->cookie = bpf_get_socket_cookie(sk);
	ref->reader_pid = bpf_get_current_pid_tgid() >> 32;
	ref->reader_ino = socket_ino(sk);
	current_comm(ref->reader_comm);
	__u32 old = __sync_fetch_and_or(&ref->reads, STATE_WATCHED);
	if (old & (STATE_WATCHED | STATE_TCP_READER))
		return;
	if (hasten)
		bpf_timer_start(&ref->leave, 0, 0);
	else if (!ref->leaving)
		bpf_timer_start(&ref->leave, stall_after(sk), 0);
}

/* A server socket's reader needs TCP: the next connections to its port
 * are left unpaired for a while (reader_ports). */
static __always_inline void learn_reader_port(struct sock_state *st)
{
	struct reader_port k = { .netns = st->self.netns, .port = st->self.tuple.server_port };
	__u64 now = bpf_ktime_get_ns();
	__u32 pid = bpf_get_current_pid_tgid() >> 32;
	struct reader_port_seen *s = bpf_map_lookup_elem(&reader_ports, &k);
	if (s) {
		s->seen_ns = now;
		s->pid = pid;
		current_comm(s->comm);
		return;
	}
	struct reader_port_seen fresh = { .seen_ns = now, .pid = pid };
	current_comm(fresh.comm);
	bpf_map_update_elem(&reader_ports, &k, &fresh, BPF_NOEXIST);
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

static __always_inline int watch_read(struct sock *sk, int ret, int flags)
{
	if (flags & MSG_ERRQUEUE)
		return 0; /* completions and errors, not the stream */
	struct sock_state *st = bpf_sk_storage_get(&sock_states, sk, 0, 0);
	if (!st)
		return 0;
	note_regs_at();
	if (ret == 0)
		note_eof(sk, st);
	/* A read after a refused splice: the program reads instead. */
	if (st->flags & STATE_SPLICE_REFUSED)
		__sync_fetch_and_and(&st->flags, ~STATE_SPLICE_REFUSED);
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
		if (ret > 0)
			watch_stall(sk, st);
		return 0;
	}
	if (old & mark)
		return 0;
	count(CNT_TCP_READER);
	/* A discard is mostly a drain before close (HAProxy's), no habit
	 * of the port's other readers. */
	if (st->self.role == ROLE_SERVER && !(flags & MSG_TRUNC))
		learn_reader_port(st);
	/* Never seen in recv before: the peer never redirected to it, so
	 * nothing can be on the way. */
	start_leave(ref, (old & STATE_READS) ? cfg.settle_ns : 0);
	return 0;
}

SEC("tp_btf/sock_recv_length")
int BPF_PROG(shunt_reads, struct sock *sk, int ret, int flags)
{
	return watch_read(sk, ret, flags);
}

/* The send watch (writer_blocked): notes when a thread's send got EAGAIN.
 * Runs at every send of the host; any other send returns at once. */
SEC("tp_btf/sock_send_length")
int BPF_PROG(shunt_sends, struct sock *sk, int ret, int flags)
{
	if (ret != -EAGAIN)
		return 0;
	struct task_struct *task = bpf_get_current_task_btf();
	__u32 tid = task->pid;
	__u64 now = bpf_ktime_get_ns();
	/* An event loop gets EAGAIN at each write to a slow client: its
	 * entry is updated in place, no LRU update each time. */
	struct send_blocked *old = bpf_map_lookup_elem(&send_blocked, &tid);
	if (old && old->start_time == task->start_time) {
		old->at = now;
		return 0;
	}
	struct send_blocked b = { .start_time = task->start_time, .at = now };
	bpf_map_update_elem(&send_blocked, &tid, &b, BPF_ANY);
	return 0;
}

/* Kernels before 6.3 have no sock_recv_length tracepoint. Every read of a
 * socket in the sockhash (with sk_msg only, as shunt's) goes through
 * tcp_bpf_recvmsg, with the flags recvmsg got (MSG_DONTWAIT included):
 * watched on its way out where fexit programs load. */
SEC("fexit/tcp_bpf_recvmsg")
int BPF_PROG(shunt_reads_fexit, struct sock *sk, void *msg, __u64 len, int flags, int *addr_len, int ret)
{
	return watch_read(sk, ret, flags);
}

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

/* FIONREAD made to count every queued byte, on kernels whose answer leaves
 * some out while a socket is in a sockhash (fionread_missing): a reader
 * that reads only what FIONREAD announces, and waits or sleeps while told
 * 0 (a Java available() loop, nginx after a full buffer), is told what is
 * there. Runs as the ioctl returns, adds the missing bytes to the answer
 * the kernel wrote to the caller's memory (bpf_probe_write_user: refused
 * under lockdown, where the stall watch and scan remain the net). Any
 * socket with a psock and no sk_skb verdict is corrected, shunt's or not:
 * the answer only becomes true. Attached only where FIONREAD misses bytes;
 * every ioctl of the host passes here (the first tests end the others). */
SEC("tracepoint/syscalls/sys_exit_ioctl")
int shunt_fionread(struct sys_exit_record *ctx)
{
	if (ctx->ret)
		return 0;
	struct task_struct *task = bpf_get_current_task_btf();
	struct pt_regs *regs = (struct pt_regs *)bpf_task_pt_regs(task);
	if (!regs || (__u32)regs->si != FIONREAD)
		return 0;
	__u32 fd = regs->di;
	int *answer = (int *)regs->dx;
	struct file *f = task_file(task, fd);
	if (!f)
		return 0;
	if ((BPF_CORE_READ(f, f_inode, i_mode) & S_IFMT) != S_IFSOCK)
		return 0;
	struct socket *sock = BPF_CORE_READ(f, private_data);
	struct sock *sk = BPF_CORE_READ(sock, sk);
	if (!sk || BPF_CORE_READ(sk, sk_protocol) != IPPROTO_TCP)
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

#define PF_IO_WORKER 0x10
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
		 * wait for redirects decided before the mark (leave_cb
		 * reports them if they land). */
		start_leave(ref, (old & STATE_READS) ? cfg.settle_ns : 0);
	}
	return 0;
}

/* The socket behind an open file and its bypass state, if shunt holds it
 * (in the sockhash: a client whose server declined, release_client, keeps
 * its storage until it closes but has no psock). A socket several processes
 * hold is seen once per process by the iterators: user space counts it
 * once. */
static __always_inline struct sock_state *held_socket(struct file *f, struct sock **skp)
{
	if (!f)
		return 0;
	struct socket *sock = bpf_sock_from_file(f);
	if (!sock)
		return 0;
	struct sock *sk = sock->sk;
	if (!sk)
		return 0;
	struct sock_state *st = bpf_sk_storage_get(&sock_states, sk, 0, 0);
	if (!st || !BPF_CORE_READ(sk, sk_user_data))
		return 0;
	*skp = sk;
	return st;
}

#define MAY_READ 0x4 /* include/linux/fs.h */
#define EINVAL 22

#define SOL_SOCKET 1
#define SO_ZEROCOPY 60
#define SO_RCVLOWAT 18
#define SO_PEEK_OFF 42
#define SO_TIMESTAMP_OLD 29
#define SO_TIMESTAMPNS_OLD 35
#define SO_TIMESTAMPING_OLD 37
#define SO_TIMESTAMP_NEW 63
#define SO_TIMESTAMPNS_NEW 64
#define SO_TIMESTAMPING_NEW 65
#define SOL_TCP 6
#define TCP_INQ 36

/* setsockopt of a receive option only TCP honours (receive_options) on a
 * socket in the sockhash: the call goes through, and the socket's reader
 * is sent back to TCP (its peer's sends take TCP from now on, and it leaves
 * the sockhash once what was redirected to it is read). Values that ask for
 * nothing (SO_RCVLOWAT 1 or 0, TCP_INQ 0, SO_PEEK_OFF -1) change nothing:
 * the guard's wake-up sets SO_RCVLOWAT to what it is. */
static __always_inline int sets_receive_option(struct bpf_sockopt *ctx)
{
	int *v = ctx->optval;
	if ((void *)(v + 1) > ctx->optval_end)
		return 0;
	if (ctx->level == SOL_SOCKET && ctx->optname == SO_RCVLOWAT)
		return *v > 1;
	if (ctx->level == SOL_SOCKET && ctx->optname == SO_PEEK_OFF)
		return *v >= 0;
	if (ctx->level == SOL_TCP && ctx->optname == TCP_INQ)
		return *v != 0;
	if (ctx->level != SOL_SOCKET)
		return 0;
	switch (ctx->optname) {
	case SO_TIMESTAMP_OLD:
	case SO_TIMESTAMPNS_OLD:
	case SO_TIMESTAMP_NEW:
	case SO_TIMESTAMPNS_NEW:
		return *v != 0;
	case SO_TIMESTAMPING_OLD:
	case SO_TIMESTAMPING_NEW:
		return (*v & (SOF_TIMESTAMPING_RX_HARDWARE | SOF_TIMESTAMPING_RX_SOFTWARE)) != 0;
	}
	return 0;
}
/* setsockopt(SO_TIMESTAMPING) asking for transmit timestamps
 * (tx_timestamps). */
static __always_inline int sets_tx_timestamps(struct bpf_sockopt *ctx)
{
	int *v = ctx->optval;
	if ((void *)(v + 1) > ctx->optval_end || ctx->level != SOL_SOCKET)
		return 0;
	if (ctx->optname != SO_TIMESTAMPING_OLD && ctx->optname != SO_TIMESTAMPING_NEW)
		return 0;
	return (*v & SOF_TIMESTAMPING_TX) != 0;
}

#define EOPNOTSUPP 95
#define ENOENT 2
#define TCP_ULP 31

/* setsockopt(SO_ZEROCOPY) on a socket in the sockhash fails with EOPNOTSUPP,
 * as on a socket that cannot do zerocopy. Its sends go through sk_msg, which
 * never queues a MSG_ZEROCOPY completion, and a socket leaves the sockhash
 * only later (from sockops or a timer: no program of this hook may delete
 * from it), so a program that waited for its completions would wait
 * forever. Set before the connection is established, SO_ZEROCOPY keeps the
 * connection off the bypass instead (uses_zerocopy).
 *
 * setsockopt(SO_TIMESTAMPING) asking for transmit timestamps goes through,
 * and the socket's own sends take TCP from the next one on (the connection
 * leaves the sockhash once nothing redirected is unread): only TCP's
 * transmit path makes those timestamps.
 *
 * setsockopt(TCP_ULP) on a socket in the sockhash fails with ENOENT, as on
 * a kernel without that upper layer (kernel TLS: nginx and OpenSSL with
 * KTLS on set it right before the keys). The kernel refuses the keys on a
 * socket with a psock anyway (EINVAL: TLS and sockmap are mutually
 * exclusive), but lets the layer on; and the TLS layer keeps one table of
 * protocol operations per address family, rebuilt from whichever socket
 * put the layer on last. A bypassed socket that had it read through
 * tcp_recvmsg, blind to its psock queue, as soon as a socket off the
 * bypass put it on too (by hand on 6.12: 0 of 200,000 redirected bytes
 * read, for good). Told ENOENT, OpenSSL keeps the record layer in user
 * space and the connection stays bypassed. */
SEC("cgroup/setsockopt")
int shunt_setsockopt(struct bpf_sockopt *ctx)
{
	/* The program sees at most a page of optval. Told 0, the kernel takes
	 * the caller's own buffer, whatever its length, as the kernel's
	 * cgroup sockopt documentation asks; kernels without the later fix
	 * fail such a call with EFAULT otherwise (Debian's 6.1.0-56 has it:
	 * TestLargeSetsockoptAsWithoutShunt passes there either way). */
	if (ctx->optlen > 4096)
		ctx->optlen = 0;
	int receive = sets_receive_option(ctx);
	int tx = sets_tx_timestamps(ctx);
	int ulp = ctx->level == SOL_TCP && ctx->optname == TCP_ULP;
	if (!receive && !tx && !ulp && (ctx->level != SOL_SOCKET || ctx->optname != SO_ZEROCOPY))
		return 1;
	struct bpf_sock *sk = ctx->sk;
	if (!sk)
		return 1;
	struct sock_state *st = bpf_sk_storage_get(&sock_states, sk, 0, 0);
	/* In the sockhash while it has a peer_ref (leave_cb drops both). */
	struct peer_ref *ref = st ? bpf_map_lookup_elem(&peer_refs, &st->self) : 0;
	if (!st || !ref)
		return 1;
	if (receive) {
		__sync_fetch_and_or(&st->flags, STATE_TCP_READER);
		leave_for_tcp(ref, CNT_RECEIVE_OPTION);
	}
	if (tx) {
		/* Its own sends take TCP from the next one on, as after an
		 * urgent send: its peer's direction is marked for TCP. */
		struct peer_ref *peer = bpf_map_lookup_elem(&peer_refs, &st->peer);
		if (peer)
			leave_for_tcp(peer, CNT_TX_TIMESTAMPS);
	}
	if (receive || tx)
		return 1;
	if (ulp) {
		count(CNT_ULP_REFUSED);
		bpf_set_retval(-ENOENT);
		return 0;
	}
	int *on = ctx->optval;
	if ((void *)(on + 1) > ctx->optval_end || !*on)
		return 1; /* turning it off changes nothing */
	count(CNT_ZEROCOPY_REFUSED);
	bpf_set_retval(-EOPNOTSUPP);
	return 0;
}

#define TCP_ZEROCOPY_RECEIVE 35

/* getsockopt(TCP_ZEROCOPY_RECEIVE) maps pages of TCP's receive queue into
 * the caller's memory: the queue alone, never the bytes redirected into the
 * socket's psock, so a reader that takes its bytes this way (and read()s
 * only the parts it cannot map, the skip hint) would poll for ever once
 * its peer's sends were redirected (by hand on 6.18: 64 KiB of 1 MiB
 * taken, then POLLIN with nothing to map). Its socket is marked a reader
 * that needs TCP at its first such call, as after SO_RCVLOWAT: its peer's
 * sends take TCP from then on, and it leaves the sockhash once nothing
 * redirected is unread. A program that calls it before it reads (the
 * usual way: the call comes before any read() of a skip hint) never gets
 * a redirected byte.
 *
 * One that read before may have redirected bytes queued, or landing from
 * a send decided before the mark: a TCP byte mapped ahead of them would
 * reorder the stream, so its peer's sends queue behind them instead
 * (STATE_MAY_SPLICE, as for a splicer), and a call that finds them queued
 * has the guard reset the connection (report_zerocopy_caught): its reader
 * would poll for them for ever.
 *
 * The hook runs after the kernel's getsockopt, for every getsockopt of the
 * cgroup's sockets. Told optlen 0, the kernel leaves the caller's buffer
 * and length as its handler (or its error path) left them: otherwise it
 * copies the program's view back, zeros for a failed call, and fails a
 * call whose buffer is over a page with EFAULT. */
SEC("cgroup/getsockopt")
int shunt_getsockopt(struct bpf_sockopt *ctx)
{
	int zerocopy_receive = ctx->level == SOL_TCP && ctx->optname == TCP_ZEROCOPY_RECEIVE;
	ctx->optlen = 0;
	if (!zerocopy_receive)
		return 1;
	struct bpf_sock *sk = ctx->sk;
	if (!sk)
		return 1;
	struct sock_state *st = bpf_sk_storage_get(&sock_states, sk, 0, 0);
	if (!st)
		return 1;
	/* In the sockhash while it has a peer_ref (leave_cb drops both). */
	struct peer_ref *ref = bpf_map_lookup_elem(&peer_refs, &st->self);
	if (!ref)
		return 1;
	one_queue_reader(st, ref, CNT_ZEROCOPY_RECEIVE);
	if (ref->sk && !ingress_empty((struct sock *)ref->sk)) {
		struct sock_key self = st->self;
		report_zerocopy_caught(ref, &self, (struct sock *)ref->sk);
	}
	return 1;
}

/* Runs before a file is read or written (lsm/file_permission; a splice(2)
 * from a socket checks it before it reads): a splice from a socket shunt
 * holds fails with EINVAL and reads nothing. A splice reads the TCP queue
 * alone and would miss redirected bytes; told EINVAL, Go's io.Copy and
 * lighttpd read with read/recv instead, which sees them, so the connection
 * stays bypassed. A program that splices again without reading in between
 * does not read instead (HAProxy 2.6 waits for its splice for good): that
 * splice is let through, and the splice watch above handles it as without
 * this hook (the socket goes back to TCP and the program is learned; if
 * redirected bytes are queued the connection is caught and reset). Loaded
 * only with --refuse-splice, where the kernel runs BPF LSM programs. Every
 * file read and write on the host passes here: other files cost the mask
 * test and one helper call. */
SEC("lsm/file_permission")
int BPF_PROG(shunt_refuse_splice, struct file *file, int mask, int ret)
{
	if (ret || !(mask & MAY_READ))
		return ret;
	/* A socket back on plain TCP (out of the sockhash) is not held: a
	 * splice reads all there is. */
	struct sock *sk = 0;
	struct sock_state *st = held_socket(file, &sk);
	if (!st)
		return 0;
	if (!in_splice())
		return 0;
	if (__sync_fetch_and_or(&st->flags, STATE_SPLICE_REFUSED) & STATE_SPLICE_REFUSED) {
		/* Counted per socket: a caught one splices on until reset. */
		if (!(st->flags & STATE_SPLICE))
			count(CNT_SPLICE_RETRIED);
		return 0;
	}
	count(CNT_SPLICE_REFUSED);
	return -EINVAL;
}

/* One record per socket shunt holds that some process has open. A server
 * socket its listener has not accepted yet has no file and is not listed. */
SEC("iter/task_file")
int shunt_iter_flows(struct bpf_iter__task_file *ctx)
{
	struct sock *sk = 0;
	struct sock_state *st = held_socket(ctx->file, &sk);
	if (!st || !sk)
		return 0;
	struct flow_record r = {};
	r.cookie = bpf_get_socket_cookie(sk);
	r.cgroup_id = BPF_CORE_READ(sk, sk_cgrp_data.cgroup, kn, id);
	r.tcp_state = BPF_CORE_READ(sk, __sk_common.skc_state);
	__builtin_memcpy(&r.state, st, sizeof(r.state));
	bpf_seq_write(ctx->meta->seq, &r, sizeof(r));
	return 0;
}

/* Removes every held socket whose redirect queues are empty from the
 * sockhash; reports the keys of those that still hold unread bytes
 * (deleting them would drop the bytes). */
SEC("iter/task_file")
int shunt_iter_drain(struct bpf_iter__task_file *ctx)
{
	struct sock *sk = 0;
	struct sock_state *st = held_socket(ctx->file, &sk);
	if (!st || !sk)
		return 0;
	struct sock_key k = st->self;
	if (!ingress_empty(sk)) {
		bpf_seq_write(ctx->meta->seq, &k, sizeof(k));
		return 0;
	}
	bpf_map_delete_elem(&sock_hash, &k);
	return 0;
}

/* The stall scan, which the guard runs every few hundred milliseconds: a
 * held socket with bytes queued that FIONREAD does not count here, whose
 * reader has read nothing for cfg.scan_stall_ns, goes back to TCP and its
 * reader is woken, whatever the reader waits for and however it got there
 * (a read the stall watch saw, or none: FIONREAD asked before the first
 * read). A reader that only pauses loses the bypass of that connection,
 * nothing else. The peer's end unread counts as such bytes while someone
 * waits on the socket (may_stall): an end its reader missed leaves a
 * connection open for ever (nginx's stream proxy on 6.1 never closed its
 * client); a reader that keeps a half-closed connection registered and
 * reads no more loses its bypass and gets one more EPOLLIN, which reads 0
 * as before. Writes the key of each socket it rescues. */
SEC("iter/task_file")
int shunt_iter_stalls(struct bpf_iter__task_file *ctx)
{
	struct sock *sk = 0;
	struct sock_state *st = held_socket(ctx->file, &sk);
	struct task_struct *task = ctx->task;
	if (!st || !sk || !task)
		return 0;
	struct sock_key k = st->self;
	struct peer_ref *ref = bpf_map_lookup_elem(&peer_refs, &k);
	if (!ref || ref->leaving || (ref->reads & STATE_TCP_READER))
		return 0;
	__u32 hidden;
	/* The end unread with nobody waiting on the socket (a pool's idle
	 * connection) is no stall, and is not counted or logged as one; it
	 * still goes back to TCP and its reader is woken, quietly, as before
	 * this distinction (nginx's stream proxy on 6.1 under qemu once kept
	 * a client open past its end without that). */
	int quiet = 0;
	if (!may_stall(sk, ref, &hidden)) {
		if (!end_unread(sk, ref)) {
			ref->scan_at = 0;
			return 0;
		}
		quiet = 1;
	}
	__u64 now = bpf_ktime_get_ns();
	__u32 progress = read_progress(sk, ref);
	if (!ref->scan_at || ref->scan_progress != progress) {
		ref->scan_at = now;
		ref->scan_progress = progress;
		return 0;
	}
	if (now - ref->scan_at < cfg.scan_stall_ns)
		return 0;
	ref->cookie = bpf_get_socket_cookie(sk);
	ref->reader_pid = task->tgid;
	ref->reader_ino = socket_ino(sk);
	struct task_struct *leader = task->group_leader;
	if (leader)
		bpf_probe_read_kernel_str(ref->reader_comm, sizeof(ref->reader_comm), leader->comm);
	rescue(&k, ref, hidden, move_delay(sk, ref), quiet ? EVENT_WAKE : EVENT_STALL_RESCUED, FOUND_BY_SCAN, 0);
	bpf_seq_write(ctx->meta->seq, &k, sizeof(k));
	return 0;
}
