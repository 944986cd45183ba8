"""A fault-injecting HTTP/1.1 reverse proxy for tests: threads and real sockets, no mocks.

It sits between a client and an upstream server (nginx in the tests) and, following the rules a
test adds, breaks chosen responses the way real networks do:

- ``reset``    send part of the body, then abort the TCP connection (RST)
- ``truncate`` send part of the body, then close cleanly (FIN) although Content-Length promised more
- ``flip``     corrupt one byte of the body (XOR) and send everything else intact
- ``status``   answer with an error status (503 by default) without asking upstream
- ``stall``    send part of the body, stop for ``stall_seconds``, then go on
- ``pass``     forward untouched (useful to count a rule's matches)

A rule matches requests by method and path; it fires on the ``nth`` matching request and the
``times - 1`` matching requests after it (``times=None``: on every one from the nth on). The fault
position is ``at`` (an offset into the response body; default: its middle) or ``file_offset`` (an
offset in the file, located through Content-Range; the rule then only fires on responses that
cover it). Counters record requests, body bytes delivered per path and faults applied, and an
optional global rate limit slows everything down and ``pause`` holds every body still (to kill a
client mid-transfer at a known point, for instance).

It speaks TLS on either side when given contexts (``tls_server``: it terminates TLS with that
certificate, ``tls_upstream``: it talks TLS to upstream), so it can sit between two agents' peer
connections and corrupt what one serves.

Servers that behave differently from nginx are made by rewriting headers: ``drop_request_headers``
(a server or cache that ignores ``If-Match``), ``drop_response_headers`` (one without validators,
or without ``Content-Length``: the body then ends when the proxy closes the connection). A test
changes the upstream file between two requests with ``on_request``, called before each request
is forwarded.
"""

from __future__ import annotations

import re
import socket
import ssl
import struct
import threading
import time
from collections import Counter
from collections.abc import Callable
from dataclasses import dataclass, field
from urllib.parse import urlsplit

FAULT_KINDS = ("pass", "reset", "truncate", "flip", "status", "stall")
_HOP_BY_HOP = {"connection", "keep-alive", "proxy-connection", "te", "trailer", "upgrade", "proxy-authorization"}
_REASONS = {401: "Unauthorized", 403: "Forbidden", 404: "Not Found", 429: "Too Many Requests",
            500: "Internal Server Error", 502: "Bad Gateway", 503: "Service Unavailable"}
_PIECE = 64 * 1024


@dataclass
class Fault:
    kind: str
    path: str | None = None
    #: A regular expression searched in the path (for paths not known in advance).
    path_pattern: str | None = None
    method: str | None = "GET"
    nth: int = 1
    times: int | None = 1
    at: int | None = None
    file_offset: int | None = None
    status: int = 503
    retry_after: int | None = None
    stall_seconds: float = 5.0
    xor: int = 0xFF
    # Filled in by the proxy.
    seen: int = 0
    applied: int = 0

    def __post_init__(self) -> None:
        if self.kind not in FAULT_KINDS:
            raise ValueError(f"unknown fault kind {self.kind!r}; expected one of {FAULT_KINDS}")
        if self.nth < 1:
            raise ValueError("nth counts from 1")

    def matches(self, method: str, path: str) -> bool:
        return ((self.method is None or self.method == method) and (self.path is None or self.path == path)
                and (self.path_pattern is None or re.search(self.path_pattern, path) is not None))

    @property
    def exhausted(self) -> bool:
        return self.times is not None and self.applied >= self.times


@dataclass(frozen=True)
class ProxyRecord:
    """One request as the proxy handled it. ``bytes_sent`` counts body bytes written to the client."""

    method: str
    path: str
    range: str | None
    status: int
    bytes_sent: int
    fault: str | None


@dataclass
class _Pending:
    """A fault chosen for a request whose position is decided once the response head is known."""

    rule: Fault
    candidate_seen: int


@dataclass
class _Bucket:
    """A global token bucket (bytes per second) shared by every connection."""

    rate: int
    tokens: float = 0.0
    stamp: float = field(default_factory=time.monotonic)
    lock: threading.Lock = field(default_factory=threading.Lock)

    def take(self, n: int, stop: threading.Event) -> None:
        while not stop.is_set():
            with self.lock:
                now = time.monotonic()
                self.tokens = min(self.tokens + (now - self.stamp) * self.rate, max(self.rate / 10, _PIECE))
                self.stamp = now
                if self.tokens >= n:
                    self.tokens -= n
                    return
                wait = (n - self.tokens) / self.rate
            stop.wait(min(wait, 0.05))


