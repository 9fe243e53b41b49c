// SPDX-License-Identifier: GPL-2.0
/* Iterators over every open file: the flows listed, the drain before a
 * disable, the stall scan.
 *
 * Part of bypass.c, which includes the parts in order: each uses what the
 * ones before it define. */

/* One record per socket shunt holds that some process has open. A server
 * socket its listener has not accepted yet has no file and is not listed. */
SEC("iter/task_file")
int shunt_iter_flows(struct bpf_iter__task_file *ctx)
{
	struct flow_record r = {};
	struct sock *sk = held_state(ctx->file, &r.state);
	if (!sk)
		return 0;
	r.cookie = held_cookie(sk);
	r.cgroup_id = BPF_CORE_READ(sk, sk_cgrp_data.cgroup, kn, id);
	r.tcp_state = BPF_CORE_READ(sk, __sk_common.skc_state);
	bpf_seq_write(ctx->meta->seq, &r, sizeof(r));
	return 0;
}

/* Removes every held socket whose redirect queues are empty from the
 * sockhash; reports the keys of those that still hold unread bytes
 * (deleting them would drop the bytes). */
SEC("iter/task_file")
int shunt_iter_drain(struct bpf_iter__task_file *ctx)
{
	struct sock_state st;
	struct sock *sk = held_state(ctx->file, &st);
	if (!sk)
		return 0;
	struct sock_key k = st.self;
	if (!ingress_empty(sk)) {
		bpf_seq_write(ctx->meta->seq, &k, sizeof(k));
		return 0;
	}
	bpf_map_delete_elem(&sock_hash, &k);
	return 0;
}

/* Who reads a socket the stall scan found, for the guard to wake: the
 * process whose file it visits, through descriptor fd. */
static __always_inline void scan_note_reader(struct peer_ref *ref, struct sock *sk, struct task_struct *task, __u32 fd)
{
	ref->cookie = held_cookie(sk);
	ref->reader_pid = task->tgid;
	ref->reader_ino = socket_ino(sk);
	struct task_struct *leader = task->group_leader;
	if (leader)
		bpf_probe_read_kernel_str(ref->reader_comm, sizeof(ref->reader_comm), leader->comm);
	__u32 hint = fd + 1;
	bpf_map_update_elem(&reader_fds, &ref->cookie, &hint, BPF_ANY);
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
	struct sock_state st;
	struct sock *sk = held_state(ctx->file, &st);
	struct task_struct *task = ctx->task;
	if (!sk || !task)
		return 0;
	struct sock_key k = st.self;
	struct peer_ref *ref = bpf_map_lookup_elem(&peer_refs, &k);
	if (!ref)
		return 0;
	if (ref->leaving || (ref->reads & STATE_TCP_READER)) {
		/* Leaving on its own time (a settle: its peer's reader blocked
		 * in recv), and FIONREAD told its reader too few meanwhile:
		 * with only TCP bytes queued no redirect can be landing, so it
		 * goes now, and wakes its reader as it goes. A poller told 0
		 * waited the settle out (100 ms for its first answer). */
		if (ref->reads & STATE_TOLD_SHORT) {
			__sync_fetch_and_and(&ref->reads, ~STATE_TOLD_SHORT);
			if (nothing_landing(sk, ref)) {
				scan_note_reader(ref, sk, task, ctx->fd);
				__sync_fetch_and_or(&ref->reads, STATE_WATCHED);
				arm(ref, 0);
			}
		}
		return 0;
	}
	__u32 hidden;
	/* The end unread with nobody waiting on the socket (a pool's idle
	 * connection) is no stall, and is not counted or logged as one; it
	 * still goes back to TCP and its reader is woken, quietly, as before
	 * this distinction (nginx's stream proxy on 6.1 under qemu once kept
	 * a client open past its end without that). */
	int quiet = 0;
	int stalls = may_stall(sk, ref, &hidden);
	/* FIONREAD told its reader too few (shunt_fionread_told): with
	 * those bytes still hidden it goes now, whatever it read since. */
	__u32 found = FOUND_BY_SCAN;
	if (ref->reads & STATE_TOLD_SHORT) {
		__sync_fetch_and_and(&ref->reads, ~STATE_TOLD_SHORT);
		if (hidden)
			found = FOUND_BY_FIONREAD;
	}
	if (!stalls) {
		if (!end_unread(sk, ref)) {
			ref->scan_at = 0;
			return 0;
		}
		quiet = 1;
	}
	__u64 now = bpf_ktime_get_ns();
	__u32 progress = read_progress(sk, ref);
	if (found == FOUND_BY_SCAN && (!ref->scan_at || ref->scan_progress != progress)) {
		ref->scan_at = now;
		ref->scan_progress = progress;
		return 0;
	}
	if (found == FOUND_BY_SCAN && now - ref->scan_at < cfg.scan_stall_ns)
		return 0;
	scan_note_reader(ref, sk, task, ctx->fd);
	rescue(&k, ref, hidden, move_delay(sk, ref), quiet ? EVENT_WAKE : EVENT_STALL_RESCUED, found, 0);
	bpf_seq_write(ctx->meta->seq, &k, sizeof(k));
	return 0;
}
