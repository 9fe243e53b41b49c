#!/bin/sh
# Prints the rows of scripts/kernels/tests that kernel NAME runs under ROWS
# (all, ci: the rows tagged :ci, rest: the others), one per line:
# package, -test.run pattern, -test.skip pattern (^$ when none).
# The one place the selection lives: kernels.sh skips a kernel with none,
# guest-tests.sh runs them (POSIX sh: it runs inside the guest too).
name=$1 rows=${2:-all}
grep -v '^#' "$(dirname "$0")/tests" | awk -v k="$name" -v rows="$rows" '
  NF >= 3 {
    split($1, tag, ":"); ci = (tag[2] == "ci")
    if ((tag[1] == "all" || tag[1] == k) && (rows == "all" || (rows == "ci") == ci))
      print $2, $3, ($4 == "" ? "^$" : $4)
  }'
