"""Slow, unauthenticated connections to a peer server, from a process of their own (so that the
server's process is measured alone): ``python -m tests.peer_flood HOST PORT COUNT SOURCES MODE``.

- ``SOURCES``: how many client addresses (127.0.0.2, 127.0.0.3, ...) the connections come from;
- ``MODE``: ``head`` (TLS done, then half a request line, then nothing), ``tcp`` (a TCP connection
  that never says hello), ``drip`` (TLS done, then one byte of request line every 0.8 s).

It opens COUNT connections as fast as it can (each newcomer may evict an older one: the server's
caps), prints ``opened N`` when done, then ``alive N`` every second (connections the server has
not closed) until it is killed. Used by tests/test_peers_adversarial.py and bench/peer_flood.py.
"""

from __future__ import annotations

import socket
import ssl
import sys
import time


def main() -> None:
    host, port, count, sources, mode = sys.argv[1], int(sys.argv[2]), int(sys.argv[3]), int(sys.argv[4]), sys.argv[5]
    ctx = ssl.SSLContext(ssl.PROTOCOL_TLS_CLIENT)
    ctx.check_hostname, ctx.verify_mode = False, ssl.CERT_NONE
    conns: list[socket.socket] = []
    for i in range(count):
        raw = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
        raw.bind((f"127.0.0.{2 + i % sources}", 0))
        raw.settimeout(5)
        try:
            raw.connect((host, port))
            if mode == "tcp":
                conns.append(raw)
                continue
            sock = ctx.wrap_socket(raw)
            sock.sendall(b"GET /v1/mod")
            conns.append(sock)
        except OSError:
            raw.close()
    print(f"opened {len(conns)}", flush=True)
    step = 0
    while True:
        alive = []
        for sock in conns:
            try:
                sock.setblocking(False)
                try:
                    gone = sock.recv(1) == b""
                except (BlockingIOError, ssl.SSLWantReadError):
                    gone = False
                if not gone and mode == "drip" and step % 8 == 0:
                    sock.send(b"e")
                if not gone:
                    alive.append(sock)
                else:
                    sock.close()
            except OSError:
                sock.close()
        conns = alive
        print(f"alive {len(conns)}", flush=True)
        step += 1
        time.sleep(0.1 if mode == "drip" else 1.0)


if __name__ == "__main__":
    main()
