#!/usr/bin/env bash
# Installs what shunt needs to build and test on Debian 12, and mounts bpffs.
set -euo pipefail
need=()
command -v clang >/dev/null || need+=(clang llvm)
[ -f /usr/include/bpf/bpf_helpers.h ] || need+=(libbpf-dev)
[ -f /usr/include/linux/bpf.h ] || need+=(linux-libc-dev)
command -v ip >/dev/null || need+=(iproute2)
command -v unshare >/dev/null || need+=(util-linux)
# Tests that stand in for programs on blocking sockets (splice --pid, Ctrl-Z).
command -v python3 >/dev/null || need+=(python3)
# Benchmark cross-checks (shunt bench --with-sockperf, --with-iperf3).
command -v sockperf >/dev/null || need+=(sockperf)
command -v iperf3 >/dev/null || need+=(iperf3)
command -v taskset >/dev/null || need+=(util-linux)
# Proxies `shunt bench proxy` compares with.
command -v haproxy >/dev/null || need+=(haproxy)
command -v socat >/dev/null || need+=(socat)
command -v nginx >/dev/null || need+=(nginx-light)
[ -f /usr/lib/nginx/modules/ngx_stream_module.so ] || need+=(libnginx-mod-stream)
# Real programs the compatibility suite (compat/, make compat) runs through shunt.
command -v redis-server >/dev/null || need+=(redis-server)
command -v memcached >/dev/null || need+=(memcached)
command -v curl >/dev/null || need+=(curl)
command -v nc >/dev/null || need+=(netcat-openbsd)
[ -x /usr/lib/postgresql/15/bin/pgbench ] || need+=(postgresql)
command -v promtool >/dev/null || need+=(prometheus) # promtool checks shunt metrics' output
command -v wrk >/dev/null || need+=(wrk) # make compat-bench
command -v gunicorn >/dev/null || need+=(gunicorn) # compat: sync workers, blocking readers
command -v memcaslap >/dev/null || need+=(libmemcached-tools) # make compat-bench (memcaslap; memcslap over the unix socket too)
command -v mariadbd >/dev/null || need+=(mariadb-server)        # make compat-bench: MariaDB over TCP and its unix socket
command -v sysbench >/dev/null || need+=(sysbench)              # make compat-bench: MariaDB's load
command -v node >/dev/null || need+=(nodejs)                    # compat: Node's http module as a proxy
command -v javac >/dev/null || need+=(default-jdk-headless)     # compat: a Java origin, run from its source (needs the JDK)
command -v tinyproxy >/dev/null || need+=(tinyproxy)              # compat: a forward proxy that reads with blocking calls
command -v lighttpd >/dev/null || need+=(lighttpd)                # compat: an event-loop origin behind it
command -v apache2 >/dev/null || need+=(apache2)                  # compat: a reverse proxy whose origin connections wait in a pool
command -v pgbouncer >/dev/null || need+=(pgbouncer)              # compat: a connection pooler in front of PostgreSQL
command -v php-fpm8.2 >/dev/null || need+=(php8.2-fpm)             # compat: PHP behind nginx over FastCGI (blocking readers behind an event loop)
command -v squid >/dev/null || need+=(squid)                      # compat: a forward proxy (epoll on both sides)
command -v sshd >/dev/null || need+=(openssh-server)             # compat: ssh -L port forwarding (sshd polls without asking for input when its window is full)
command -v runc >/dev/null || need+=(runc)                         # make test-k8s: kubelet's containers (Debian's has seccomp)
[ -x /usr/lib/cni/bridge ] || need+=(containernetworking-plugins) # make test-k8s: the pods' bridge network
[ -x /lib/systemd/systemd ] || need+=(systemd)                  # make test-k8s: the node's init for kubelet's systemd driver
command -v dbus-daemon >/dev/null || need+=(dbus-daemon)         # make test-k8s: the system bus the systemd drivers ask
command -v nft >/dev/null || need+=(nftables) # policy parity with netfilter (policy/)
command -v iptables >/dev/null || need+=(iptables) # iptables-nft: bypass through iptables NAT rules (bypass/)
command -v ipvsadm >/dev/null || need+=(ipvsadm) # IPVS NAT under the kernel matrix (bypass/ipvs_test.go; the host kernel has no IPVS)
if [ ${#need[@]} -gt 0 ]; then
  apt-get update -qq
  # Installing haproxy, nginx, squid, sshd, php-fpm and prometheus must not start them as services.
  no_start=/usr/sbin/policy-rc.d
  if [ ! -e "$no_start" ]; then
    printf '#!/bin/sh\nexit 101\n' > "$no_start" && chmod +x "$no_start"
    trap 'rm -f "$no_start"' EXIT
  fi
  DEBIAN_FRONTEND=noninteractive apt-get install -y -qq "${need[@]}" >/dev/null
fi
command -v go >/dev/null || { echo "deps: Go is not installed (need Go 1.25 or newer)" >&2; exit 1; }
go mod download
# mode 0700, as shunt mounts it itself: the kernel default (1777) lets any
# user make names there first (shunt refuses directories not its own).
mountpoint -q /sys/fs/bpf || mount -t bpf -o mode=0700 bpf /sys/fs/bpf
