package fanout

import (
	"encoding/json"
	"fmt"
	"net"
	"os"
	"path/filepath"
	"sort"
	"time"

	"golang.org/x/sys/unix"

	"github.com/shunt-project/shunt/internal/runlock"
)

// SubscriberStats is one subscriber as `shunt fanout stats` shows it.
type SubscriberStats struct {
	Peer      string    `json:"peer"`
	Since     time.Time `json:"connected_since"`
	Messages  uint64    `json:"messages_delivered"` // written whole to its socket
	Bytes     uint64    `json:"bytes_delivered"`    // of its stream, framing included
	Dropped   uint64    `json:"messages_dropped"`   // lost to a full queue
	Queued    int       `json:"bytes_queued"`       // waiting in the forwarder now
	HalfClose bool      `json:"half_closed"`        // it shut down its sending side
}

// Stats is a snapshot of a running forwarder.
type Stats struct {
	Source      string            `json:"source"`
	Listen      string            `json:"listen"`
	Framing     string            `json:"framing"`
	Slow        string            `json:"slow"`
	Queue       int               `json:"queue_bytes"`
	Totals      Totals            `json:"totals"`
	Subscribers []SubscriberStats `json:"subscribers"`
}

// Stats takes a snapshot. Only the event loop's goroutine may call it while
// Run is running (the control socket does); others call Query.
func (f *Forwarder) Stats() Stats {
	st := Stats{
		Source: "udp://" + f.SourceAddr().String(), Listen: "tcp://" + f.ListenAddr().String(),
		Framing: f.cfg.Framing.String(), Slow: f.cfg.Slow.String(), Queue: f.cfg.Queue,
		Totals: f.totals, Subscribers: []SubscriberStats{},
	}
	st.Totals.Subscribers = len(f.subs)
	for _, s := range f.subs {
		msgs, bytes, dropped, queued := s.msgs, s.bytes, s.dropped, s.queued()
		if f.kern != nil {
			c := f.kern.counts(s)
			msgs, bytes, dropped, queued = c.msgs, c.bytes, c.dropped, c.queued
		}
		st.Subscribers = append(st.Subscribers, SubscriberStats{
			Peer: s.peer.String(), Since: s.since, Messages: msgs, Bytes: bytes,
			Dropped: dropped, Queued: queued, HalfClose: s.eof,
		})
	}
	sort.Slice(st.Subscribers, func(i, j int) bool { return st.Subscribers[i].Since.Before(st.Subscribers[j].Since) })
	return st
}

// listenControl opens the stats socket, readable by root only.
func listenControl(path string) (int, error) {
	if c, err := net.Dial("unix", path); err == nil {
		c.Close()
		return -1, fmt.Errorf("control socket %s: another forwarder is running there (give --control another path)", path)
	}
	fd, err := unix.Socket(unix.AF_UNIX, unix.SOCK_STREAM|unix.SOCK_NONBLOCK|unix.SOCK_CLOEXEC, 0)
	if err != nil {
		return -1, err
	}
	err = runlock.InDir(filepath.Dir(path), 0o700, func() error {
		os.Remove(path) // left by a forwarder that died
		old := unix.Umask(0o077)
		defer unix.Umask(old)
		return unix.Bind(fd, &unix.SockaddrUnix{Name: path})
	})
	if err == nil {
		err = unix.Listen(fd, 16)
	}
	if err != nil {
		unix.Close(fd)
		return -1, fmt.Errorf("control socket %s: %w", path, err)
	}
	return fd, nil
}

// serveControl answers each waiting client with one JSON snapshot. The
// snapshot is taken in the loop (a copy); writing it, which can take as long
// as the client takes to read, happens beside the loop, so a stats reader
// never holds up delivery. A client that does not read for 5 s is cut off.
func (f *Forwarder) serveControl() {
	for {
		fd, _, err := unix.Accept4(f.ctl, unix.SOCK_CLOEXEC)
		if err != nil {
			return
		}
		st := f.Stats()
		go func() {
			defer unix.Close(fd)
			b, _ := json.Marshal(st)
			tv := unix.NsecToTimeval(int64(5 * time.Second))
			_ = unix.SetsockoptTimeval(fd, unix.SOL_SOCKET, unix.SO_SNDTIMEO, &tv)
			for len(b) > 0 {
				n, err := unix.Write(fd, b)
				if err != nil {
					return
				}
				b = b[n:]
			}
		}()
	}
}

// Query reads a snapshot from the forwarder whose control socket is path.
func Query(path string) (Stats, error) {
	var st Stats
	c, err := net.DialTimeout("unix", path, 2*time.Second)
	if err != nil {
		return st, fmt.Errorf("no forwarder answers at %s: %w", path, err)
	}
	defer c.Close()
	c.SetDeadline(time.Now().Add(5 * time.Second))
	if err := json.NewDecoder(c).Decode(&st); err != nil {
		return st, fmt.Errorf("read stats from %s: %w", path, err)
	}
	return st, nil
}