class _ClientGone(Exception):
    pass


class FaultProxy:
    """Reverse proxy on 127.0.0.1:<port> in front of ``upstream`` (host, port)."""

    def __init__(self, upstream: tuple[str, int], port: int = 0, tls_server: ssl.SSLContext | None = None,
                 tls_upstream: ssl.SSLContext | None = None) -> None:
        self.upstream = upstream
        self.tls_server, self.tls_upstream = tls_server, tls_upstream
        self._listener = socket.create_server(("127.0.0.1", port), backlog=128)
        self.port: int = self._listener.getsockname()[1]
        self._stop = threading.Event()
        self._lock = threading.Lock()
        self._rules: list[Fault] = []
        self._conns: set[socket.socket] = set()
        self._bucket: _Bucket | None = None
        self._flowing = threading.Event()
        self._flowing.set()
        self.records: list[ProxyRecord] = []
        #: Lower-case header names removed from requests before they are forwarded.
        self.drop_request_headers: set[str] = set()
        #: Lower-case header names removed from responses (``content-length``: close-delimited body).
        self.drop_response_headers: set[str] = set()
        #: Called with (method, path, headers) before a request is forwarded (e.g. to change the file).
        self.on_request: Callable[[str, str, dict[str, str]], None] | None = None
        self.requests: Counter[str] = Counter()
        self.bytes_sent: Counter[str] = Counter()
        self.faults: Counter[str] = Counter()
        self.connections = 0
        self._thread = threading.Thread(target=self._accept_loop, name="faultproxy-accept", daemon=True)
        self._thread.start()

    # ---- configuration ----------------------------------------------------------------------

    @property
    def base_url(self) -> str:
        return f"http://127.0.0.1:{self.port}"

    def url(self, rel: str) -> str:
        return f"{self.base_url}/{rel.lstrip('/')}"

    def add(self, fault: Fault) -> Fault:
        with self._lock:
            self._rules.append(fault)
        return fault

    def clear(self) -> None:
        with self._lock:
            self._rules.clear()

    def set_rate_limit(self, bytes_per_s: int | None) -> None:
        """Cap the body bytes all connections together deliver per second (None: no cap)."""
        self._bucket = _Bucket(bytes_per_s) if bytes_per_s else None

    def pause(self) -> None:
        """Stop delivering body bytes (connections stay open) until ``resume``."""
        self._flowing.clear()

    def resume(self) -> None:
        self._flowing.set()

    def reset_counters(self) -> None:
        with self._lock:
            self.records.clear()
            self.requests.clear()
            self.bytes_sent.clear()
            self.faults.clear()

    @property
    def total_bytes_sent(self) -> int:
        with self._lock:
            return sum(self.bytes_sent.values())

    def close(self) -> None:
        self._stop.set()
        try:
            # shutdown() wakes the thread blocked in accept(); close() alone would not on Linux.
            self._listener.shutdown(socket.SHUT_RDWR)
        except OSError:
            pass
        try:
            self._listener.close()
        except OSError:
            pass
        with self._lock:
            conns = list(self._conns)
        for c in conns:
            _hard_close(c)
        self._thread.join(timeout=5)

    def __enter__(self) -> FaultProxy:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    # ---- serving ----------------------------------------------------------------------------

    def _accept_loop(self) -> None:
        while not self._stop.is_set():
            try:
                conn, _ = self._listener.accept()
            except OSError:
                return
            with self._lock:
                self._conns.add(conn)
                self.connections += 1
            threading.Thread(target=self._serve, args=(conn,), name="faultproxy-conn", daemon=True).start()

    def _serve(self, conn: socket.socket) -> None:
        if self.tls_server is not None:
            try:
                conn.settimeout(10)
                tls = self.tls_server.wrap_socket(conn, server_side=True)
                tls.settimeout(None)
            except (OSError, ssl.SSLError):
                with self._lock:
                    self._conns.discard(conn)
                conn.close()
                return
            with self._lock:
                self._conns.discard(conn)
                self._conns.add(tls)
            conn = tls
        rfile = conn.makefile("rb")
        try:
            while not self._stop.is_set():
                req = _read_head(rfile)
                if req is None:
                    return
                keep = self._handle(conn, rfile, *req)
                if not keep:
                    return
        except (OSError, _ClientGone, ValueError):
            pass
        finally:
            with self._lock:
                self._conns.discard(conn)
            try:
                rfile.close()
            except OSError:
                pass
            try:
                conn.close()
            except OSError:
                pass

    def _choose(self, method: str, path: str) -> _Pending | None:
        """Count the request against every matching rule; return the first rule due to fire."""
        chosen: _Pending | None = None
        with self._lock:
            self.requests[path] += 1
            for rule in self._rules:
                if not rule.matches(method, path):
                    continue
                rule.seen += 1
                if chosen is None and rule.seen >= rule.nth and not rule.exhausted:
                    chosen = _Pending(rule, rule.seen)
        return chosen

    def _handle(self, conn: socket.socket, rfile, method: str, target: str, headers: list[tuple[str, str]]) -> bool:
        path = urlsplit(target).path
        hmap = {k.lower(): v for k, v in headers}
        client_keep = hmap.get("connection", "").lower() != "close"
        req_body = rfile.read(int(hmap.get("content-length", "0") or 0)) if "content-length" in hmap else b""
        rng = hmap.get("range")
        pending = self._choose(method, path)
        if self.on_request is not None:
            self.on_request(method, path, hmap)
        headers = [(k, v) for k, v in headers if k.lower() not in self.drop_request_headers]

        if pending is not None and pending.rule.kind == "status":
            rule = pending.rule
            with self._lock:
                rule.applied += 1
                self.faults["status"] += 1
            body = f"injected {rule.status}\n".encode()
            extra = f"Retry-After: {rule.retry_after}\r\n" if rule.retry_after is not None else ""
            head = (
                f"HTTP/1.1 {rule.status} {_REASONS.get(rule.status, 'Error')}\r\nContent-Type: text/plain\r\n"
                f"Content-Length: {len(body)}\r\n{extra}Connection: {'keep-alive' if client_keep else 'close'}\r\n\r\n"
            )
            conn.sendall(head.encode() + (body if method != "HEAD" else b""))
            self._record(method, path, rng, rule.status, 0, "status")
            return client_keep

        up = socket.create_connection(self.upstream, timeout=30)
        if self.tls_upstream is not None:
            up = self.tls_upstream.wrap_socket(up)
        try:
            lines = [f"{method} {target} HTTP/1.1"]
            lines += [f"{k}: {v}" for k, v in headers if k.lower() not in _HOP_BY_HOP]
            lines.append("Connection: close")
            up.sendall(("\r\n".join(lines) + "\r\n\r\n").encode("latin-1") + req_body)
            ufile = up.makefile("rb")
            status_line, rheaders = _read_response_head(ufile)
            status = int(status_line.split(" ", 2)[1])
            rmap = {k.lower(): v for k, v in rheaders}
            if method == "HEAD" or status in (204, 304) or 100 <= status < 200:
                length: int | None = 0
            elif "content-length" in rmap and "chunked" not in rmap.get("transfer-encoding", "").lower():
                length = int(rmap["content-length"])
            else:
                length = None  # relay until upstream closes, then close the client too
            framed = length is not None and "content-length" not in self.drop_response_headers
            keep = client_keep and framed
            dropped = _HOP_BY_HOP | self.drop_response_headers
            out = [status_line] + [f"{k}: {v}" for k, v in rheaders if k.lower() not in dropped]
            out.append(f"Connection: {'keep-alive' if keep else 'close'}")
            conn.sendall(("\r\n".join(out) + "\r\n\r\n").encode("latin-1"))

            fault, at = self._position(pending, length, rmap.get("content-range"))
            sent, ended = self._relay_body(conn, ufile, path, length, fault, at)
            self._record(method, path, rng, status, sent, fault.kind if fault else None)
            return keep and not ended
        finally:
            _hard_close(up, rst=False)

    def _position(
        self, pending: _Pending | None, length: int | None, content_range: str | None
    ) -> tuple[Fault | None, int]:
        if pending is None:
            return None, 0
        rule = pending.rule
        if rule.file_offset is not None:
            start = 0
            m = re.match(r"bytes (\d+)-(\d+)/", content_range or "")
            if m:
                start = int(m.group(1))
            at = rule.file_offset - start
            if at < 0 or (length is not None and at >= length):
                return None, 0  # this response does not cover the byte: leave the rule armed
        elif rule.at is not None:
            at = rule.at
        else:
            at = (length or 0) // 2
        with self._lock:
            if rule.exhausted:
                return None, 0
            rule.applied += 1
            self.faults[rule.kind] += 1
        return rule, at

    def _relay_body(self, conn: socket.socket, ufile, path: str, length: int | None, fault: Fault | None,
                    at: int) -> tuple[int, bool]:
        """Copy the body, applying ``fault`` at body offset ``at``. Returns (bytes sent, connection ended)."""
        sent = 0
        remaining = length
        stalled = False
        while remaining is None or remaining > 0:
            want = _PIECE if remaining is None else min(_PIECE, remaining)
            if fault is not None and fault.kind in ("reset", "truncate", "stall") and sent < at:
                want = min(want, at - sent)  # stop exactly at the fault position
            if fault is not None and fault.kind in ("reset", "truncate") and sent >= at:
                self._count(path, 0)
                _hard_close(conn, rst=fault.kind == "reset")
                return sent, True
            if fault is not None and fault.kind == "stall" and sent >= at and not stalled:
                stalled = True
                self._stop.wait(fault.stall_seconds)
            piece = ufile.read1(want) if want else b""
            if not piece:
                if remaining is None:
                    break
                # Upstream ended early: pass the short body on and end the connection.
                _hard_close(conn, rst=False)
                return sent, True
            if fault is not None and fault.kind == "flip" and sent <= at < sent + len(piece):
                buf = bytearray(piece)
                buf[at - sent] ^= fault.xor
                piece = bytes(buf)
            while not self._flowing.wait(0.05):
                if self._stop.is_set():
                    raise _ClientGone()
            if self._bucket is not None:
                self._bucket.take(len(piece), self._stop)
            try:
                conn.sendall(piece)
            except OSError as exc:
                raise _ClientGone() from exc
            sent += len(piece)
            self._count(path, len(piece))
            if remaining is not None:
                remaining -= len(piece)
        if fault is not None and fault.kind in ("reset", "truncate") and sent <= at:
            # The fault sits at (or past) the end of the body: still break the connection there.
            _hard_close(conn, rst=fault.kind == "reset")
            return sent, True
        if remaining is None:
            _hard_close(conn, rst=False)
            return sent, True
        return sent, False

    def _count(self, path: str, n: int) -> None:
        if n:
            with self._lock:
                self.bytes_sent[path] += n

    def _record(self, method: str, path: str, rng: str | None, status: int, sent: int, fault: str | None) -> None:
        with self._lock:
            self.records.append(ProxyRecord(method, path, rng, status, sent, fault))


