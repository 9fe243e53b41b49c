// Command coredns is CoreDNS built with the kubernetes plugin (and errors)
// alone, as CoreDNS documents for builds of chosen plugins: the cluster DNS
// of make test-k8s, answering for Services and pods from the API server.
package main

import (
	"github.com/coredns/coredns/core/dnsserver"
	"github.com/coredns/coredns/coremain"
	_ "github.com/coredns/coredns/plugin/errors"
	_ "github.com/coredns/coredns/plugin/kubernetes"
)

func init() { dnsserver.Directives = []string{"errors", "kubernetes"} }

func main() { coremain.Run() }
