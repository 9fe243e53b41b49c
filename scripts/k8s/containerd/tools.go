//go:build tools

// Package containerd pins the container runtime scripts/k8s.sh builds for
// the kubelet of make test-k8s (a separate module: containerd's
// dependencies do not mix with Kubernetes').
package containerd

import (
	_ "github.com/containerd/containerd/v2/cmd/containerd"
	_ "github.com/containerd/containerd/v2/cmd/containerd-shim-runc-v2"
	_ "github.com/containerd/containerd/v2/cmd/ctr"
)