def _hard_close(sock: socket.socket, rst: bool = False) -> None:
    try:
        if rst:
            # SO_LINGER with a zero timeout makes close() send RST instead of FIN.
            sock.setsockopt(socket.SOL_SOCKET, socket.SO_LINGER, struct.pack("ii", 1, 0))
        else:
            sock.shutdown(socket.SHUT_RDWR)
    except OSError:
        pass
    try:
        sock.close()
    except OSError:
        pass


def _read_head(rfile) -> tuple[str, str, list[tuple[str, str]]] | None:
    line = rfile.readline(65537)
    while line in (b"\r\n", b"\n"):
        line = rfile.readline(65537)
    if not line:
        return None
    parts = line.decode("latin-1").strip().split()
    if len(parts) != 3:
        raise ValueError(f"bad request line {line!r}")
    return parts[0], parts[1], _read_headers(rfile)


def _read_response_head(rfile) -> tuple[str, list[tuple[str, str]]]:
    line = rfile.readline(65537)
    if not line:
        raise OSError("upstream closed before answering")
    return line.decode("latin-1").rstrip("\r\n"), _read_headers(rfile)


def _read_headers(rfile) -> list[tuple[str, str]]:
    headers = []
    while True:
        line = rfile.readline(65537)
        if line in (b"\r\n", b"\n", b""):
            return headers
        name, _, value = line.decode("latin-1").partition(":")
        headers.append((name.strip(), value.strip()))
