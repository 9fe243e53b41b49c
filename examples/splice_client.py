#!/usr/bin/env python3
"""Hand two connected TCP sockets to `shunt daemon`, which joins them in the kernel.

A one-connection proxy: accept one client on --listen, connect to --upstream,
send both sockets to the daemon (SCM_RIGHTS), print the pair's handle, close
our copies, and wait until the daemon reports that the pair ended.

    sudo shunt daemon &
    sudo python3 examples/splice_client.py --listen 127.0.0.1:8080 --upstream 127.0.0.1:9000

Wire format: docs/DAEMON.md. Needs Python 3.9+ (socket.send_fds).
"""
import argparse
import json
import socket
import sys


def addr(s):
    host, _, port = s.rpartition(":")
    return host.strip("[]"), int(port)


def request(ctl, req, fds=()):
    """Send one request; return its reply (events that arrive first are printed)."""
    socket.send_fds(ctl, [json.dumps(req).encode()], list(fds))
    while True:
        msg = json.loads(ctl.recv(65536))
        if "event" in msg:
            print(json.dumps(msg), flush=True)
            continue
        if not msg.get("ok"):
            sys.exit("shunt daemon: " + msg.get("error", "unknown error"))
        return msg


def main():
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--listen", required=True, help="HOST:PORT to accept one client on")
    ap.add_argument("--upstream", required=True, help="HOST:PORT to connect it to")
    ap.add_argument("--socket", default="/run/shunt/shunt.sock", help="the daemon's control socket")
    args = ap.parse_args()

    ctl = socket.socket(socket.AF_UNIX, socket.SOCK_SEQPACKET)
    ctl.connect(args.socket)
    listener = socket.create_server(addr(args.listen))
    print("listening on", args.listen, flush=True)
    client, _ = listener.accept()
    upstream = socket.create_connection(addr(args.upstream))

    reply = request(ctl, {"op": "join"}, [client.fileno(), upstream.fileno()])
    print("joined, handle", reply["handle"], flush=True)
    # The daemon holds its own descriptors now.
    client.close()
    upstream.close()

    while True:
        msg = json.loads(ctl.recv(65536))
        if msg.get("event") == "ended" and msg.get("handle") == reply["handle"]:
            print(json.dumps(msg), flush=True)
            return


if __name__ == "__main__":
    main()
