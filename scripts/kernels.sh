#!/usr/bin/env bash
# Boots Debian's kernels under qemu (virtme-ng, TCG: no KVM nested here) and
# runs shunt's tests there, on this machine's files.
#
#   scripts/kernels.sh setup            install qemu, virtme-ng and the kernels of scripts/kernels/matrix
#   scripts/kernels.sh run NAME CMD     run CMD (a shell command) as root on kernel NAME
#   scripts/kernels.sh test [NAME...]   the selection of scripts/kernels/tests on each kernel (default: all);
#                                       ROWS=ci runs only the rows tagged :ci (CI's), ROWS=rest the others
#   scripts/kernels.sh clean            remove the cache and the kernels' modules
#
# The cache (kernels, the virtme-ng venv, apt lists) is $SHUNT_KERNEL_CACHE,
# default /var/cache/shunt-kernels; each kernel's modules go to
# /usr/lib/modules/VERSION, where virtme-ng looks for them.
set -euo pipefail
here=$(cd "$(dirname "$0")" && pwd)
repo=$(cd "$here/.." && pwd)
cache=${SHUNT_KERNEL_CACHE:-/var/cache/shunt-kernels}
vng_version=1.42

die() { echo "kernels: $*" >&2; exit 1; }

# matrix prints "name suite package pattern" lines.
matrix() { grep -v '^#' "$here/kernels/matrix" | awk 'NF == 4'; }

apt_for() { # suite -> apt-get options for that suite's own lists
  local suite=$1 dir="$cache/apt-$1"
  echo "-o Dir::Etc::sourcelist=$dir/sources.list -o Dir::Etc::sourceparts=- -o Dir::State::Lists=$dir/lists -o Dir::Cache::archives=$dir/archives"
}

