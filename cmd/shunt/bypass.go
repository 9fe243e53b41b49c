package main

import "github.com/spf13/cobra"

func newBypassCmd(e *env, g *globals) *cobra.Command {
	c := &cobra.Command{
		Use:   "bypass",
		Short: "Let host-local TCP connections skip the TCP/IP stack",
		Long: `bypass pairs the two sockets of every TCP connection made on this host
between sockets of enabled cgroups (over loopback, or between network
namespaces joined by veth) and moves each send straight into the peer's
receive queue. Connections with a peer elsewhere are left alone.`,
		Args: noArgs,
	}
	c.AddCommand(newBypassEnableCmd(e, g), newBypassDisableCmd(e, g), newBypassGuardCmd(e, g), newBypassForgetCmd(e, g))
	return c
}
