#!/usr/bin/env bash
# Compares two shunt binaries (say, two commits), interleaved: each round
# runs both binaries, in alternating order. Prints per metric the median over
# rounds for A and B and B/A. As root.
#   bypass (default): the bypass hot path: latency (14 B and 16 KiB round
#     trips, same and cross CPU) and throughput (16 KiB and 256 KiB writes,
#     cross CPU), mode shunt only.
#   join: the kernel join (bench proxy --modes shunt-kernel): 64 B and 16 KiB
#     request/response, 16 KiB and 2 MiB bulk.
#   newconn: short connections (bench latency --new-conn: connect, one 14 B
#     exchange, close), same and cross CPU, every connection paired: what
#     pairing costs.
#   streams: one-way throughput, 1K to 256K writes, same and cross CPU, plain
#     TCP and shunt in each run: each binary's shunt/tcp ratio per run too.
#   small: as streams, for writes of 74 B to 64 KiB from a writer with Nagle's
#     algorithm on (--nagle), over loopback (64 KiB segments).
#   readers: as streams, for 64 KiB writes to a reader slower than its
#     writer (4 KiB and 16 KiB a read, as a download's).
#   host: plain TCP outside any enabled cgroup while the binary's install
#     is in place (for an empty cgroup): what the install costs the host's
#     other programs. 74 B (Nagle on) and 1 KiB (TCP_NODELAY) writes.
#
#   scripts/bench-ab.sh OLD_BINARY NEW_BINARY [ROUNDS] [bypass|join|newconn|streams|small|readers|host]
#
# Build a commit's binary with:
#   git worktree add /tmp/old COMMIT && (cd /tmp/old && go build -o /tmp/shunt-old ./cmd/shunt)
set -euo pipefail
[ $# -ge 2 ] || { echo "usage: $0 OLD_BINARY NEW_BINARY [ROUNDS] [bypass|join|newconn|streams|small|readers|host]" >&2; exit 2; }
a=$1 b=$2 rounds=${3:-7} what=${4:-bypass}
case $what in bypass|join|newconn|streams|small|readers|host) ;; *) echo "$0: what to compare: bypass, join, newconn, streams, small, readers or host, not $what" >&2; exit 2 ;; esac
out=$(mktemp -d /tmp/shunt-bench-ab-XXXXXX)
cg=$(awk '$9 == "cgroup2" {print $5; exit}' /proc/self/mountinfo)/shunt-test-bench-host
pin=/sys/fs/bpf/shunt-test-bench-host
cleanup() {
  rm -rf "$out"
  if [ "$what" = host ]; then
    "$a" bypass disable --all --pin-dir "$pin" >/dev/null 2>&1 || true
    rm -rf "$pin-learned"; rmdir "$cg" 2>/dev/null || true
  fi
}
trap cleanup EXIT

run() { # binary tag round
  if [ "$what" = join ]; then
    "$1" bench proxy --modes shunt-kernel --rounds 1 --json > "$out/$2-join-$3.json"
    return
  fi
  if [ "$what" = host ]; then
    echo '[]' > "$out/$2-lat-$3.json"
    mkdir -p "$cg"
    "$1" bypass enable --cgroup "$cg" --pin-dir "$pin" >/dev/null
    "$1" bench throughput --nagle --topology loopback --write-sizes 74 --modes tcp \
      --placement same-cpu,cross-cpu --rounds 1 --duration 1s --json > "$out/$2-tput-$3.json"
    "$1" bench throughput --topology loopback --write-sizes 1K --modes tcp \
      --placement same-cpu,cross-cpu --rounds 1 --duration 1s --json > "$out/$2-tput2-$3.json"
    "$1" bypass disable --all --pin-dir "$pin" >/dev/null
    rm -rf "$pin-learned"
    return
  fi
  if [ "$what" = small ]; then
    echo '[]' > "$out/$2-lat-$3.json"
    "$1" bench throughput --nagle --topology loopback --write-sizes 74,1K,4K,16K,32K,64K --modes tcp,shunt \
      --placement same-cpu,cross-cpu --rounds 1 --duration 1s --json > "$out/$2-tput-$3.json"
    return
  fi
  if [ "$what" = readers ]; then
    echo '[]' > "$out/$2-lat-$3.json"
    "$1" bench throughput --write-sizes 64K --read-size 4K --modes tcp,shunt --placement same-cpu,cross-cpu \
      --rounds 1 --duration 1s --json > "$out/$2-tput-$3.json"
    "$1" bench throughput --write-sizes 64K --read-size 16K --modes tcp,shunt --placement same-cpu,cross-cpu \
      --rounds 1 --duration 1s --json > "$out/$2-tput2-$3.json"
    return
  fi
  if [ "$what" = streams ]; then
    echo '[]' > "$out/$2-lat-$3.json"
    "$1" bench throughput --write-sizes 1K,16K,64K,256K --modes tcp,shunt --placement same-cpu,cross-cpu \
      --rounds 1 --duration 1s --json > "$out/$2-tput-$3.json"
    return
  fi
  if [ "$what" = newconn ]; then
    # The default install leaves most of these connections unpaired (brief
    # ports); shunt-pair-brief pairs each, as builds before it did in shunt.
    mode=shunt
    "$1" bench latency --help 2>&1 | grep -q shunt-pair-brief && mode=shunt-pair-brief
    "$1" bench latency --new-conn --sizes 14 --modes $mode --placement same-cpu,cross-cpu --rounds 1 \
      --count 3000 --warmup 200 --json > "$out/$2-lat-$3.json"
    echo '[]' > "$out/$2-tput-$3.json"
    return
  fi
  "$1" bench latency --sizes 14,16K --modes shunt --placement same-cpu,cross-cpu --rounds 1 \
    --count 20000 --duration 2s --json > "$out/$2-lat-$3.json"
  "$1" bench throughput --write-sizes 16K,256K --modes shunt --placement cross-cpu --rounds 1 \
    --duration 1s --json > "$out/$2-tput-$3.json"
}
for r in $(seq "$rounds"); do
  if [ $((r % 2)) -eq 1 ]; then run "$a" A "$r"; run "$b" B "$r"; else run "$b" B "$r"; run "$a" A "$r"; fi
  echo "round $r of $rounds done" >&2
