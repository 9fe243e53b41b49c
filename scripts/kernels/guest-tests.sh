#!/bin/sh
# Runs inside a kernel under qemu (scripts/kernels.sh test): the rows of
# scripts/kernels/tests for kernel NAME, from the test binaries in DIR;
# ROWS: all (default), ci (the rows tagged :ci) or rest (the others).
# Exits non-zero if any failed, if one ran no test at all, or if there are none.
dir=$1 name=$2 rows=${3:-all}
here=$(dirname "$0")
status=0
sh "$here/rows.sh" "$name" "$rows" > /tmp/shunt-kernel-rows
# kernels.sh skips a kernel with no rows; run by hand, say so rather than pass.
[ -s /tmp/shunt-kernel-rows ] || { echo "FAIL  no rows for kernel $name with ROWS=$rows"; exit 1; }
while read -r pkg pattern skip; do
  bin="$dir/$(echo "$pkg" | tr / _).test"
  start=$(date +%s)
  # Each package's tests run from its own directory, as go test runs them;
  # -test.short: churn tests run 2,000 cycles, not 100,000 (the kernel's
  # behaviour shows in the first few; under qemu the rest took minutes).
  out=$(cd "$pkg" && "$bin" -test.run "$pattern" -test.skip "$skip" -test.short -test.v -test.count 1 -test.timeout 15m 2>&1)
  rc=$?
  passed=$(printf '%s\n' "$out" | grep -c '^--- PASS')
  failed=$(printf '%s\n' "$out" | grep -c -E '^ *--- (FAIL|SKIP)')
  secs=$(( $(date +%s) - start ))
  if [ $rc -ne 0 ] || [ "$failed" -ne 0 ] || [ "$passed" -eq 0 ]; then
    # What failed and why, not the passing noise around it: with -test.v a
    # test's log lines stream before its --- FAIL line, so they are picked
    # by their file:line prefix.
    printf '%s\n' "$out" | grep -E -A12 '^ *--- FAIL|^ +[^ ]+\.go:[0-9]+: |^panic|^FAIL|timed out' | grep -v -E '^ *--- PASS|^=== (RUN|PAUSE|CONT|NAME)' | head -150
    echo "FAIL  $pkg $pattern: $passed passed, $failed failed or skipped, exit $rc, ${secs}s"
    status=1
  else
    [ "$skip" = '^$' ] && skip= || skip=" (left out: $skip)"
    echo "ok    $pkg $pattern: $passed passed, ${secs}s$skip"
    # The row's slowest tests: what to move when a row nears its 15 minutes.
    printf '%s\n' "$out" | sed -n 's/^--- PASS: \([^ ]*\) (\([0-9.]*\)s)$/\2 \1/p' | sort -rn | head -3 |
      awk '{printf "%s%s %.0fs", (NR > 1 ? ", " : "      slowest: "), $2, $1} END {if (NR) print ""}'
  fi
done < /tmp/shunt-kernel-rows
exit $status
