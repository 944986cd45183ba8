"""A byzantine peer for the tests: a TLS server that speaks the peer protocol (docs/peers.md) with
its own pinned certificate, as a compromised or broken agent would, and misbehaves as told.

It holds a copy of the model (files in path order) and answers any storage key and listing
digest with it: what a peer that read the same origin would serve. ``Lies`` says how it lies:

- ``forge``: wrong bytes, advertised under the sha-256 of those wrong bytes;
- ``keep_crc32c``: with ``forge``, wrong bytes that keep each file's crc32c (GCS's checksum);
- ``flip``: wrong bytes under the true hashes;
- ``tail``: the right piece, then an endless tail (``Content-Length`` of a terabyte, 1 KiB/s);
- ``trickle``: one byte every ``trickle`` seconds;
- ``busy``: 503 for every piece, for ever;
- ``claim_all``: holds nothing, claims to read every piece from the origin right now;
- ``giant_have``: a ``have`` reply of that many bytes (announced in ``Content-Length``);
- ``bogus_indices``: replies listing pieces far beyond the model's piece count;
- ``rate``: an honest peer at that many bytes/s;
- ``origin``: the ``fromOrigin`` flag it puts on every piece it lists.

Used in-process by tests/test_peers_adversarial.py and, listed in a LocalModelNode status, against
real agents by tests/test_agent_peers_adversarial.py. Everything it was asked is counted.
"""

from __future__ import annotations

import hashlib
import json
import ssl
import threading
import time
from collections import Counter
from dataclasses import dataclass, field
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path
from typing import Any

from modelcache.peers.pieces import hash_piece, piece_count, piece_span
from modelcache.peers.protocol import parse_path, parse_range


@dataclass
class Lies:
    forge: bool = False
    keep_crc32c: bool = False
    flip: bool = False
    tail: bool = False
    trickle: float = 0.0
    busy: bool = False
    claim_all: bool = False
    giant_have: int = 0
    bogus_indices: bool = False
    rate: int = 0
    origin: bool = True


_FLIP = bytes(b ^ 0x5A for b in range(256))


def _wrong(data: bytes) -> bytes:
    return data.translate(_FLIP)


