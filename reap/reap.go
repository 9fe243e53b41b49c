// Package reap destroys every socket on the host connected to a backend, in
// any network namespace: from the socket index (exact SOCK_DESTROY requests,
// cost grows with the sockets destroyed) or, without an index, by running a
// socket iterator in every namespace (cost grows with every socket).
package reap

import (
	"context"
	"errors"
	"fmt"
	"net/netip"
	"os"
	"sort"
	"time"

	"github.com/shunt-project/shunt/host"
	"github.com/shunt-project/shunt/sockindex"
)

// Method is how sockets are found.
type Method string

const (
	Auto  Method = ""      // the index if enabled, else iterators
	Index Method = "index" // the socket index; fails if not enabled
	Iter  Method = "iter"  // iter/tcp and iter/udp in every namespace
)

// Target names a backend: an address, a port (0: any) and protocols.
type Target struct {
	Addr   netip.Addr
	Port   uint16
	Protos []sockindex.Proto
}

func (t Target) String() string {
	if t.Port == 0 {
		return t.Addr.String()
	}
	return netip.AddrPortFrom(t.Addr, t.Port).String()
}

// Options shape a reap.
type Options struct {
	IndexDir string // default sockindex.DefaultPinDir
	Method   Method
	DryRun   bool // find and report, destroy nothing
	// Mechanisms: the zero value uses the kernel's newest; tests set it
	// to run an older kernel's ways on this one (DiagDestroy: the
	// iterators find, user space destroys through sock_diag).
	Mechanisms host.Mechanisms
}

// Socket is a socket reap found connected to the target.
type Socket struct {
	Proto       string `json:"proto"`
	Local       string `json:"local"`
	Remote      string `json:"remote"`
	Cookie      uint64 `json:"cookie"`
	NetnsCookie uint64 `json:"netns_cookie"`
	Owner       int    `json:"owner_pid,omitempty"`
	Destroyed   bool   `json:"destroyed"`
	Error       string `json:"error,omitempty"`
}

// Result says what a reap did and how long each part took.
type Result struct {
	Target   string `json:"target"`
	Method   Method `json:"method"`
	Fallback string `json:"fallback,omitempty"` // why the iterators ran
	// DestroyBy: how sockets are destroyed: "sock_diag" (SOCK_DESTROY in
	// their namespace), or "kfunc" (bpf_sock_destroy in the iterators,
	// 6.5+). Empty in a dry run.
	DestroyBy string   `json:"destroy_by,omitempty"`
	DryRun    bool     `json:"dry_run"`
	Sockets   []Socket `json:"sockets"`
	Gone      int      `json:"gone"` // indexed but closed or reconnected by the time of the reap
	// NotIndexed counts sockets the index could not take since it was
	// enabled (a map was full): a reap by index may miss some of them.
	NotIndexed uint64        `json:"not_indexed,omitempty"`
	Namespaces int           `json:"namespaces"`
	Took       time.Duration `json:"took_ns"`
	Lookup     time.Duration `json:"lookup_ns"`  // finding the sockets
	Resolve    time.Duration `json:"resolve_ns"` // reaching their namespaces
	Destroy    time.Duration `json:"destroy_ns"` // checking and destroying them
}

// Destroyed counts the sockets destroyed.
func (r *Result) Destroyed() int {
	n := 0
	for _, s := range r.Sockets {
		if s.Destroyed {
			n++
		}
	}
	return n
}

