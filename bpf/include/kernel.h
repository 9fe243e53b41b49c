/* Minimal kernel type definitions for CO-RE reads.
 *
 * Only the fields shunt reads are declared; preserve_access_index makes
 * clang emit relocations so libbpf/cilium-ebpf patch the offsets against the
 * running kernel's BTF at load time. This avoids committing a vmlinux.h.
 */
#pragma once

#include <linux/types.h>

#pragma clang attribute push(__attribute__((preserve_access_index)), apply_to = record)

struct list_head {
	struct list_head *next;
	struct list_head *prev;
};

struct sk_buff_head {
	__u32 qlen;
};

struct kernfs_node {
	__u64 id;
};

struct cgroup {
	struct kernfs_node *kn;
	int level;
	struct cgroup *ancestors[];
};

struct sock_cgroup_data {
	struct cgroup *cgroup;
};

struct ns_common {
	unsigned int inum;
};

struct netns_ipv4 {
	int sysctl_tcp_rmem[3];
	int sysctl_tcp_wmem[3];
};

struct net {
	struct ns_common ns;
	__u64 net_cookie;
	struct netns_ipv4 ipv4;
};

typedef struct {
	struct net *net;
} possible_net_t;

struct in6_addr {
	union {
		__u8 u6_addr8[16];
	} in6_u;
};

typedef struct {
	__s64 counter;
} atomic64_t;

struct sock_common {
	__u32 skc_daddr;
	__u32 skc_rcv_saddr;
	__u16 skc_dport;
	__u16 skc_num;
	unsigned short skc_family;
	unsigned char skc_state;
	possible_net_t skc_net;
	struct in6_addr skc_v6_daddr;
	struct in6_addr skc_v6_rcv_saddr;
	unsigned long skc_flags; /* sk_flags */
	atomic64_t skc_cookie;   /* SO_COOKIE, once asked for */
};

struct inode;

struct file {
	unsigned int f_flags;
	struct inode *f_inode;
	void *private_data; /* a socket file's struct socket */
};

struct sock;

/* Who waits on a socket (include/linux/wait.h): epoll registrations, and
 * poll, select and blocking calls while they sleep. */
struct wait_queue_head {
	struct list_head head;
};

struct socket_wq {
	struct wait_queue_head wait;
};

struct socket {
	unsigned long flags; /* SOCK_NOSPACE: a send found the buffer full */
	struct file *file;
	struct sock *sk;
	struct socket_wq wq;
};

struct inode {
	unsigned long i_ino;
	unsigned short i_mode;
};

/* A socket and its inode are allocated together (include/net/sock.h):
 * "socket:[ino]" in /proc/PID/fd names it. */
struct socket_alloc {
	struct socket socket;
	struct inode vfs_inode;
};

/* include/linux/refcount.h; a socket's count of bytes its sends hold. */
typedef struct {
	int counter;
} atomic_t;

struct refcount_struct {
	atomic_t refs;
};

struct hlist_node {
	struct hlist_node *next;
};

struct hlist_head {
	struct hlist_node *first;
};

struct bpf_map {
	__u32 id;
};

/* Socket storage (bpf_sk_storage), walked with probe reads where the
 * socket is not trusted (the bypass iterators over files). */
struct bpf_local_storage_map {
	struct bpf_map map;
};

struct bpf_local_storage_data {
	struct bpf_local_storage_map *smap;
	__u8 data[];
};

struct bpf_local_storage_elem {
	struct hlist_node snode; /* in its socket's bpf_local_storage list */
	struct bpf_local_storage_data sdata;
};

struct bpf_local_storage {
	struct hlist_head list;
};

struct sock {
	struct bpf_local_storage *sk_bpf_storage;
	struct sock_common __sk_common;
	struct sock_cgroup_data sk_cgrp_data;
	void *sk_user_data;
	struct socket *sk_socket;
	__u16 sk_protocol;
	__u8 sk_userlocks;
	int sk_rcvbuf;
	int sk_sndbuf;
	int sk_wmem_queued;
	struct refcount_struct sk_wmem_alloc;
	long sk_rcvtimeo;
	int sk_rcvlowat;
	int sk_peek_off;
	__u16 sk_tsflags; /* SO_TIMESTAMPING's flags (a u32 on later kernels: the low half holds them all) */
};

