package bench

import (
	"context"
	"fmt"
	"io"
	"net/netip"
	"os"
	"sort"
	"strings"
	"time"

	"golang.org/x/sys/unix"

	"github.com/shunt-project/shunt/host"
	"github.com/shunt-project/shunt/internal/lab"
	"github.com/shunt-project/shunt/reap"
	"github.com/shunt-project/shunt/sockindex"
)

// ReapConfig is the RFC "bpf: Efficient socket destruction" table: sockets
// spread over namespaces, destroy a few, by the index and by iterators.
type ReapConfig struct {
	Sizes   []int // total sockets on the host (background + victims)
	Netns   int   // namespaces the sockets are spread over
	Victims int   // sockets connected to the reaped backend
	// VictimNetns is how many namespaces the victims are spread over (one
	// request batch per namespace); 0 means one victim per namespace.
	VictimNetns int
	Protos      []string // "udp", "tcp"
	Rounds      int
}

// ReapResult is one method at one size: medians over rounds.
type ReapResult struct {
	Proto     string        `json:"proto"`
	Sockets   int           `json:"sockets"`
	Method    string        `json:"method"`
	Destroyed int           `json:"destroyed"`
	Took      time.Duration `json:"took_ns"`
	Min       time.Duration `json:"min_ns"`
	Max       time.Duration `json:"max_ns"`
	Lookup    time.Duration `json:"lookup_ns"`
	Resolve   time.Duration `json:"resolve_ns"`
	Destroy   time.Duration `json:"destroy_ns"`
	Rounds    int           `json:"rounds"`
	Missed    int           `json:"missed"` // victims left alive, summed over rounds
	Failed    []string      `json:"failed,omitempty"`
}

const (
	reapBackendPort = 9999  // the backend that goes away
	reapOtherPorts  = 10000 // background sockets use 10000..10099
)

// RunReap builds the sockets size by size (each size adds to the last) and
// at each size times both methods, interleaved, for every round.
func RunReap(ctx context.Context, cfg ReapConfig, progress io.Writer) ([]ReapResult, error) {
	maxN := 0
	for _, n := range cfg.Sizes {
		maxN = max(maxN, n)
	}
	cg, rmCgroup, err := lab.NewCgroup(lab.Name("shunt-test-reap-"))
	if err != nil {
		return nil, err
	}
	defer func() { _ = rmCgroup() }()
	pinDir := "/sys/fs/bpf/" + lab.Name("shunt-test-reap-")
	if err := host.EnsureBPFFS(pinDir); err != nil {
		return nil, err
	}
	ix, _, err := sockindex.Create(pinDir, cg)
	if err != nil {
		return nil, err
	}
	defer func() { _ = ix.Remove() }()

	var nss []*lab.NetNS
	defer func() {
		for _, ns := range nss {
			ns.Close()
		}
	}()
	for i := 0; i < cfg.Netns; i++ {
		ns, err := lab.NewNetNS(lab.Name("shunt-test-reap-"))
		if err != nil {
			return nil, err
		}
		nss = append(nss, ns)
	}

	var out []ReapResult
	for _, proto := range cfg.Protos {
		w := &reapWorld{proto: proto, nss: nss, cg: cg}
		if err := w.servers(); err != nil {
			w.close()
			return nil, err
		}
		for _, n := range cfg.Sizes {
			fmt.Fprintf(progress, "reap %s: %d sockets over %d namespaces...\n", proto, n, len(nss))
			if err := w.grow(n - cfg.Victims); err != nil {
				w.close()
				return nil, err
			}
			res, err := w.measure(ctx, ix, n, cfg)
			if err != nil {
				w.close()
				return nil, err
			}
			out = append(out, res...)
		}
		w.close()
	}
	return out, nil
}

// reapWorld holds the sockets of one protocol.
type reapWorld struct {
	proto     string
	nss       []*lab.NetNS
	cg        host.Cgroup
	count     int       // background client sockets
	holders   []*holder // the processes holding them
	serverFDs []int
}

func (w *reapWorld) sockType() int {
	if w.proto == "tcp" {
		return unix.SOCK_STREAM
	}
	return unix.SOCK_DGRAM
}

// servers opens, in every namespace, the backend and one other server.
func (w *reapWorld) servers() error {
	for _, ns := range w.nss {
		err := ns.Do(func() error {
			if w.proto == "tcp" {
				// Clients wait in the accept queue: no accepted fds needed.
				if err := os.WriteFile("/proc/sys/net/core/somaxconn", []byte("65535"), 0); err != nil {
					return err
				}
			}
			for _, port := range []int{reapBackendPort, reapOtherPorts} {
				fd, err := unix.Socket(unix.AF_INET, w.sockType()|unix.SOCK_CLOEXEC, 0)
				if err != nil {
					return err
				}
				w.serverFDs = append(w.serverFDs, fd)
				if err := unix.Bind(fd, &unix.SockaddrInet4{Port: port, Addr: [4]byte{127, 0, 0, 1}}); err != nil {
					return err
				}
				if w.proto == "tcp" {
					if err := unix.Listen(fd, 65535); err != nil {
						return err
					}
				}
			}
			return nil
		})
		if err != nil {
			return fmt.Errorf("reap bench servers: %w", err)
		}
	}
	return nil
}

