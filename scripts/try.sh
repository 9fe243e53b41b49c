#!/usr/bin/env bash
# Bypass one loopback TCP connection and show it in `shunt flows`.
# Uses its own cgroup and pin directory and removes both at the end.
set -euo pipefail
shunt=${1:-bin/shunt}
root=$(awk '$9 == "cgroup2" {print $5; exit}' /proc/self/mountinfo)
cg="$root/shunt-try"
pin=/sys/fs/bpf/shunt-try
cleanup() {
  "$shunt" bypass disable --all --pin-dir "$pin" >/dev/null 2>&1 || true
  rm -rf "$pin-learned"
  rmdir "$cg" 2>/dev/null || true
  sleep 1 # the guard enable started ends within a second of the removal
  rm -f /run/shunt/*sys_fs_bpf_shunt-try*
}
trap cleanup EXIT
mkdir -p "$cg"
"$shunt" bypass enable --cgroup "$cg" --pin-dir "$pin"
# A server and a client in the cgroup: they ping-pong, then the flow is listed
# while the connection is still open.
sh -c 'echo $$ > "$1/cgroup.procs"; exec python3 - "$2" "$3"' _ "$cg" "$shunt" "$pin" <<'PY'
import socket, subprocess, sys
shunt, pin = sys.argv[1], sys.argv[2]
ln = socket.create_server(("127.0.0.1", 0))
c = socket.create_connection(ln.getsockname())
s, _ = ln.accept()
# A timeout makes Python wait in poll on a non-blocking socket, as event loops
# do. A reader that blocks in recv (Python's default without a timeout), or
# asks for MSG_WAITALL, would send the connection back to TCP: a signal would
# end such a read with EAGAIN on a bypassed socket.
c.settimeout(10)
s.settimeout(10)
def recv_exactly(sock, n):
    b = b""
    while len(b) < n:
        b += sock.recv(n - len(b))
    return b
for _ in range(1000):
    c.sendall(b"ping"); assert recv_exactly(s, 4) == b"ping"
    s.sendall(b"pong"); assert recv_exactly(c, 4) == b"pong"
subprocess.run([shunt, "flows", "--pin-dir", pin], check=True)
PY