struct tcp_sock {
	__u32 write_seq;  /* end of what this socket's sends queued for TCP */
	__u32 copied_seq; /* end of what its reader has read from TCP */
	__u32 rcv_nxt;    /* end of what TCP has received */
	__u32 snd_una;    /* first byte the far end has not acknowledged */
	__u64 bytes_received; /* rcv_nxt's advance since the handshake */
	__u64 bytes_acked;    /* snd_una's advance since the SYN was sent */
	__u8 recvmsg_inq:1;   /* TCP_INQ: recvmsg tells the bytes left */
	__u8 nonagle:4;       /* TCP_NAGLE_OFF (TCP_NODELAY), TCP_NAGLE_CORK (TCP_CORK) */
	__u32 mss_cache;      /* the path's segment size */
};

struct tcp_ulp_ops;

/* A TCP socket's connection half: an upper layer protocol (an MPTCP
 * subflow's, kernel TLS) hangs off icsk_ulp_ops. */
struct inet_connection_sock {
	const struct tcp_ulp_ops *icsk_ulp_ops;
};

/* A connection request (a listener's request socket): the handshake's two
 * initial sequence numbers, both chosen before its TIMEOUT_INIT runs. */
struct tcp_request_sock {
	__u32 rcv_isn; /* the client's */
	__u32 snt_isn; /* the server's */
};

/* What a sockops program's context is in the kernel. */
struct bpf_sock_ops_kern {
	struct sock *sk;
};

/* One redirected message in a psock's ingress_msg; sg.size is what its
 * reader has not taken of it yet. */
struct sk_msg_sg {
	__u32 size;
};

struct sk_msg {
	struct sk_msg_sg sg;
	struct list_head list;
};

struct bpf_prog;

struct sk_psock_progs {
	struct bpf_prog *stream_verdict;
	struct bpf_prog *skb_verdict;
};

/* The psock hangs off sk_user_data: its receive queues, and whether an
 * sk_skb verdict takes the socket's TCP bytes (a join's, not bypass's). */
struct sk_psock {
	struct sk_psock_progs progs;
	struct list_head ingress_msg;
	struct sk_buff_head ingress_skb;
	__u32 msg_tot_len; /* bytes queued on ingress_msg */
};

/* TCP keeps its struct tcp_skb_cb in cb: seq, then end_seq. */
struct sk_buff {
	char cb[48];
	unsigned int truesize;
};

struct seq_file;

struct bpf_iter_meta {
	struct seq_file *seq;
	__u64 session_id;
	__u64 seq_num;
};

struct bpf_map;

struct mm_struct {
	unsigned long arg_start;
	unsigned long arg_end;
};

struct fdtable {
	unsigned int max_fds;
	struct file **fd;
};

struct files_struct {
	struct fdtable *fdt;
};

/* A file's wait queue holds an entry per waiter. epoll (fs/eventpoll.c)
 * hangs an eppoll_entry there per registration; its epitem names the
 * eventpoll (the epoll file's private_data) and the events registered.
 * poll and select (fs/select.c) hang a poll_table_entry per file polled,
 * with the events asked and the poll_wqueues (its task) as private. */
struct wait_queue_entry {
	void *private;
	struct list_head entry;
};

struct eventpoll;

struct epoll_event {
	__u32 events;
};

struct epitem {
	struct eventpoll *ep;
	struct epoll_event event;
};

struct eppoll_entry {
	struct epitem *base;
	struct wait_queue_entry wait;
};

struct poll_table_entry {
	__u32 key;
	struct wait_queue_entry wait;
};

struct poll_wqueues {
	struct task_struct *polling_task;
};

