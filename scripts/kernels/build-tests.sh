#!/usr/bin/env bash
# Builds the test binaries scripts/kernels/tests names into DIR, so that a
# kernel under qemu runs them without compiling anything.
set -euo pipefail
dir=$1
repo=$(cd "$(dirname "$0")/../.." && pwd)
mkdir -p "$dir"
cd "$repo"
for pkg in $(grep -v '^#' scripts/kernels/tests | awk 'NF >= 3 {print $2}' | sort -u); do
  # kernelmatrix: tests of what the host kernel lacks (IPVS) and the
  # matrix kernels have.
  go test -tags kernelmatrix -c -o "$dir/$(echo "$pkg" | tr / _).test" "./$pkg"
done
