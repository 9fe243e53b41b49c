// SPDX-License-Identifier: GPL-2.0
/* Socket options and file hooks: receive options, transmit timestamps and
 * kernel TLS set on a held socket, zerocopy receive, and --refuse-splice's
 * LSM hook; how a hook that reaches a socket through its file finds shunt's
 * state of it (the iterators', iter.h, and the LSM hook's).
 *
 * Part of bypass.c, which includes the parts in order: each uses what the
 * ones before it define. */

/* The socket behind an open file, if it is one with a psock (in a sockhash
 * or sockmap). */
static __always_inline struct sock *file_psock_sock(struct file *f)
{
	if (!f)
		return 0;
	struct socket *sock = bpf_sock_from_file(f);
	if (!sock)
		return 0;
	struct sock *sk = sock->sk;
	if (!sk || !BPF_CORE_READ(sk, sk_user_data))
		return 0;
	return sk;
}

/* The id of the install's sock_states map: Go sets it when it loads the
 * iterators (loadBound) and the LSM hook. */
volatile const __u32 states_map_id;

/* Storages a socket may have before shunt's is found: one per socket
 * storage map that stored on it (shunt has two). */
#define STORAGE_WALK 8

/* Shunt's state of a socket reached through its file, copied into *st: the
 * socket itself if shunt holds it (has its storage), else 0.
 *
 * The socket of bpf_sock_from_file is not trusted, and newer verifiers (a
 * 6.18.44 build these machines ran from 2026-12-02) make the sock it points
 * to an untrusted pointer, which no socket helper takes (bpf_sk_storage_get,
 * bpf_get_socket_cookie). So the storage is found as the kernel finds it,
 * in the socket's list of storages, by its map's id, and copied with probe
 * reads; the returned socket is for reading only. The copy is as current as
 * a lookup's: its counters are written without a lock either way. */
static __always_inline struct sock *sock_held_state(struct sock *sk, struct sock_state *st)
{
	struct bpf_local_storage *ls = BPF_CORE_READ(sk, sk_bpf_storage);
	if (!ls)
		return 0;
	struct hlist_node *n = BPF_CORE_READ(ls, list.first);
	for (int i = 0; i < STORAGE_WALK && n; i++) {
		void *e = (void *)n - bpf_core_field_offset(struct bpf_local_storage_elem, snode);
		struct bpf_local_storage_map *m = BPF_CORE_READ((struct bpf_local_storage_elem *)e, sdata.smap);
		if (m && BPF_CORE_READ(m, map.id) == states_map_id) {
			void *data = e + bpf_core_field_offset(struct bpf_local_storage_elem, sdata) +
				     bpf_core_field_offset(struct bpf_local_storage_data, data);
			return bpf_probe_read_kernel(st, sizeof(*st), data) ? 0 : sk;
		}
		n = BPF_CORE_READ(n, next);
	}
	return 0;
}

/* The socket behind an open file, if shunt holds it (its storage, and a
 * psock: in the sockhash; a client whose server declined, release_client,
 * keeps its storage until it closes but has no psock), its state copied
 * into *st. A socket several processes hold is seen once per process: user
 * space counts it once. */
static __always_inline struct sock *held_state(struct file *f, struct sock_state *st)
{
	struct sock *sk = file_psock_sock(f);
	return sk ? sock_held_state(sk, st) : 0;
}

/* Made at pairing (publish); read, as the socket is not trusted here. */
static __always_inline __u64 held_cookie(struct sock *sk)
{
	return BPF_CORE_READ(sk, __sk_common.skc_cookie.counter);
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
	/* In the sockhash while it has a peer_ref (leave_timer_cb drops both). */
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
	/* In the sockhash while it has a peer_ref (leave_timer_cb drops both). */
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
	struct sock *sk = file_psock_sock(file);
	if (!sk || !in_splice())
		return 0;
	struct sock_state st;
	if (!sock_held_state(sk, &st))
		return 0;
	/* Noted on its peer_refs entry, not its storage: the socket is
	 * reached untrusted, for reading only (held_state). A read clears it
	 * (forget_refusal). */
	struct peer_ref *ref = bpf_map_lookup_elem(&peer_refs, &st.self);
	if (!ref)
		return 0; /* leaving: its peer's sends take TCP */
	if (__sync_fetch_and_or(&ref->reads, STATE_SPLICE_REFUSED) & STATE_SPLICE_REFUSED) {
		/* Counted per socket: a caught one splices on until reset. */
		if (!(st.flags & STATE_SPLICE))
			count(CNT_SPLICE_RETRIED);
		return 0;
	}
	count(CNT_SPLICE_REFUSED);
	return -EINVAL;
}