def crc32c_kept(data: bytes) -> bytes:
    """Other bytes of the same length and crc32c: the first 64 bytes flipped, and the 4 after them
    chosen to bring the crc32c back. A CRC is affine over GF(2): for one length, crc(a ^ d) =
    crc(a) ^ crc(d) ^ crc(0...0), so the patch solves 32 linear equations in its 32 bits (any 32
    consecutive bits are independent for a CRC of degree 32). Whoever knows a file can do this:
    a CRC is no proof against a peer that forges on purpose."""
    import google_crc32c

    size = len(data)
    assert size >= 68, "too short to forge"
    zero = google_crc32c.value(bytes(size))

    def lin(delta: bytes) -> int:
        return int(google_crc32c.value(delta) ^ zero)

    flip = _wrong(data[:64]) + bytes(size - 64)
    delta = bytes(a ^ b for a, b in zip(flip[:64], data[:64], strict=True)) + bytes(size - 64)
    target = lin(delta)
    basis = []  # (crc contribution, patch bits) per bit of bytes 64..67
    for bit in range(32):
        one = bytearray(size)
        one[64 + bit // 8] = 1 << (bit % 8)
        basis.append((lin(bytes(one)), 1 << bit))
    # Gaussian elimination over GF(2): find patch bits whose contributions XOR to ``target``.
    rows: list[tuple[int, int]] = []
    for value, bits in basis:
        for rv, rb in rows:
            if value ^ rv < value:
                value, bits = value ^ rv, bits ^ rb
        if value:
            rows.append((value, bits))
            rows.sort(reverse=True)
    patch, rest = 0, target
    for rv, rb in rows:
        if rest ^ rv < rest:
            rest, patch = rest ^ rv, patch ^ rb
    assert rest == 0, "the patch bits span every crc32c"
    forged = bytearray(data)
    forged[:64] = _wrong(data[:64])
    for i in range(4):
        forged[64 + i] ^= (patch >> (8 * i)) & 0xFF
    assert google_crc32c.value(bytes(forged)) == google_crc32c.value(data) and bytes(forged) != data
    return bytes(forged)


@dataclass
class ByzantinePeer:
    name: str
    files: dict[str, bytes]  # path -> bytes
    piece_size: int
    tls_dir: Path
    lies: Lies = field(default_factory=Lies)
    host: str = "127.0.0.1"
    asked: Counter[str] = field(default_factory=Counter)  # "have", "piece", "503", ...
    tokens: set[str] = field(default_factory=set)
    pieces_served: set[tuple[int, int]] = field(default_factory=set)

    def __post_init__(self) -> None:
        from coordinator.certs import generate_self_signed
        from modelcache.peers.server import cert_fingerprint

        self.paths = sorted(self.files)
        #: What it serves and vouches for when it lies about the bytes (forge, flip).
        self.wrong = {p: crc32c_kept(d) if self.lies.keep_crc32c else _wrong(d) for p, d in self.files.items()}
        cert, key = generate_self_signed(self.tls_dir, [self.host])
        self.fingerprint = cert_fingerprint(cert.read_text())
        ctx = ssl.SSLContext(ssl.PROTOCOL_TLS_SERVER)
        ctx.load_cert_chain(str(cert), str(key))
        self._stop = threading.Event()
        peer = self

        class Handler(_Handler):
            byz = peer

        class Server(ThreadingHTTPServer):
            daemon_threads = True
            allow_reuse_address = True

            def get_request(self) -> tuple[Any, Any]:
                sock, addr = self.socket.accept()
                sock.settimeout(10)
                try:
                    return ctx.wrap_socket(sock, server_side=True), addr
                except (ssl.SSLError, OSError):
                    sock.close()
                    raise

        self.httpd = Server((self.host, 0), Handler)
        self.port = self.httpd.server_address[1]
        threading.Thread(target=self.httpd.serve_forever, name=f"byzantine-{self.name}", daemon=True).start()

    @property
    def endpoint(self) -> str:
        return f"{self.host}:{self.port}"

    def info(self, zone: str = "", complete: bool = True) -> Any:
        from modelcache.peers.client import PeerInfo

        return PeerInfo(self.name, self.host, self.port, self.fingerprint, zone, None, complete)

    def stop(self) -> None:
        self._stop.set()
        self.httpd.shutdown()
        self.httpd.server_close()

    # ---- what it says ------------------------------------------------------------------------

    def served_bytes(self, ci: int, start: int, end: int) -> bytes:
        lying = self.lies.forge or self.lies.flip
        return (self.wrong if lying else self.files)[self.paths[ci]][start:end]

    def have_doc(self) -> dict[str, Any]:
        pieces, fetching = [], []
        for ci, path in enumerate(self.paths):
            for p in range(piece_count(len(self.files[path]), self.piece_size)):
                if self.lies.claim_all:
                    fetching.append([ci, p])
                    continue
                start, end = piece_span(len(self.files[path]), self.piece_size, p)
                h = hash_piece((self.wrong if self.lies.forge else self.files)[path][start:end])
                pieces.append([ci, p, h, int(self.lies.origin)])
        if self.lies.bogus_indices:
            pieces += [[0, 10**6 + i, "0" * 64, 1] for i in range(20)]
        return {"epoch": f"byz-{self.name}", "seq": len(pieces), "pieceSize": self.piece_size,
                "complete": not self.lies.claim_all, "full": True, "pieces": pieces, "fetching": fetching}


class _Handler(BaseHTTPRequestHandler):
    protocol_version = "HTTP/1.1"
    byz: ByzantinePeer

    def log_message(self, *args: object) -> None:
        pass

    def do_GET(self) -> None:
        byz, lies = self.byz, self.byz.lies
        auth = self.headers.get("Authorization", "")
        if auth.startswith("Bearer "):
            byz.tokens.add(auth[7:])
        route = parse_path(self.path.split("?", 1)[0])
        if route is None:
            return self._send(404, b"")
        if route.kind == "have":
            byz.asked["have"] += 1
            if "since=0" not in self.path and "epoch=-" not in self.path and not lies.bogus_indices:
                time.sleep(min(2.0, float(self.path.rsplit("wait=", 1)[-1] or 0)))  # a quiet long poll
            if lies.giant_have:
                return self._giant(lies.giant_have)
            return self._send(200, json.dumps(byz.have_doc()).encode(), "application/json")
        byz.asked["piece"] += 1
        span = parse_range(self.headers.get("Range"))
        if span is None or not 0 <= route.file < len(byz.paths):
            return self._send(416, b"")
        if lies.busy:
            byz.asked["503"] += 1
            return self._send(503, b"busy\n", headers={"Retry-After": "1"})
        start, end = span
        body = byz.served_bytes(route.file, start, end)
        byz.pieces_served.add((route.file, start // byz.piece_size))
        size = len(byz.files[byz.paths[route.file]])
        self.send_response(206)
        self.send_header("Content-Range", f"bytes {start}-{end - 1}/{size}")
        self.send_header("Content-Length", str(10**12 if lies.tail else len(body)))
        self.end_headers()
        try:
            if lies.trickle:
                for i in range(len(body)):
                    if byz._stop.is_set():
                        return
                    self.wfile.write(body[i:i + 1])
                    self.wfile.flush()
                    byz.asked["trickled bytes"] += 1
                    time.sleep(lies.trickle)
                return
            if lies.rate:
                for i in range(0, len(body), 16 << 10):
                    self.wfile.write(body[i:i + (16 << 10)])
                    time.sleep((16 << 10) / lies.rate)
            else:
                self.wfile.write(body)
            while lies.tail and not byz._stop.is_set():
                self.wfile.write(b"\0" * 1024)
                self.wfile.flush()
                byz.asked["tail KiB"] += 1
                time.sleep(1.0)
        except OSError:
            byz.asked["cut"] += 1  # the reader closed the connection mid-body

    def _giant(self, size: int) -> None:
        self.send_response(200)
        self.send_header("Content-Type", "application/json")
        self.send_header("Content-Length", str(size))
        self.end_headers()
        block = b" " * (1 << 20)
        sent = 0
        try:
            self.wfile.write(b"{\"pieces\": [")
            while sent < size - 64 and not self.byz._stop.is_set():
                self.wfile.write(block[: min(len(block), size - 64 - sent)])
                sent += len(block)
        except OSError:
            self.byz.asked["giant cut"] += 1

    def _send(self, code: int, body: bytes, kind: str = "text/plain", headers: dict[str, str] | None = None) -> None:
        self.send_response(code)
        for k, v in (headers or {}).items():
            self.send_header(k, v)
        self.send_header("Content-Type", kind)
        self.send_header("Content-Length", str(len(body)))
        self.end_headers()
        try:
            self.wfile.write(body)
        except OSError:
            pass

    def handle(self) -> None:
        try:
            super().handle()
        except (TimeoutError, OSError):
            pass


def sha(data: bytes) -> str:
    return hashlib.sha256(data).hexdigest()
