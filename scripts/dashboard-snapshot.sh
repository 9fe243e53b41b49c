#!/usr/bin/env bash
# Draws the Grafana dashboard (deploy/grafana/shunt.json) on real data into
# docs/img/dashboard.png: Debian's Prometheus scrapes a shunt agent and a
# kernel-mode shunt proxy for about 2.5 minutes while redis-benchmark
# against redis-server and short connections run between two bypassed
# cgroups on loopback, and iperf3 through the proxy, with a policy in force
# (the server's cgroup takes the client's, by a peer rule) and connections
# it denies, then
# scripts/dashboard-render draws each panel from Prometheus's answers to its
# queries, laid out as Grafana lays it out. Grafana itself does not run on
# these machines (not packaged by Debian, not reachable otherwise).
# Root; uses its own cgroups, pin directories and ports, and removes them.
set -euo pipefail
cd "$(dirname "$0")/.."
[ "$(id -u)" = 0 ] || { echo "dashboard-snapshot: run as root" >&2; exit 1; }
for p in prometheus iperf3 redis-server redis-benchmark python3 curl; do
  command -v $p >/dev/null || { echo "dashboard-snapshot: $p is missing (make deps)" >&2; exit 1; }
done
out=${1:-docs/img/dashboard.png}
shunt=$PWD/bin/shunt
make -s build
tmp=$(mktemp -d /tmp/shunt-test-dash.XXXXXX)
go build -o "$tmp/render" ./scripts/dashboard-render