setup() {
  local need=()
  command -v qemu-system-x86_64 >/dev/null || need+=(qemu-system-x86)
  [ -x /bin/busybox ] || need+=(busybox-static)
  command -v depmod >/dev/null || need+=(kmod)
  python3 -c 'import venv' 2>/dev/null || need+=(python3-venv)
  if [ ${#need[@]} -gt 0 ]; then
    apt-get update -qq
    DEBIAN_FRONTEND=noninteractive apt-get install -y -qq "${need[@]}" >/dev/null
  fi
  mkdir -p "$cache"
  if ! "$cache/venv/bin/vng" --version 2>/dev/null | grep -q "$vng_version"; then
    python3 -m venv "$cache/venv"
    "$cache/venv/bin/pip" install -q "virtme-ng==$vng_version"
  fi
  local name suite pkg pattern
  while read -r name suite pkg pattern; do
    [ -f "$cache/$name/vmlinuz" ] && continue
    local dir="$cache/apt-$suite"
    mkdir -p "$dir/lists/partial" "$dir/archives/partial"
    local keyring=/usr/share/keyrings/debian-archive-keyring.gpg
    {
      echo "deb [signed-by=$keyring] http://deb.debian.org/debian $suite main"
      echo "deb [signed-by=$keyring] http://deb.debian.org/debian $suite-updates main"
      echo "deb [signed-by=$keyring] http://deb.debian.org/debian-security $suite-security main"
    } > "$dir/sources.list"
    # shellcheck disable=SC2046
    apt-get -qq $(apt_for "$suite") update
    # shellcheck disable=SC2046
    if ! apt-cache $(apt_for "$suite") show "$pkg" >/dev/null 2>&1; then
      # In the pattern * stands for a version: digits and dots.
      local newest re
      re=$(printf '%s' "$pattern" | sed -e 's/[.+]/\\&/g' -e 's/\*/[0-9.]+/g')
      # shellcheck disable=SC2046
      newest=$(apt-cache $(apt_for "$suite") pkgnames linux-image- | grep -xE "$re" | sort -V | tail -1)
      [ -n "$newest" ] || die "$suite has neither $pkg nor anything like $pattern"
      echo "kernels: $pkg is gone from $suite; using $newest (update scripts/kernels/matrix)" >&2
      pkg=$newest
    fi
    echo "kernels: $name: $pkg"
    rm -rf "$cache/$name.tmp" && mkdir -p "$cache/$name.tmp"
    # (apt warns that root downloads unsandboxed: only a failure is shown)
    # shellcheck disable=SC2046
    (cd "$cache/$name.tmp" && apt-get -qq $(apt_for "$suite") download "$pkg" > download.log 2>&1) ||
      die "could not download $pkg from $suite: $(grep -v '^W:' "$cache/$name.tmp/download.log" | tail -3)"
    (cd "$cache/$name.tmp" && dpkg-deb -x ./*.deb root && rm ./*.deb download.log)
    local vmlinuz version
    vmlinuz=$(ls "$cache/$name.tmp/root/boot/"vmlinuz-*)
    version=${vmlinuz##*/vmlinuz-}
    local mods="$cache/$name.tmp/root/lib/modules/$version"
    [ -d "$mods" ] || mods="$cache/$name.tmp/root/usr/lib/modules/$version"
    mkdir -p "/usr/lib/modules/$version"
    cp -a "$mods/." "/usr/lib/modules/$version/"
    depmod "$version"
    mv "$vmlinuz" "$cache/$name.tmp/vmlinuz"
    echo "$version" > "$cache/$name.tmp/version"
    rm -rf "$cache/$name.tmp/root" "$cache/$name"
    mv "$cache/$name.tmp" "$cache/$name"
  done < <(matrix)
}

# run NAME CMD: CMD's exit status comes back through a file in a shared
# directory (vng's own status says only whether the guest booted).
run() {
  local name=$1 cmd=$2
  [ -f "$cache/$name/vmlinuz" ] || die "kernel $name is not set up (scripts/kernels.sh setup)"
  local out
  out=$(mktemp -d /tmp/shunt-kernel-XXXXXX)
  local script="$out/guest.sh"
  cat > "$script" <<GUEST
set +e
mount -t bpf bpf /sys/fs/bpf 2>/dev/null
mountpoint -q /sys/fs/cgroup || mount -t cgroup2 none /sys/fs/cgroup
cd "$repo"
( $cmd ) > "$out/output" 2>&1
echo \$? > "$out/status"
GUEST
  # The guest writes its output to the shared directory: show it as it comes.
  : > "$out/output"
  tail -n +1 -f "$out/output" &
  local tailer=$!
  PATH="$cache/venv/bin:$PATH" vng --run "$cache/$name/vmlinuz" --disable-kvm --memory 4G --cpus 2 \
    --rwdir "$out" --exec "sh $script" > "$out/console" 2>&1 || true
  sleep 1
  kill "$tailer" 2>/dev/null || true
  wait "$tailer" 2>/dev/null || true
  local status
  status=$(cat "$out/status" 2>/dev/null || echo boot)
  if [ "$status" = boot ]; then
    tail -20 "$out/console" >&2
    rm -rf "$out"
    die "kernel $name did not boot or the command did not run (console above)"
  fi
  rm -rf "$out"
  return "$status"
}

clean() {
  local v
  for v in "$cache"/*/version; do
    [ -f "$v" ] && rm -rf "/usr/lib/modules/$(cat "$v")"
  done
  rm -rf "$cache"
}

case ${1:-} in
setup) setup ;;
clean) clean ;;
run) [ $# -eq 3 ] || die "usage: scripts/kernels.sh run NAME 'COMMAND'"; run "$2" "$3" ;;
test)
  shift
  names=("$@")
  [ ${#names[@]} -gt 0 ] || mapfile -t names < <(matrix | awk '{print $1}')
  bins="$repo/bin/kernel-tests"
  rows=${ROWS:-all}
  case $rows in all|ci|rest) ;; *) die "ROWS=$rows: want all, ci or rest" ;; esac
  # A kernel with no rows under ROWS is not booted, rather than "passed".
  with=()
  for name in "${names[@]}"; do
    if [ -n "$(sh "$here/kernels/rows.sh" "$name" "$rows")" ]; then with+=("$name")
    else echo "== kernel $name: no rows with ROWS=$rows (scripts/kernels/tests), not booted"; fi
  done
  [ ${#with[@]} -gt 0 ] || die "none of ${names[*]} has rows with ROWS=$rows"
  names=("${with[@]}")
  "$here/kernels/build-tests.sh" "$bins"
  failed=()
  for name in "${names[@]}"; do
    echo "== kernel $name ($(cat "$cache/$name/version" 2>/dev/null || echo not set up))"
    start=$(date +%s)
    if run "$name" "sh $here/kernels/guest-tests.sh $bins $name $rows"; then
      echo "== kernel $name: passed in $(( $(date +%s) - start )) s"
    else
      echo "== kernel $name: FAILED after $(( $(date +%s) - start )) s"
      failed+=("$name")
    fi
  done
  [ ${#failed[@]} -eq 0 ] || die "failed on: ${failed[*]}"
  ;;
*) awk 'NR > 1 && /^#/ { sub(/^# ?/, ""); print; next } NR > 1 { exit }' "$0"; exit 2 ;;
esac
