package proxy

import (
	"encoding/binary"
	"fmt"
	"net/netip"
)

// proxyHeader is the PROXY protocol header announcing a connection from
// client to server (the address the client reached us on).
func proxyHeader(v ProxyProtocol, client, server netip.AddrPort) []byte {
	client = netip.AddrPortFrom(client.Addr().Unmap(), client.Port())
	server = netip.AddrPortFrom(server.Addr().Unmap(), server.Port())
	v4 := client.Addr().Is4() && server.Addr().Is4()
	switch v {
	case ProxyV1:
		fam := "TCP6"
		if v4 {
			fam = "TCP4"
		}
		return fmt.Appendf(nil, "PROXY %s %s %s %d %d\r\n", fam, client.Addr(), server.Addr(), client.Port(), server.Port())
	case ProxyV2:
		h := []byte("\r\n\r\n\x00\r\nQUIT\n")
		h = append(h, 0x21) // version 2, PROXY command
		var addrs []byte
		if v4 {
			h = append(h, 0x11) // TCP over IPv4
			c, s := client.Addr().As4(), server.Addr().As4()
			addrs = append(append(addrs, c[:]...), s[:]...)
		} else {
			h = append(h, 0x21) // TCP over IPv6
			c, s := client.Addr().As16(), server.Addr().As16()
			addrs = append(append(addrs, c[:]...), s[:]...)
		}
		addrs = binary.BigEndian.AppendUint16(addrs, client.Port())
		addrs = binary.BigEndian.AppendUint16(addrs, server.Port())
		h = binary.BigEndian.AppendUint16(h, uint16(len(addrs)))
		return append(h, addrs...)
	}
	return nil
}
