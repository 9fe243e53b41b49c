package daemon

import (
	"encoding/json"
	"net"
	"time"
)

// SetReplyTimeout shortens how long cl waits for a reply.
func SetReplyTimeout(cl *Client, d time.Duration) { cl.timeout = d }

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
