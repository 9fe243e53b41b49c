#!/usr/bin/env bash
# Installs shunt's .deb on this machine, checks what it put where, runs the
# shunt-agent unit's command under the unit's capability bounding set and
# no_new_privs (what systemd would give it; this machine runs no systemd to
# start the unit itself) against a test cgroup, then purges the package.
# As root, on Debian. make test-package runs it.
#
#   scripts/package-test.sh out/package/shunt_VERSION_amd64.deb
set -euo pipefail
deb=${1:?usage: $0 PACKAGE.deb}
[ "$(id -u)" = 0 ] || { echo "package-test: run as root" >&2; exit 2; }
if dpkg -s shunt >/dev/null 2>&1; then
  echo "package-test: a shunt package is installed already; not touching it" >&2
  exit 1
fi
unit=/lib/systemd/system/shunt-agent.service
name=shunt-test-pkg-$$
cg=$(findmnt -n -o TARGET -t cgroup2 | head -1)
pin=/sys/fs/bpf/$name
port=$((20000 + $$ % 10000))
agent=
cleanup() {
  [ -n "$agent" ] && kill "$agent" 2>/dev/null && wait "$agent" 2>/dev/null || true
  /usr/bin/shunt bypass disable --all --pin-dir "$pin" >/dev/null 2>&1 || true
  rm -rf "$pin" "$pin-learned" "/tmp/$name.yaml" "/tmp/$name.log"
  rm -f /run/shunt/*"$name"*  # the install's and the guard's locks, the guard's log
  rmdir "$cg/$name/app-1" "$cg/$name" 2>/dev/null || true
  dpkg --purge shunt >/dev/null 2>&1 || true
}
trap cleanup EXIT
fail() { echo "package-test: $*" >&2; exit 1; }

dpkg -i "$deb" >/dev/null
for f in /usr/bin/shunt "$unit" /etc/shunt/config.yaml /usr/share/bash-completion/completions/shunt \
  /usr/share/zsh/vendor-completions/_shunt /usr/share/fish/vendor_completions.d/shunt.fish /usr/share/doc/shunt/AGENT.md; do
  [ -e "$f" ] || fail "$f is not installed"
done
[ "$(dpkg-query -W -f '${Conffiles}' shunt | awk '{print $1}')" = /etc/shunt/config.yaml ] || fail "/etc/shunt/config.yaml is not a conffile"
/usr/bin/shunt version | grep -q '^shunt ' || fail "shunt version"
/usr/bin/shunt agent --config /etc/shunt/config.yaml --check >/dev/null || fail "the default configuration does not pass --check"
systemd-analyze verify "$unit" || fail "systemd-analyze verify $unit"
echo "package-test: installed, files in place, unit verified"

# The unit's command, with its capabilities and nothing more.
caps=$(sed -n 's/^CapabilityBoundingSet=//p' "$unit" | tr 'A-Z' 'a-z' | sed 's/cap_/+/g; s/ /,/g')
exec_start=$(sed -n 's/^ExecStart=//p' "$unit")
[ "$exec_start" = "/usr/bin/shunt agent --config /etc/shunt/config.yaml" ] || fail "ExecStart is $exec_start"
grep -q '^NoNewPrivileges=yes' "$unit" || fail "the unit does not set NoNewPrivileges"
mkdir -p "$cg/$name/app-1"
printf 'bypass:\n  cgroups: ["%s/%s/app-*"]\nmetrics:\n  address: "127.0.0.1:%d"\n' "$cg" "$name" "$port" > "/tmp/$name.yaml"
setpriv --bounding-set=-all,"$caps" --inh-caps=-all --no-new-privs \
  ${exec_start% --config *} --config "/tmp/$name.yaml" --pin-dir "$pin" >"/tmp/$name.log" 2>&1 &
agent=$!
for _ in $(seq 100); do
  grep -q "serving metrics" "/tmp/$name.log" && break
  sleep 0.1
done
m=$(curl -sf "127.0.0.1:$port/metrics") || { cat "/tmp/$name.log" >&2; fail "no metrics from the agent"; }
for want in 'shunt_bypass_enabled 1' 'shunt_bypass_cgroups 1' 'shunt_bypass_guard_running 1' \
  'shunt_scrape_errors{part="bypass"} 0' 'shunt_scrape_errors{part="index"} 0'; do
  grep -qxF "$want" <<<"$m" || { cat "/tmp/$name.log" >&2; fail "under the unit's capabilities ($caps): no '$want'"; }
done
kill "$agent"
wait "$agent" || fail "the agent exited $? on SIGTERM"
agent=
if ! st=$(/usr/bin/shunt status --pin-dir "$pin" 2>&1) || ! grep -q "$cg/$name/app-1" <<<"$st"; then
  printf '%s\n--- the agent log:\n' "$st" >&2
  cat "/tmp/$name.log" >&2
  fail "bypass did not stay enabled after the agent stopped"
fi
echo "package-test: the unit's command ran with $caps and no_new_privs: cgroup enabled, guard running, metrics served, bypass kept after stop"

/usr/bin/shunt bypass disable --all --pin-dir "$pin" >/dev/null
dpkg --purge shunt >/dev/null
for f in /usr/bin/shunt "$unit" /etc/shunt; do
  [ ! -e "$f" ] || fail "$f is still there after purge"
done
echo "package-test: purged, nothing left"
