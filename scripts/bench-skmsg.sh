#!/usr/bin/env bash
# What bypass's sk_msg program costs per send, for each shunt binary given,
# in interleaved rounds: the kernel's BPF statistics (kernel.bpf_stats_enabled,
# restored on exit) of shunt_sk_msg, polled over 1 s in the middle of a
# 14-byte round-trip run and of a 16 KiB stream, both across CPUs. As root.
#
#   scripts/bench-skmsg.sh ROUNDS BIN [BIN...]     (KINDS="lat stream" by default)
set -euo pipefail
rounds=$1; shift
kinds=${KINDS:-lat stream}
stat=$(mktemp)
trap 'rm -f "$stat"; echo 0 > /proc/sys/kernel/bpf_stats_enabled' EXIT
(cd "$(dirname "$0")/.." && go build -o "$stat" ./scripts/bpfstat)
echo 1 > /proc/sys/kernel/bpf_stats_enabled
for r in $(seq "$rounds"); do
  for b in "$@"; do
    for kind in $kinds; do
      if [ "$kind" = lat ]; then
        "$b" bench latency --sizes 14 --modes shunt --placement cross-cpu --rounds 1 --count 300000 --duration 3s > /dev/null 2>&1 &
      else
        "$b" bench throughput --write-sizes 16K --modes shunt --placement cross-cpu --rounds 1 --duration 3s > /dev/null 2>&1 &
      fi
      pid=$!
      sleep 1.5
      a=$("$stat" shunt_sk_msg); sleep 1; z=$("$stat" shunt_sk_msg)
      wait "$pid" || echo "round $r: $b $kind failed" >&2
      echo "$r $b $kind $a $z" | awk '{ns = $6 - $4; n = $7 - $5; if (n > 0) printf "%s %s %s %.0f ns per send (%d sends)\n", $1, $2, $3, ns / n, n; else printf "%s %s %s: the run ended before the poll\n", $1, $2, $3}'
    done
  done
done