root=$(awk '$9 == "cgroup2" {print $5; exit}' /proc/self/mountinfo)
srv="$root/shunt-test-dash-server" cli="$root/shunt-test-dash-client"
pin=/sys/fs/bpf/shunt-test-dash idx=/sys/fs/bpf/shunt-test-dash-index pol=/sys/fs/bpf/shunt-test-dash-policy
agent_port=19464 proxy_port=19465 prom_port=19090 iperf_port=15201 proxied_port=15202 echo_port=15203 redis_port=15204
pids=()
cleanup() {
  for p in "${pids[@]}"; do kill "$p" 2>/dev/null || true; done
  for p in "${pids[@]}"; do wait "$p" 2>/dev/null || true; done
  "$shunt" bypass disable --all --pin-dir "$pin" >/dev/null 2>&1 || true
  "$shunt" index disable --index-dir "$idx" >/dev/null 2>&1 || true
  "$shunt" policy clear --policy-dir "$pol" >/dev/null 2>&1 || true
  rm -rf "$pin-learned"
  rmdir "$srv" "$cli" 2>/dev/null || true
  rm -f /run/shunt/*shunt-test-dash*
  rm -rf "$tmp"
}
trap cleanup EXIT
mkdir -p "$srv" "$cli"
# run_in CGROUP CMD...: runs CMD inside the cgroup; bg_in: in the background.
in_cgroup='echo $$ > "$1/cgroup.procs"; shift; exec "$@"'
run_in() { sh -c "$in_cgroup" _ "$@"; }
bg_in() { sh -c "$in_cgroup" _ "$@" & pids+=($!); }

# The policy: the server takes connections from the client's cgroup, and
# from anyone on iperf3's port (the proxy, in no cgroup of the test,
# connects there); the client may not reach the discard port.
cat > "$tmp/policy.yaml" <<YAML
scopes:
  - cgroup: $srv
    ingress_default: deny
    ingress:
      - {action: allow, peer_cgroup: $cli}
      - {action: allow, cidr: 127.0.0.1, port: $iperf_port, proto: tcp}
  - cgroup: $cli
    egress:
      - {action: deny, cidr: 127.0.0.1, port: 9}
YAML
cat > "$tmp/agent.yaml" <<YAML
bypass:
  cgroups: ["$root/shunt-test-dash-*"]
index:
  enabled: true
policy:
  file: $tmp/policy.yaml
metrics:
  address: 127.0.0.1:$agent_port
YAML
"$shunt" agent --config "$tmp/agent.yaml" --pin-dir "$pin" --index-dir "$idx" --policy-dir "$pol" >"$tmp/agent.log" 2>&1 & pids+=($!)

cat > "$tmp/prometheus.yml" <<YAML
global: {scrape_interval: 1s, evaluation_interval: 1s}
scrape_configs:
  - job_name: shunt
    static_configs: [{targets: ["127.0.0.1:$agent_port", "127.0.0.1:$proxy_port"]}]
YAML
prometheus --config.file="$tmp/prometheus.yml" --storage.tsdb.path="$tmp/tsdb" \
  --web.listen-address=127.0.0.1:$prom_port >"$tmp/prometheus.log" 2>&1 & pids+=($!)

bg_in "$srv" iperf3 -s -p $iperf_port >/dev/null
bg_in "$srv" redis-server --bind 127.0.0.1 --port $redis_port --save '' --appendonly no >/dev/null
"$shunt" proxy --mode kernel --listen 127.0.0.1:$proxied_port --upstream 127.0.0.1:$iperf_port \
  --metrics-addr 127.0.0.1:$proxy_port >"$tmp/proxy.log" 2>&1 & pids+=($!)
# An echo server for short connections: each one sends 1 KiB and reads it back.
bg_in "$srv" python3 -c '
import socket, sys, threading
ln = socket.create_server(("127.0.0.1", int(sys.argv[1])))
def echo(c):
    c.settimeout(10) # waits in poll: a blocking reader would go back to TCP
    with c:
        while True:
            try:
                b = c.recv(65536)
            except TimeoutError:
                continue
            if not b:
                return
            c.sendall(b)
while True:
    threading.Thread(target=echo, args=(ln.accept()[0],), daemon=True).start()
' $echo_port
short() { # short PORT SECONDS: connections opened, used and closed; every 4th reads blocking (it goes back to TCP)
  python3 -c '
import socket, sys, time
end, i = time.time() + float(sys.argv[2]), 0
while time.time() < end:
    c = socket.create_connection(("127.0.0.1", int(sys.argv[1])))
    if i % 4:
        c.settimeout(10)
    for _ in range(8):
        c.sendall(b"x" * 1024)
        got = 0
        while got < 1024:
            got += len(c.recv(65536))
    c.close()
    i += 1
    time.sleep(0.02)
' "$1" "$2"
}
for i in $(seq 60); do
  curl -s 127.0.0.1:$agent_port/metrics | grep -q '^shunt_bypass_cgroups 2' && break
  [ "$i" = 60 ] && { echo "dashboard-snapshot: the agent did not enable the cgroups in 30 s:" >&2; cat "$tmp/agent.log" >&2; exit 1; }
  sleep 0.5
done
start=$(date +%s)
sleep 5
echo "dashboard-snapshot: traffic for about 2 minutes"
phase() { run_in "$cli" "$@" >/dev/null; }
# Connections that stay open, idle, to the end.
bg_in "$cli" python3 -c '
import socket, sys, time
conns = [socket.create_connection(("127.0.0.1", int(sys.argv[1]))) for _ in range(10)]
time.sleep(3600)
' $echo_port
# for_secs SECONDS CMD...: runs CMD again and again for that long (each
# redis-benchmark run below does its SETs, then its GETs).
for_secs() {
  local end=$((SECONDS + $1)); shift
  while [ $SECONDS -lt $end ]; do timeout $((end - SECONDS + 1)) "$@" || true; done
}
phase bash -c "$(declare -f for_secs); for_secs 25 redis-benchmark -p $redis_port -t set,get -d 16384 -c 8 -n 100000 -q"
sleep 5
phase bash -c "$(declare -f for_secs); for_secs 25 redis-benchmark -p $redis_port -t set,get -d 64 -P 16 -c 50 -n 1000000 -q"
sleep 5
# Meanwhile, what the policy denies: the client's connects to the discard
# port (EPERM at once), and connections from outside the client's cgroup
# to the echo server (their SYNs dropped: each attempt times out).
denied() {
  python3 -c '
import socket, sys, time
end = time.time() + float(sys.argv[2])
while time.time() < end:
    try:
        socket.create_connection(("127.0.0.1", int(sys.argv[1])), timeout=0.2).close()
    except OSError:
        pass
    time.sleep(0.05)
' "$1" "$2"
}
run_in "$cli" bash -c "$(declare -f denied); denied 9 25" & pids+=($!)
denied $echo_port 25 & pids+=($!)
phase bash -c "$(declare -f short); short $echo_port 25"
sleep 5
# Through the kernel-mode proxy (not in a bypassed cgroup: the proxy joins).
iperf3 -c 127.0.0.1 -p $proxied_port -t 20 >/dev/null
sleep 10
curl -s 127.0.0.1:$proxy_port/metrics | grep -E '^shunt_proxy_bytes_(up|down|kernel)_total'
mkdir -p "$(dirname "$out")"
"$tmp/render" --prometheus http://127.0.0.1:$prom_port --last $(( $(date +%s) - start + 5 ))s --step 1s --rate-interval 5s --out "$out"
echo "dashboard-snapshot: wrote $out"
