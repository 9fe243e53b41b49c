#!/usr/bin/env bash
# The policy's cost, interleaved: each round runs the connect and bypassed
# benchmarks of policy/bench_test.go once per mode (no policy, one rule,
# 10,000 rules, a peer rule), in alternating order, pinned to one CPU; then the apply
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
  order="none 1-rule 10000-rules peer-rule"
  [ $((i % 2)) = 0 ] && order="peer-rule 10000-rules 1-rule none"
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
import collections, statistics, sys
for path in sys.argv[1:]:
    vals = collections.defaultdict(lambda: collections.defaultdict(list))
    for line in open(path):
        f = line.split()
        if len(f) < 4 or not f[0].startswith('Benchmark'):
            continue
        name = f[0].rsplit('-', 1)[0] if f[0].rsplit('-', 1)[-1].isdigit() else f[0]
        for value, unit in zip(f[2::2], f[3::2]):
            vals[name][unit].append(float(value))
    base = {n.rsplit('/', 1)[0]: statistics.median(u['ns/op']) for n, u in vals.items() if n.endswith('/none')}
    for n in sorted(vals):
        v, group = vals[n]['ns/op'], n.rsplit('/', 1)[0]
        line = f"{n:42s} n={len(v):2d}  median {statistics.median(v)/1000:9.1f} us  (min {min(v)/1000:.1f}, max {max(v)/1000:.1f})"
        if group in base:
            line += f"  x{statistics.median(v)/base[group]:.3f}"
        for unit, u in sorted(vals[n].items()):
            if unit != 'ns/op':
                line += f"  {unit} {statistics.median(u):.0f} ({min(u):.0f}-{max(u):.0f})"
        print(line)
PY
