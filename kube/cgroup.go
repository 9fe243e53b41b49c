// Package kube finds the cgroups of this node's Kubernetes pods that the
// agent's configuration selects: pods are listed and watched through the
// API server (this node's only), and each pod's UID is mapped to the cgroup
// directory kubelet made for it, under either cgroup driver.
package kube

import (
	"errors"
	"fmt"
	"os"
	"path/filepath"
	"strings"

	corev1 "k8s.io/api/core/v1"
	"k8s.io/apimachinery/pkg/types"
)

// Driver is kubelet's cgroup driver, which decides how pod cgroups are named.
type Driver string

const (
	// Systemd: kubepods.slice/kubepods-burstable.slice/kubepods-burstable-pod<uid>.slice,
	// the uid's dashes written as underscores.
	Systemd Driver = "systemd"
	// Cgroupfs: kubepods/burstable/pod<uid>.
	Cgroupfs Driver = "cgroupfs"
)

// ErrNoKubepods means neither driver's top cgroup is under the root: no
// kubelet runs pods here (yet), or the root is not kubelet's.
var ErrNoKubepods = errors.New("no kubepods.slice or kubepods cgroup")

// DetectDriver tells the driver from the top cgroup kubelet made under root.
func DetectDriver(root string) (Driver, error) {
	for _, d := range []Driver{Systemd, Cgroupfs} {
		if fi, err := os.Stat(filepath.Join(root, top(d))); err == nil && fi.IsDir() {
			return d, nil
		}
	}
	return "", fmt.Errorf("%s: %w", root, ErrNoKubepods)
}

func top(d Driver) string {
	if d == Systemd {
		return "kubepods.slice"
	}
	return "kubepods"
}

// QOSDirs are the directories under root that hold pod cgroups, for the
// agent to watch: the top one (Guaranteed pods) and one per other class.
func QOSDirs(root string, d Driver) []string {
	base := filepath.Join(root, top(d))
	if d == Systemd {
		return []string{base, filepath.Join(base, "kubepods-burstable.slice"), filepath.Join(base, "kubepods-besteffort.slice")}
	}
	return []string{base, filepath.Join(base, "burstable"), filepath.Join(base, "besteffort")}
}

// PodCgroup is the directory kubelet makes for a pod of this QoS class.
// Guaranteed pods sit right under the top cgroup; the others under their
// class's.
func PodCgroup(root string, d Driver, qos corev1.PodQOSClass, uid types.UID) string {
	class := strings.ToLower(string(qos))
	if d == Systemd {
		id := strings.ReplaceAll(string(uid), "-", "_")
		if qos == corev1.PodQOSGuaranteed {
			return filepath.Join(root, "kubepods.slice", "kubepods-pod"+id+".slice")
		}
		return filepath.Join(root, "kubepods.slice", "kubepods-"+class+".slice", "kubepods-"+class+"-pod"+id+".slice")
	}
	if qos == corev1.PodQOSGuaranteed {
		return filepath.Join(root, "kubepods", "pod"+string(uid))
	}
	return filepath.Join(root, "kubepods", class, "pod"+string(uid))
}
