package main

import (
	"context"
	"fmt"
	"net"

	"github.com/spf13/cobra"

	"github.com/shunt-project/shunt/host"
	"github.com/shunt-project/shunt/splice"
)

func newSpliceCmd(e *env) *cobra.Command {
	var (
		pid         int
		fds         []int
		maxInflight string
	)
	c := &cobra.Command{
		Use:   "splice --pid PID --fd A --fd B",
		Short: "Join two sockets of a running process in the kernel",
		Long: `splice takes two connected TCP sockets of a running process (pidfd_getfd)
and joins them in the kernel: from then on every byte arriving on one leaves
through the other, FIN and RST included, as 'shunt proxy --mode kernel' does.
The process keeps its descriptors but must stop reading and writing them (it
may close them). splice runs until both directions have ended and prints
what moved; interrupted, it resets both connections.

Two connected UDP sockets are joined the same way, each datagram whole; UDP
has no end, so splice runs until interrupted, then takes the pair out of the
kernel and prints what moved and what was dropped. Needs root.`,
		Example: `  shunt splice --pid 4242 --fd 7 --fd 9`,
		Args:    noArgs,
		RunE: func(c *cobra.Command, _ []string) error {
			if pid <= 0 || len(fds) != 2 {
				return usageError{fmt.Errorf("want --pid and exactly two --fd (see '%s --help')", c.CommandPath())}
			}
			if fds[0] == fds[1] {
				return usageError{fmt.Errorf("--fd %d twice: want two different sockets", fds[0])}
			}
			sizes, err := parseSizes("--max-inflight", maxInflight)
			if err != nil || len(sizes) != 1 || sizes[0] > 1<<30 {
				return usageError{fmt.Errorf("--max-inflight: want one size up to 1G, like 4M, got %q", maxInflight)}
			}
			if err := host.CheckPrivileges(); err != nil {
				return err
			}
			ca, err := splice.TakeSocket(pid, fds[0])
			if err != nil {
				return err
			}
			cb, err := splice.TakeSocket(pid, fds[1])
			if err != nil {
				ca.Close()
				return err
			}
			ua, aUDP := ca.(*net.UDPConn)
			ub, bUDP := cb.(*net.UDPConn)
			if aUDP != bUDP {
				ca.Close()
				cb.Close()
				return fmt.Errorf("fd %d and fd %d of process %d are one TCP and one UDP socket: a pair must be two of a kind", fds[0], fds[1], pid)
			}
			if aUDP {
				return spliceUDP(c.Context(), e, pid, fds, ua, ub, uint32(sizes[0]))
			}
			a, b := ca.(*net.TCPConn), cb.(*net.TCPConn)
			s, err := splice.New(splice.Options{MaxInflight: uint32(sizes[0]), MaxPairs: 1})
			if err != nil {
				a.Close()
				b.Close()
				return err
			}
			defer s.Close()
			pair, err := s.Join(a, b)
			if err != nil {
				a.Close()
				b.Close()
				return err
			}
			fmt.Fprintf(e.stderr, "splice: joined fd %d (%s <-> %s) and fd %d (%s <-> %s) of process %d\n",
				fds[0], a.LocalAddr(), a.RemoteAddr(), fds[1], b.LocalAddr(), b.RemoteAddr(), pid)
			select {
			case <-pair.Done():
			case <-c.Context().Done():
				pair.Abort()
				<-pair.Done()
			}
			ab, ba := pair.Stats()
			end := "both sides closed"
			if err := pair.Err(); err != nil {
				end = "ended by " + err.Error()
			}
			if c.Context().Err() != nil {
				end = "interrupted: both connections reset"
			}
			fmt.Fprintf(e.stderr, "splice: %s; %d bytes fd %d -> fd %d, %d bytes back, %d of them moved by the kernel\n",
				end, ab.Bytes, fds[0], fds[1], ba.Bytes, ab.Kernel+ba.Kernel)
			return nil
		},
	}
	c.Flags().IntVar(&pid, "pid", 0, "the process holding the sockets")
	c.Flags().IntSliceVar(&fds, "fd", nil, "a descriptor of that process; give two")
	c.Flags().StringVar(&maxInflight, "max-inflight", "4M", "TCP: bytes one direction may have unacknowledged in the outgoing socket before user space paces it; UDP: kernel memory the datagrams waiting to leave one socket may take before new ones are dropped")
	return c
}

// spliceUDP joins two UDP sockets until interrupted (UDP has no end).
func spliceUDP(ctx context.Context, e *env, pid int, fds []int, a, b *net.UDPConn, maxQueue uint32) error {
	s, err := splice.NewUDP(splice.UDPOptions{MaxQueue: maxQueue, MaxPairs: 1})
	if err != nil {
		a.Close()
		b.Close()
		return err
	}
	defer s.Close()
	pair, err := s.Join(a, b)
	if err != nil {
		a.Close()
		b.Close()
		return err
	}
	fmt.Fprintf(e.stderr, "splice: joined UDP fd %d (%s <-> %s) and fd %d (%s <-> %s) of process %d until interrupted\n",
		fds[0], a.LocalAddr(), a.RemoteAddr(), fds[1], b.LocalAddr(), b.RemoteAddr(), pid)
	<-ctx.Done()
	ab, ba := pair.Stats()
	pair.Close()
	fmt.Fprintf(e.stderr, "splice: interrupted; %d datagrams (%d bytes) fd %d -> fd %d, %d (%d bytes) back; dropped %d and %d\n",
		ab.Datagrams+ab.Copied, ab.Bytes, fds[0], fds[1], ba.Datagrams+ba.Copied, ba.Bytes, ab.Dropped, ba.Dropped)
	return nil
}
