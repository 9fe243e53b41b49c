package kube

import (
	"context"
	"encoding/json"
	"fmt"

	apierrors "k8s.io/apimachinery/pkg/api/errors"
	"k8s.io/client-go/rest"
)

// OwnerGone says whether the workload the agent runs in was deleted (helm
// uninstall, kubectl delete) rather than rolled: its caller then takes
// shunt off the node, where a rollout keeps it for the next agent.
type OwnerGone func(ctx context.Context) (bool, error)

// DaemonSetGone checks the DaemonSet namespace/name through the API server
// of cfg. Gone: not found, being deleted, or no longer readable by the
// agent's service account (uninstall deletes the DaemonSet first and the
// RBAC objects and account right after, often before the agent's pod gets
// its SIGTERM). Any other error is returned: the caller keeps shunt, as
// for a rollout.
func DaemonSetGone(cfg *rest.Config, namespace, name string) (OwnerGone, error) {
	c, err := coreConfig(cfg)
	if err != nil {
		return nil, err
	}
	rc, err := rest.UnversionedRESTClientFor(c)
	if err != nil {
		return nil, fmt.Errorf("kubernetes: %w", err)
	}
	path := fmt.Sprintf("/apis/apps/v1/namespaces/%s/daemonsets/%s", namespace, name)
	return func(ctx context.Context) (bool, error) {
		b, err := rc.Get().AbsPath(path).DoRaw(ctx)
		switch {
		case apierrors.IsNotFound(err), apierrors.IsForbidden(err), apierrors.IsUnauthorized(err):
			return true, nil
		case err != nil:
			return false, err
		}
		// The metadata is all it needs: apps/v1's types stay unlinked.
		var ds struct {
			Metadata struct {
				DeletionTimestamp *string `json:"deletionTimestamp"`
			} `json:"metadata"`
		}
		if err := json.Unmarshal(b, &ds); err != nil {
			return false, fmt.Errorf("daemonset %s/%s: %w", namespace, name, err)
		}
		return ds.Metadata.DeletionTimestamp != nil, nil
	}, nil
}
