#!/usr/bin/env bash
# Installs what shunt needs to build and test on Debian 12, and mounts bpffs.
set -euo pipefail
need=()
command -v clang >/dev/null || need+=(clang llvm)
[ -f /usr/include/bpf/bpf_helpers.h ] || need+=(libbpf-dev)
[ -f /usr/include/linux/bpf.h ] || need+=(linux-libc-dev)
command -v ip >/dev/null || need+=(iproute2)
command -v unshare >/dev/null || need+=(util-linux)
# Benchmark cross-checks (shunt bench --with-sockperf, --with-iperf3).
command -v sockperf >/dev/null || need+=(sockperf)
command -v iperf3 >/dev/null || need+=(iperf3)
command -v taskset >/dev/null || need+=(util-linux)
if [ ${#need[@]} -gt 0 ]; then
  apt-get update -qq
  DEBIAN_FRONTEND=noninteractive apt-get install -y -qq "${need[@]}" >/dev/null
fi
command -v go >/dev/null || { echo "deps: Go is not installed (need Go 1.25 or newer)" >&2; exit 1; }
go mod download
mountpoint -q /sys/fs/bpf || mount -t bpf bpf /sys/fs/bpf