// Reap destroys every socket connected to the target.
func Reap(ctx context.Context, t Target, opts Options) (*Result, error) {
	if len(t.Protos) == 0 {
		t.Protos = []sockindex.Proto{sockindex.TCP, sockindex.UDP}
	}
	if opts.IndexDir == "" {
		opts.IndexDir = sockindex.DefaultPinDir
	}
	res := &Result{Target: t.String(), DryRun: opts.DryRun, Sockets: []Socket{}}
	start := time.Now()
	defer func() { res.Took = time.Since(start) }()

	switch opts.Method {
	case Iter:
		res.Method = Iter
		return res, reapIter(ctx, t, opts, res)
	case Index, Auto:
		ix, err := sockindex.Open(opts.IndexDir)
		if errors.Is(err, sockindex.ErrNotEnabled) && opts.Method == Auto {
			res.Method = Iter
			res.Fallback = "the socket index is not enabled"
			return res, reapIter(ctx, t, opts, res)
		}
		if err != nil {
			return nil, err
		}
		defer ix.Close()
		rp := NewReaper(ix)
		defer rp.Close()
		res.Method = Index
		err = rp.reap(ctx, t, opts, res)
		rp.noteFull(res)
		return res, err
	}
	return nil, fmt.Errorf("unknown method %q", opts.Method)
}

// Reaper reaps through an index the caller holds open, as a control plane
// that reaps often would. It keeps one sock_diag socket per namespace it has
// reached, so later reaps in the same namespaces skip entering them.
type Reaper struct {
	ix    *sockindex.Index
	conns map[uint64]*diagConn
	used  map[uint64]uint64 // reap number that last used each socket
	reaps uint64
	scan  *netnsScan
}

// idleReaps is how many reaps a namespace's socket is kept without use: the
// socket holds its namespace alive, and a namespace whose sockets are gone
// is not reaped in again.
const idleReaps = 16

// NewReaper returns a Reaper over ix. Close it to release its sockets.
func NewReaper(ix *sockindex.Index) *Reaper {
	return &Reaper{ix: ix, conns: map[uint64]*diagConn{}, used: map[uint64]uint64{}}
}

// Close releases the per-namespace sockets (and so the namespaces).
func (rp *Reaper) Close() error {
	for c := range rp.conns {
		rp.forget(c)
	}
	return nil
}

func (rp *Reaper) forget(cookie uint64) {
	if d, ok := rp.conns[cookie]; ok {
		d.Close()
	}
	delete(rp.conns, cookie)
	delete(rp.used, cookie)
}

// Reap destroys every indexed socket connected to the target.
func (rp *Reaper) Reap(ctx context.Context, t Target, opts Options) (*Result, error) {
	if len(t.Protos) == 0 {
		t.Protos = []sockindex.Proto{sockindex.TCP, sockindex.UDP}
	}
	res := &Result{Target: t.String(), Method: Index, DryRun: opts.DryRun, Sockets: []Socket{}}
	start := time.Now()
	err := rp.reap(ctx, t, opts, res)
	res.Took = time.Since(start)
	rp.noteFull(res)
	rp.reaps++
	for c, last := range rp.used {
		if rp.reaps-last > idleReaps {
			rp.forget(c)
		}
	}
	return res, err
}

// noteFull reports sockets the index could not take; read after the clock
// stopped, as it does not hold up the destroys.
func (rp *Reaper) noteFull(res *Result) {
	if c, err := rp.ix.Counters(); err == nil {
		res.NotIndexed = c.Full
	}
}

func (rp *Reaper) reap(ctx context.Context, t Target, opts Options, res *Result) error {
	if !opts.DryRun {
		res.DestroyBy = "sock_diag"
	}
	t0 := time.Now()
	found, err := rp.ix.Find(t.Addr, t.Port, t.Protos...)
	if err != nil {
		return err
	}
	res.Lookup = time.Since(t0)

	byNetns := map[uint64][]sockindex.Socket{}
	for _, s := range found {
		byNetns[s.NetnsCookie] = append(byNetns[s.NetnsCookie], s)
	}
	cookies := make([]uint64, 0, len(byNetns))
	for c := range byNetns {
		cookies = append(cookies, c)
	}
	sort.Slice(cookies, func(i, j int) bool { return cookies[i] < cookies[j] })

	for _, c := range cookies {
		if err := ctx.Err(); err != nil {
			return err
		}
		socks := byNetns[c]
		t1 := time.Now()
		d, err := rp.conn(c, socks)
		res.Resolve += time.Since(t1)
		if err != nil {
			// The namespace is gone, and its sockets with it.
			res.Gone += len(socks)
			continue
		}
		res.Namespaces++
		t2 := time.Now()
		err = destroyIn(d, socks, opts.DryRun, res)
		res.Destroy += time.Since(t2)
		if err != nil {
			// Perhaps the namespace died under the socket: reach it
			// afresh next time.
			rp.forget(c)
			return err
		}
	}
	return nil
}