// dial makes count sockets in namespace ns connected to 127.0.0.1:port.
func (w *reapWorld) dial(ns *lab.NetNS, port, count int, send bool) ([]int, error) {
	var fds []int
	err := lab.InCgroup(w.cg, func() error {
		return ns.Do(func() error {
			for i := 0; i < count; i++ {
				fd, err := unix.Socket(unix.AF_INET, w.sockType()|unix.SOCK_CLOEXEC, 0)
				if err != nil {
					return err
				}
				fds = append(fds, fd)
				if err := unix.Connect(fd, &unix.SockaddrInet4{Port: port, Addr: [4]byte{127, 0, 0, 1}}); err != nil {
					return fmt.Errorf("connect: %w", err)
				}
				if send && w.proto == "udp" {
					// The first send tells the index the local port.
					_, _ = unix.Write(fd, []byte("x"))
				}
			}
			return nil
		})
	})
	if err != nil {
		closeAll(fds)
		return nil, err
	}
	return fds, nil
}

// grow adds background sockets until there are n, spread evenly over the
// namespaces, in helper processes of up to holderChunk sockets each.
func (w *reapWorld) grow(n int) error {
	for w.count < n {
		chunk := min(n-w.count, holderChunk)
		var parts []string
		for i, ns := range w.nss {
			c := chunk / len(w.nss)
			if i < chunk%len(w.nss) {
				c++
			}
			if c > 0 {
				parts = append(parts, fmt.Sprintf("/run/netns/%s=%d", ns.Name, c))
			}
		}
		spec := fmt.Sprintf("%s;%d;%s;%s", w.proto, reapOtherPorts, w.cg.Path, strings.Join(parts, ","))
		h, err := startHolder(spec)
		if err != nil {
			return fmt.Errorf("reap bench: %d sockets: %w", n, err)
		}
		w.holders = append(w.holders, h)
		w.count += chunk
	}
	return nil
}

func (w *reapWorld) close() {
	for _, h := range w.holders {
		h.stop()
	}
	closeAll(w.serverFDs)
	w.holders, w.serverFDs, w.count = nil, nil, 0
}

func closeAll(fds []int) {
	for _, fd := range fds {
		unix.Close(fd)
	}
}

func (w *reapWorld) measure(ctx context.Context, ix *sockindex.Index, n int, cfg ReapConfig) ([]ReapResult, error) {
	proto := sockindex.TCP
	if w.proto == "udp" {
		proto = sockindex.UDP
	}
	target := reap.Target{Addr: netip.MustParseAddr("127.0.0.1"), Port: reapBackendPort, Protos: []sockindex.Proto{proto}}
	spread := len(w.nss)
	if cfg.VictimNetns > 0 {
		spread = min(spread, cfg.VictimNetns)
	}
	rp := reap.NewReaper(ix)
	defer rp.Close()
	samples := map[reap.Method][]*reap.Result{}
	failed := map[reap.Method][]string{}
	for round := 0; round < cfg.Rounds; round++ {
		for _, m := range []reap.Method{reap.Index, reap.Iter} {
			var victims []int
			for i := 0; i < cfg.Victims; i++ {
				fds, err := w.dial(w.nss[i%spread], reapBackendPort, 1, true)
				if err != nil {
					closeAll(victims)
					return nil, err
				}
				victims = append(victims, fds...)
			}
			var res *reap.Result
			var err error
			if m == reap.Index {
				res, err = rp.Reap(ctx, target, reap.Options{})
			} else {
				res, err = reap.Reap(ctx, target, reap.Options{Method: reap.Iter})
			}
			closeAll(victims)
			if err != nil {
				// A method that fails is reported, not fatal: the
				// other still gets measured.
				failed[m] = append(failed[m], err.Error())
				continue
			}
			samples[m] = append(samples[m], res)
		}
	}
	var out []ReapResult
	for _, m := range []reap.Method{reap.Index, reap.Iter} {
		r := summarizeReap(w.proto, n, string(m), cfg.Victims, samples[m])
		r.Failed = failed[m]
		out = append(out, r)
	}
	return out, nil
}

func summarizeReap(proto string, n int, method string, victims int, rs []*reap.Result) ReapResult {
	if len(rs) == 0 {
		return ReapResult{Proto: proto, Sockets: n, Method: method}
	}
	med := func(f func(*reap.Result) time.Duration) time.Duration {
		v := make([]time.Duration, len(rs))
		for i, r := range rs {
			v[i] = f(r)
		}
		sort.Slice(v, func(i, j int) bool { return v[i] < v[j] })
		return v[len(v)/2]
	}
	took := func(r *reap.Result) time.Duration { return r.Took }
	res := ReapResult{
		Proto: proto, Sockets: n, Method: method, Rounds: len(rs), Destroyed: rs[0].Destroyed(),
		Took:    med(took),
		Lookup:  med(func(r *reap.Result) time.Duration { return r.Lookup }),
		Resolve: med(func(r *reap.Result) time.Duration { return r.Resolve }),
		Destroy: med(func(r *reap.Result) time.Duration { return r.Destroy }),
		Min:     rs[0].Took, Max: rs[0].Took,
	}
	for _, r := range rs {
		res.Min, res.Max = min(res.Min, r.Took), max(res.Max, r.Took)
		res.Destroyed = min(res.Destroyed, r.Destroyed())
		res.Missed += victims - r.Destroyed()
	}
	return res
}
