#!/usr/bin/env bash
# Where a one-way stream's two threads sleep: `perf record -e sched:sched_switch`
# for 2 s in the middle of a 6 s `shunt bench throughput` run, each context
# switch of the benchmark's process sorted by the kernel path it slept in.
# Modes interleave within each round. As root, with perf installed.
#
#   scripts/bench-switches.sh [BINARY] [ROUNDS] [SIZES] [MODES] [PLACEMENT]
#   scripts/bench-switches.sh bin/shunt 3 16K,64K tcp,shunt,unix cross-cpu
set -euo pipefail
bin=${1:-bin/shunt} rounds=${2:-3} sizes=${3:-16K,64K} modes=${4:-tcp,shunt,unix} placement=${5:-cross-cpu}
command -v perf >/dev/null || { echo "$0: perf not found (apt-get install linux-perf)" >&2; exit 2; }
[ -x "$bin" ] || { echo "$0: $bin is not an executable shunt binary" >&2; exit 2; }
out=$(mktemp -d /tmp/shunt-bench-switches-XXXXXX)
trap 'rm -rf "$out"' EXIT
comm=$(basename "$bin" | cut -c1-15)

printf '%-6s %-6s %-5s %8s %9s %s\n' size mode round Gbit/s switches "slept in (count)"
for r in $(seq "$rounds"); do
  for size in ${sizes//,/ }; do
    for mode in ${modes//,/ }; do
      "$bin" bench throughput --write-sizes "$size" --placement "$placement" --modes "$mode" \
        --rounds 1 --duration 6s --json > "$out/run.json" &
      bench=$!
      sleep 2
      perf record -q -o "$out/perf.data" -e sched:sched_switch -a -g -- sleep 2 >/dev/null 2>&1
      wait "$bench"
      gbps=$(python3 -c 'import json,sys; print("%.2f" % json.load(open(sys.argv[1]))[0]["median_gbit_per_s"])' "$out/run.json")
      perf script -i "$out/perf.data" -F comm,ip,sym 2>/dev/null | awk -v RS= -v comm="$comm" '
        $1 == comm {
          w = "other (Go runtime, timers)"
          if ($0 ~ /__lock_sock/ && $0 ~ /recvmsg/) w = "reader: its socket'"'"'s lock"
          else if ($0 ~ /__lock_sock/) w = "writer: the receiving socket'"'"'s lock"
          else if ($0 ~ /sk_stream_wait_memory/) w = "writer: send buffer full"
          else if ($0 ~ /unix_wait_for_peer|sock_alloc_send_pskb/) w = "writer: unix peer full"
          else if ($0 ~ /do_sys_poll/) w = "reader: poll"
          else if ($0 ~ /exit_to_user_mode_loop/) w = "preempted"
          n[w]++; tot++
        }
        END { s = ""; for (k in n) s = s sprintf("%s %d; ", k, n[k]); printf "%d %s\n", tot, s }' > "$out/sw"
      read -r total rest < "$out/sw"
      printf '%-6s %-6s %-5s %8s %9s %s\n' "$size" "$mode" "$r" "$gbps" "$total" "$rest"
    done
  done
done
