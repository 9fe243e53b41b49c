#!/usr/bin/env bash
# A one-node Kubernetes control plane for shunt's tests (make test-k8s).
#
#   scripts/k8s.sh setup   build etcd, kube-apiserver, kube-controller-manager,
#                          kube-scheduler, kube-proxy and kubelet (scripts/k8s/build),
#                          containerd (scripts/k8s/containerd), CoreDNS (scripts/k8s/dns)
#                          and the images' programs (scripts/k8s/image) from their
#                          Go modules, once per
#                          version: ~13 min the first time
#   scripts/k8s.sh test    setup, make build, then go test -tags k8snode ./k8snode
#   scripts/k8s.sh bench   setup, make build, then the agent's benchmarks on that node,
#                          without and with kubelet (enable latency over 50 pods,
#                          memory and scrape with 200)
#   scripts/k8s.sh clean   remove the built programs
#
# No release download or image registry is reachable from here, so the
# programs are built; the cache is $SHUNT_K8S_CACHE (/var/cache/shunt-k8s).
set -euo pipefail

here=$(cd "$(dirname "$0")" && pwd)
repo=$(cd "$here/.." && pwd)
cache=${SHUNT_K8S_CACHE:-/var/cache/shunt-k8s}
version=v1.34.3 # k8s.io/kubernetes in scripts/k8s/build/go.mod
bins="$cache/$version/bin"

die() { echo "k8s: $*" >&2; exit 1; }

setup() {
  command -v go >/dev/null || die "go is not installed"
  # kube-proxy's modes run nft and iptables-nft (iptables: Debian's default).
  # kubelet's containers run under Debian's runc (built with seccomp) on the
  # CNI plugins' bridge.
  for c in nft iptables curl nginx runc /usr/lib/cni/bridge; do
    command -v "$c" >/dev/null || die "$c missing: run make deps"
  done
  local stamp
  stamp=$(cat "$here"/k8s/*/go.mod "$here"/k8s/*/go.sum "$here"/k8s/image/*.go "$here"/k8s/image/*/*.go "$here"/k8s/dns/*.go | sha256sum | cut -c1-16)
  if [ -f "$bins/.stamp" ] && [ "$(cat "$bins/.stamp")" = "$stamp" ]; then
    return
  fi
  rm -rf "$bins.tmp" && mkdir -p "$bins.tmp"
  local minor=${version#v1.}; minor=${minor%%.*}
  local v=k8s.io/component-base/version
  # Version skew checks read what the programs say they are.
  local ld="-s -w -X $v.gitVersion=$version -X $v.gitMajor=1 -X $v.gitMinor=$minor -X $v.gitTreeState=clean"
  for c in kube-apiserver kube-controller-manager kube-scheduler kube-proxy kubelet; do
    echo "k8s: building $c $version"
    (cd "$here/k8s/build" && CGO_ENABLED=0 go build -trimpath -ldflags "$ld" -o "$bins.tmp/$c" "k8s.io/kubernetes/cmd/$c")
  done
  echo "k8s: building etcd"
  (cd "$here/k8s/build" && go build -trimpath -ldflags "-s -w" -o "$bins.tmp/etcd" go.etcd.io/etcd/server/v3)
  # Debian's containerd (1.6) is older than any Kubernetes 1.34 supports.
  for c in containerd containerd-shim-runc-v2 ctr; do
    echo "k8s: building $c"
    (cd "$here/k8s/containerd" && CGO_ENABLED=0 go build -trimpath -tags "no_btrfs no_devmapper no_zfs" -ldflags "-s -w" -o "$bins.tmp/$c" "github.com/containerd/containerd/v2/cmd/$c")
  done
  echo "k8s: building coredns (the kubernetes plugin alone)"
  (cd "$here/k8s/dns" && CGO_ENABLED=0 go build -trimpath -ldflags "-s -w" -o "$bins.tmp/coredns" .)
  echo "k8s: building the images' programs"
  (cd "$here/k8s/image" && CGO_ENABLED=0 go build -trimpath -o "$bins.tmp/mkimage" . &&
    CGO_ENABLED=0 go build -trimpath -o "$bins.tmp/pause" ./pause && CGO_ENABLED=0 go build -trimpath -o "$bins.tmp/web" ./web)
  echo "$stamp" > "$bins.tmp/.stamp"
  rm -rf "$bins" && mv "$bins.tmp" "$bins"
}

case ${1:-} in
setup) setup ;;
test)
  setup
  make -C "$repo" build
  cd "$repo" && go test -tags k8snode -count=1 -timeout 20m -v ./k8snode -args -k8s.bin "$bins" -shunt "$repo/bin/shunt"
  ;;
bench)
  setup
  make -C "$repo" build
  cd "$repo" && go test -tags k8snode -count=1 -timeout 20m -run '^$' -bench BenchmarkAgent -benchtime 1x ./k8snode -args -k8s.bin "$bins" -shunt "$repo/bin/shunt"
  ;;
clean) rm -rf "$cache" ;;
*) awk 'NR > 1 && /^#/ { sub(/^# ?/, ""); print; next } NR > 1 { exit }' "$0"; exit 2 ;;
esac
