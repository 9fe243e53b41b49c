// Command pause holds a pod's namespaces for the kubelet of make test-k8s
// (the sandbox image kubelet would pull): it waits for the end.
package main

import (
	"os"
	"os/signal"
	"syscall"
)

func main() {
	c := make(chan os.Signal, 1)
	signal.Notify(c, syscall.SIGINT, syscall.SIGTERM)
	<-c
}