struct task_struct {
	unsigned int flags; /* PF_* */
	void *worker_private; /* an io_uring worker's struct io_worker */
	void *stack;
	struct mm_struct *mm;
	struct files_struct *files;
	unsigned int __state;
	int pid;
	int tgid;
	__u64 start_time; /* ns since boot: with pid, names one thread for good */
	struct task_struct *group_leader;
	char comm[16];
};

/* io_uring's worker threads (io-wq) and the request one runs. */
struct io_wq_work {
	int cancel_seq;
};

struct io_worker {
	struct io_wq_work *cur_work;
};

struct io_kiocb {
	__u8 opcode;
	struct io_wq_work work;
};

/* x86-64: the number of the system call a task is in, and its first
 * four arguments. */
struct pt_regs {
	unsigned long orig_ax;
	unsigned long di;
	unsigned long si;
	unsigned long dx;
	unsigned long r10;
};

/* Every open file of every task: how shunt reaches the sockets it holds
 * (map element iterators, iter/sockmap among them, are refused on some
 * kernels: EPERM before the verifier runs). */
struct bpf_iter__task_file {
	struct bpf_iter_meta *meta;
	struct task_struct *task;
	__u32 fd;
	struct file *file;
};

struct udp_sock;

struct bpf_iter__tcp {
	struct bpf_iter_meta *meta;
	struct sock_common *sk_common;
	__u32 uid;
};

struct bpf_iter__udp {
	struct bpf_iter_meta *meta;
	struct udp_sock *udp_sk;
	__u32 uid;
	int bucket;
};

#pragma clang attribute pop

/* include/net/sock.h; the value is relocated against the running kernel. */
enum sock_flags {
	SOCK_DONE = 1,
	SOCK_RCVTSTAMP = 11,
	SOCK_ZEROCOPY = 18,
};

/* include/net/tcp_states.h; a connected UDP socket is "ESTABLISHED" too. */
enum {
	TCP_ESTABLISHED = 1,
	TCP_SYN_SENT,
	TCP_SYN_RECV,
	TCP_FIN_WAIT1,
	TCP_FIN_WAIT2,
	TCP_TIME_WAIT,
	TCP_CLOSE,
	TCP_CLOSE_WAIT,
	TCP_LAST_ACK,
	TCP_LISTEN,
	TCP_CLOSING,
};

#define IPPROTO_TCP 6
#define IPPROTO_UDP 17
#define SOCK_DGRAM 2

/* Low bits of sk_user_data are flags (include/net/sock.h); a psock's
 * carries SK_USER_DATA_PSOCK (6.0). */
#define SK_USER_DATA_PTRMASK (~7UL)
#define SK_USER_DATA_PSOCK 4UL

/* ioctl(FIONREAD), also SIOCINQ (include/uapi/asm-generic/ioctls.h), and
 * a socket inode's mode (include/uapi/linux/stat.h). */
#define FIONREAD 0x541B
#define S_IFMT 00170000
#define S_IFSOCK 0140000

/* A file's O_NONBLOCK (include/uapi/asm-generic/fcntl.h), and the receive
 * timeout of a socket without SO_RCVTIMEO (MAX_SCHEDULE_TIMEOUT). */
#define O_NONBLOCK 04000
#define MAX_SCHEDULE_TIMEOUT 0x7fffffffffffffffL

/* A task asleep until woken (include/linux/sched.h): in epoll_wait, poll,
 * a futex. */
#define TASK_INTERRUPTIBLE 0x1

/* For bpf_timer_init (include/uapi/linux/time.h). */
#define CLOCK_MONOTONIC 1

/* sk_userlocks: the application set SO_SNDBUF, SO_RCVBUF (include/net/sock.h). */
#define SOCK_SNDBUF_LOCK 1
#define SOCK_RCVBUF_LOCK 2

/* A pointer the verifier lets BPF keep in a map without holding a reference:
 * reads through it are fault-safe but may see a socket that is going away. */
#define __kptr_untrusted __attribute__((btf_type_tag("kptr_untrusted")))
