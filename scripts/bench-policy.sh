#!/usr/bin/env bash
# The policy's cost, interleaved: each round runs the connect and bypassed
# benchmarks of policy/bench_test.go once per mode (no policy, one rule,
# 10,000 rules), in alternating order, pinned to one CPU; then the apply
# benchmarks. Prints per benchmark the median over rounds, its spread and
# its ratio to no policy. As root; ~20 s per round.
#
#   scripts/bench-policy.sh [ROUNDS]
set -euo pipefail
rounds=${1:-7}
case $rounds in ''|*[!0-9]*) echo "usage: $0 [ROUNDS]" >&2; exit 2 ;; esac
repo=$(cd "$(dirname "$0")/.." && pwd)
out=$(mktemp -d /tmp/shunt-bench-policy-XXXXXX)
trap 'rm -rf "$out"' EXIT
cd "$repo"
go test -c -o "$out/policy.test" ./policy
cd policy # the test binary reads nothing from here, but go test would run here
for i in $(seq 1 "$rounds"); do
  order="none 1-rule 10000-rules"
  [ $((i % 2)) = 0 ] && order="10000-rules 1-rule none"
  for m in $order; do
    for bench in "BenchmarkConnect/^$m\$" "BenchmarkBypassed/./^$m\$"; do
      taskset -c 1 "$out/policy.test" -test.run '^$' -test.bench "$bench" -test.benchtime 20000x |
        grep '^Benchmark' >> "$out/modes.txt"
    done
  done
done
"$out/policy.test" -test.run '^$' -test.bench 'BenchmarkApply' -test.benchtime 10x -test.count 5 |
  grep '^Benchmark' >> "$out/apply.txt"
python3 - "$out/modes.txt" "$out/apply.txt" <<'PY'
import collections, re, statistics, sys
for path in sys.argv[1:]:
    ns, mbs, hook = collections.defaultdict(list), collections.defaultdict(list), collections.defaultdict(list)
    for line in open(path):
        m = re.match(r'(Benchmark\S+?)(-\d+)?\s+\d+\s+([\d.]+) ns/op(?:\s+([\d.]+) MB/s)?(?:\s+([\d.]+) hook-ns/run)?', line)
        if not m:
            continue
        ns[m[1]].append(float(m[3]))
        if m[4]: mbs[m[1]].append(float(m[4]))
        if m[5]: hook[m[1]].append(float(m[5]))
    base = {n.rsplit('/', 1)[0]: statistics.median(v) for n, v in ns.items() if n.endswith('/none')}
    for n in sorted(ns):
        v, group = ns[n], n.rsplit('/', 1)[0]
        line = f"{n:42s} n={len(v):2d}  median {statistics.median(v)/1000:9.1f} us  (min {min(v)/1000:.1f}, max {max(v)/1000:.1f})"
        if group in base:
            line += f"  x{statistics.median(v)/base[group]:.3f}"
        if mbs[n]:
            line += f"  {statistics.median(mbs[n]):.0f} MB/s"
        if hook[n]:
            line += f"  hook {statistics.median(hook[n]):.0f} ns/run ({min(hook[n]):.0f}-{max(hook[n]):.0f})"
        print(line)
PY
