package daemon

import (
	"encoding/json"
	"net"
	"time"
)

// SetReplyTimeout shortens how long a client waits for a reply, until
// restore.
func SetReplyTimeout(d time.Duration) (restore func()) {
	old := replyTimeout
	replyTimeout = d
	return func() { replyTimeout = old }
}

// TakeOverAndDie asks the daemon at path for a hand-over as a new daemon
// would, reads n of its messages (n < 0: the whole state, without saying
// ready) and hangs up, as a new daemon that crashed on the way would.
func TakeOverAndDie(path string, n int) error {
	c, err := net.DialUnix("unixpacket", nil, &net.UnixAddr{Name: path, Net: "unixpacket"})
	if err != nil {
		return err
	}
	defer c.Close()
	req, _ := json.Marshal(Request{Op: "handover", Version: handoverVersion()})
	if _, err := c.Write(req); err != nil {
		return err
	}
	h := newHandoverConn(c)
	if n < 0 {
		st, err := h.recvState()
		if err == nil {
			st.close()
		}
		return err
	}
	buf := make([]byte, maxMessage)
	for range n {
		_, oobn, flags, _, err := c.ReadMsgUnix(buf, h.oob)
		if err != nil {
			return err
		}
		fds, _ := receivedFDs(h.oob[:oobn], flags)
		closeFDs(fds)
	}
	return nil
}