func (rp *Reaper) conn(cookie uint64, socks []sockindex.Socket) (*diagConn, error) {
	rp.used[cookie] = rp.reaps
	if d, ok := rp.conns[cookie]; ok {
		return d, nil
	}
	d, err := reach(rp.ix, cookie, socks, &rp.scan)
	if err != nil {
		delete(rp.used, cookie)
		return nil, err
	}
	rp.conns[cookie] = d
	return d, nil
}

// destroyIn checks each socket by exact tuple and cookie, then destroys
// those still connected to the target, one batch per protocol.
func destroyIn(d *diagConn, socks []sockindex.Socket, dryRun bool, res *Result) error {
	for _, proto := range []sockindex.Proto{sockindex.TCP, sockindex.UDP} {
		var ids []diagID
		var which []sockindex.Socket
		for _, s := range socks {
			if s.Proto != proto {
				continue
			}
			if !s.LocalKnown {
				if err := learnLocal(d, &s); err != nil {
					res.Gone++
					continue
				}
			}
			ids = append(ids, idOf(s))
			which = append(which, s)
		}
		// A destroy names tuple and cookie, and the socket with that
		// cookie still holding that tuple is connected to the target, with
		// one exception: a UDP socket that disconnected keeps matching if it
		// keeps its port. Only those are checked first (and all in a dry
		// run, which reports only what exists).
		got := make([]reply, len(ids))
		var check []int
		for i := range got {
			got[i].id.remote = which[i].Remote
			if dryRun || which[i].KeepsPort {
				check = append(check, i)
			}
		}
		if len(check) > 0 {
			checkIDs := make([]diagID, len(check))
			for j, i := range check {
				checkIDs[j] = ids[i]
			}
			replies, err := d.get(proto, checkIDs)
			if err != nil {
				return err
			}
			for j, i := range check {
				got[i] = replies[j]
			}
		}
		var live []diagID
		var liveSocks []sockindex.Socket
		for i, r := range got {
			// Gone, or (UDP) disconnected or reconnected elsewhere since.
			if r.err != nil || r.id.remote != which[i].Remote {
				res.Gone++
				continue
			}
			live = append(live, ids[i])
			liveSocks = append(liveSocks, which[i])
		}
		if dryRun {
			for _, s := range liveSocks {
				res.Sockets = append(res.Sockets, socketOf(s, false, nil))
			}
			continue
		}
		done, err := d.destroy(proto, live)
		if err != nil {
			return err
		}
		for i, r := range done {
			if errors.Is(r.err, os.ErrNotExist) {
				res.Gone++ // closed between the check and the destroy
				continue
			}
			res.Sockets = append(res.Sockets, socketOf(liveSocks[i], r.err == nil, r.err))
		}
	}
	return nil
}

// learnLocal finds the local address of a connected UDP socket that has not
// sent yet by listing its namespace's UDP sockets.
func learnLocal(d *diagConn, s *sockindex.Socket) error {
	all, err := d.dump(sockindex.UDP, s.Family)
	if err != nil {
		return err
	}
	for _, id := range all {
		if id.cookie == s.Cookie {
			s.Local = id.local
			s.LocalKnown = true
			return nil
		}
	}
	return os.ErrNotExist
}

func socketOf(s sockindex.Socket, destroyed bool, err error) Socket {
	out := Socket{
		Proto:       s.Proto.String(),
		Local:       s.Local.String(),
		Remote:      s.Remote.String(),
		Cookie:      s.Cookie,
		NetnsCookie: s.NetnsCookie,
		Owner:       s.Owner,
		Destroyed:   destroyed,
	}
	if err != nil {
		out.Error = err.Error()
	}
	return out
}