done

python3 - "$out" "$rounds" "$what" <<'EOF'
import json, os, statistics, sys
out, rounds, what = sys.argv[1], int(sys.argv[2]), sys.argv[3]
rows = {}
for tag in "AB":
    for r in range(1, rounds + 1):
        if what == "join":
            for e in json.load(open(f"{out}/{tag}-join-{r}.json")):
                if e["test"] == "rr":
                    key = f"join request/response {e['size']} B"
                    for q in ("p50", "p99", "p999", "max"):
                        rows.setdefault((key, q + " us"), {}).setdefault(tag, []).append(e["latency"][q + "_ns"] / 1000)
                else:
                    key = f"join bulk {e['size']} B writes"
                    rows.setdefault((key, "Gbit/s"), {}).setdefault(tag, []).append(e["gbit_per_s"])
                rows.setdefault((key, "CPU s/GB"), {}).setdefault(tag, []).append(e["machine_cpu_s_per_gb"])
            continue
        for e in json.load(open(f"{out}/{tag}-lat-{r}.json")):
            key = f"latency {e['size']} B {e['placement']}"
            for q in ("p50", "p99", "p999", "max"):
                rows.setdefault((key, q + " us"), {}).setdefault(tag, []).append(e["latency"][q + "_ns"] / 1000)
            rows.setdefault((key, "CPU us/round trip"), {}).setdefault(tag, []).append(e["machine_cpu_per_round_trip_ns"] / 1000)
        tput = [json.load(open(f)) for f in (f"{out}/{tag}-tput-{r}.json", f"{out}/{tag}-tput2-{r}.json") if os.path.exists(f)]
        for e in (e for runs in tput for e in runs):
            key = f"throughput {e['write_size']} B writes {e['placement']}"
            if what == "readers":
                key += f" {e['read_size']} B reads"
            if e.get("mode", "shunt") != "shunt":
                if e["mode"] == "tcp":
                    rows.setdefault((key, "Gbit/s plain TCP"), {}).setdefault(tag, []).append(e["median_gbit_per_s"])
                    if what == "host":
                        rows.setdefault((key, "CPU s/GB plain TCP"), {}).setdefault(tag, []).append(e["machine_cpu_s_per_gb"])
                continue
            if "ratio_to_tcp" in e and what in ("streams", "small", "readers"):
                rows.setdefault((key, "shunt / tcp"), {}).setdefault(tag, []).append(e["ratio_to_tcp"])
            rows.setdefault((key, "Gbit/s"), {}).setdefault(tag, []).append(e["median_gbit_per_s"])
            rows.setdefault((key, "CPU s/GB"), {}).setdefault(tag, []).append(e["machine_cpu_s_per_gb"])
            if "bypass" in e:  # builds before 2026-12-01 do not say
                rows.setdefault((key, "% by redirect"), {}).setdefault(tag, []).append(100 * e["bypass"]["redirected_share"])
                rows.setdefault((key, "runs sent back"), {}).setdefault(tag, []).append(e["bypass"]["sent_back_runs"])
                if "throttles_per_run" in e["bypass"]:  # builds before 2026-12-02 do not say
                    rows.setdefault((key, "throttles a run"), {}).setdefault(tag, []).append(e["bypass"]["throttles_per_run"])
print("| what | metric | A (median) | B (median) | B / A |")
print("|---|---|---|---|---|")
for (key, metric), v in rows.items():
    if metric == "runs sent back":  # a count over all rounds, not a median
        a, b = (f"{sum(v[t])} of {rounds}" if t in v else "-" for t in "AB")
        print(f"| {key} | {metric} | {a} | {b} | - |")
        continue
    ma, mb = (statistics.median(v[t]) if t in v else None for t in "AB")
    if ma is None or mb is None:
        print(f"| {key} | {metric} | {'-' if ma is None else f'{ma:.2f}'} | {'-' if mb is None else f'{mb:.2f}'} | - |")
        continue
    print(f"| {key} | {metric} | {ma:.2f} | {mb:.2f} | {mb / ma:.3f} |" if ma else f"| {key} | {metric} | {ma:.2f} | {mb:.2f} | - |")
EOF
