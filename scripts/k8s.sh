#!/usr/bin/env bash
# A one-node Kubernetes control plane for shunt's tests (make test-k8s).
#
#   scripts/k8s.sh setup   build etcd, kube-apiserver, kube-controller-manager
#                          and kube-proxy from their Go modules (scripts/k8s/build),
#                          once per version: ~5 min the first time
#   scripts/k8s.sh test    setup, make build, then go test -tags k8snode ./k8snode
#   scripts/k8s.sh bench   setup, make build, then the agent's benchmark on that node
#                          (enable latency over 50 pods, memory and scrape with 200)
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
  command -v nft >/dev/null && command -v iptables >/dev/null && command -v curl >/dev/null && command -v nginx >/dev/null ||
    die "nft, iptables, curl or nginx missing: run make deps"
  local stamp
  stamp=$(sha256sum "$here/k8s/build/go.mod" "$here/k8s/build/go.sum" | sha256sum | cut -c1-16)
  if [ -f "$bins/.stamp" ] && [ "$(cat "$bins/.stamp")" = "$stamp" ]; then
    return
  fi
  rm -rf "$bins.tmp" && mkdir -p "$bins.tmp"
  local minor=${version#v1.}; minor=${minor%%.*}
  local v=k8s.io/component-base/version
  # Version skew checks read what the programs say they are.
  local ld="-s -w -X $v.gitVersion=$version -X $v.gitMajor=1 -X $v.gitMinor=$minor -X $v.gitTreeState=clean"
  for c in kube-apiserver kube-controller-manager kube-proxy; do
    echo "k8s: building $c $version"
    (cd "$here/k8s/build" && go build -trimpath -ldflags "$ld" -o "$bins.tmp/$c" "k8s.io/kubernetes/cmd/$c")
  done
  echo "k8s: building etcd"
  (cd "$here/k8s/build" && go build -trimpath -ldflags "-s -w" -o "$bins.tmp/etcd" go.etcd.io/etcd/server/v3)
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
