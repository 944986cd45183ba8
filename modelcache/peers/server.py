"""The peer server: other agents read pieces of this node's models from it, over TLS only.

Every request must carry a bearer token that ``authorize`` accepts (the agent checks it with a
Kubernetes TokenReview: a ServiceAccount token of the agents, for the peer audience); without
one the answer is 401, with another identity's 403. No anonymous read of model weights.

Serving never starves the node: at most ``max_uploads`` file reads run at once (more wait half
a second for a slot, then get 503 with ``Retry-After`` and ask another holder), and
``upload_rate`` bytes/s caps all of them together. The TLS handshake runs in the connection's
own thread, with a timeout, so a slow client holds only that thread.

Zero-copy: a connection whose TLS the kernel does (kTLS: Python 3.14+ with OpenSSL 3 built for
it and the kernel's ``tls`` module) sends file ranges with ``sendfile``. Elsewhere TLS is done
in user space, where sendfile cannot apply: the range is read with ``preadv`` into one reused
buffer per upload and written to the TLS socket (one copy).
"""

from __future__ import annotations

import contextlib
import logging
import os
import ssl
import threading
import time
from collections.abc import Callable
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from typing import Any, Protocol
from urllib.parse import parse_qs, urlsplit

from modelcache.peers.local import ServedRange
from modelcache.peers.protocol import MAX_WAIT, HaveReply, parse_path, parse_range

log = logging.getLogger("modelcache.peers.server")

#: Seconds for a client to finish its TLS handshake, and to send its next request.
HANDSHAKE_TIMEOUT = 10.0
IDLE_TIMEOUT = 60.0
SEND_BLOCK = 256 << 10
#: How long a request waits for an upload slot before it is answered 503 (busy): short, so the
#: peer asks another holder soon, but long enough to spare it a round trip per piece.
SLOT_WAIT = 0.5
OK, UNAUTHENTICATED, FORBIDDEN = "ok", "unauthenticated", "forbidden"


class Catalog(Protocol):
    def have(self, key: str, digest: str, epoch: str, since: int, wait: float) -> HaveReply | None: ...

    def range(self, key: str, digest: str, ci: int, start: int, end: int) -> ServedRange | None: ...


class TokenBucket:
    """``rate`` bytes per second shared by every upload (0: unlimited). A burst is at most a
    tenth of a second's worth (or one send block). ``clock``/``sleep``: a test's own time."""

    def __init__(self, rate: int, clock: Callable[[], float] = time.monotonic,
                 sleep: Callable[[float], None] = time.sleep) -> None:
        self.rate = rate
        self._clock, self._sleep = clock, sleep
        self._tokens = 0.0
        self._stamp = clock()
        self._lock = threading.Lock()

    def take(self, n: int) -> None:
        if self.rate <= 0:
            return
        while True:
            with self._lock:
                now = self._clock()
                self._tokens = min(self._tokens + (now - self._stamp) * self.rate, max(self.rate / 10, SEND_BLOCK))
                self._stamp = now
                if self._tokens >= n:
                    self._tokens -= n
                    return
                wait = (n - self._tokens) / self.rate
            self._sleep(min(wait, 0.1))


def ktls_send(conn: object) -> bool:
    """Whether the kernel encrypts what this TLS socket sends (only then is sendfile zero-copy).
    ``_sslobj.uses_ktls_for_send`` exists from Python 3.14 on; older Pythons never use kTLS."""
    probe = getattr(getattr(conn, "_sslobj", None), "uses_ktls_for_send", None)
    try:
        return bool(probe()) if callable(probe) else False
    except (ssl.SSLError, OSError):
        return False


def cert_fingerprint(cert_pem: str) -> str:
    """SHA-256 (hex) of a PEM certificate's DER bytes: what peers pin."""
    import hashlib

    return hashlib.sha256(ssl.PEM_cert_to_DER_cert(cert_pem)).hexdigest()


def server_context(cert: str, key: str) -> ssl.SSLContext:
    ctx = ssl.SSLContext(ssl.PROTOCOL_TLS_SERVER)
    ctx.minimum_version = ssl.TLSVersion.TLSv1_2
    ctx.load_cert_chain(cert, key)
    ktls = getattr(ssl, "OP_ENABLE_KTLS", 0)  # Python 3.12+: let OpenSSL hand TLS to the kernel
    if ktls:
        ctx.options |= ktls
    return ctx


class PeerServer:
    def __init__(self, host: str, port: int, context: ssl.SSLContext, catalog: Catalog,
                 authorize: Callable[[str], str], max_uploads: int = 4, upload_rate: int = 0,
                 on_upload: Callable[[int], None] | None = None,
                 on_reject: Callable[[str], None] | None = None) -> None:
        self.catalog, self.authorize = catalog, authorize
        self.uploads = threading.BoundedSemaphore(max(1, max_uploads))
        self.bucket = TokenBucket(upload_rate)
        self.on_upload = on_upload or (lambda n: None)
        self.on_reject = on_reject or (lambda reason: None)
        self.zero_copy_sends = 0
        outer = self

        class Server(ThreadingHTTPServer):
            daemon_threads = True
            allow_reuse_address = True

            def finish_request(self, request: Any, client_address: Any) -> None:
                request.settimeout(HANDSHAKE_TIMEOUT)
                try:
                    conn = context.wrap_socket(request, server_side=True)
                except (ssl.SSLError, OSError):
                    outer.on_reject("tls")
                    return
                try:
                    conn.settimeout(IDLE_TIMEOUT)
                    # typeshed types the server argument as the base class's Self: this subclass is one.
                    self.RequestHandlerClass(conn, client_address, self)  # type: ignore[arg-type]
                finally:
                    with contextlib.suppress(OSError):
                        conn.close()

        class Handler(_Handler):
            server_ref = outer

        self.httpd = Server((host, port), Handler)
        self.port: int = self.httpd.server_address[1]
        self._thread = threading.Thread(target=self.httpd.serve_forever, name="peer-server", daemon=True)

    def start(self) -> PeerServer:
        self._thread.start()
        return self

    def stop(self) -> None:
        self.httpd.shutdown()
        self.httpd.server_close()


class _Handler(BaseHTTPRequestHandler):
    protocol_version = "HTTP/1.1"
    server_ref: PeerServer

    def log_message(self, *args: object) -> None:  # every piece is a request: not worth a line
        pass

    def do_GET(self) -> None:
        peer = self.server_ref
        url = urlsplit(self.path)
        route = parse_path(url.path)
        if route is None:
            return self._reply(404, b"not found\n")
        auth = self.headers.get("Authorization", "")
        token = auth[7:].strip() if auth[:7].lower() == "bearer " else ""
        verdict = peer.authorize(token) if token else UNAUTHENTICATED
        if verdict != OK:
            peer.on_reject(verdict)
            if verdict == FORBIDDEN:
                return self._reply(403, b"forbidden: not a modelcache agent\n")
            return self._reply(401, b"a modelcache agent's peer token is required\n",
                               {"WWW-Authenticate": 'Bearer realm="modelcache-peer"'})
        if route.kind == "have":
            return self._have(route.storage_key, route.digest, parse_qs(url.query))
        return self._file(route.storage_key, route.digest, route.file)

    def _have(self, key: str, digest: str, query: dict[str, list[str]]) -> None:
        try:
            epoch = query.get("epoch", ["-"])[0][:64]
            since = int(query.get("since", ["0"])[0])
            wait = min(max(0.0, float(query.get("wait", ["0"])[0])), MAX_WAIT)
        except ValueError:
            return self._reply(400, b"bad query\n")
        reply = self.server_ref.catalog.have(key, digest, epoch, since, wait)
        if reply is None:
            return self._reply(404, b"model not held\n")
        self._reply(200, reply.to_json(), {"Content-Type": "application/json"})

    def _file(self, key: str, digest: str, ci: int) -> None:
        peer = self.server_ref
        span = parse_range(self.headers.get("Range"))
        if span is None:
            return self._reply(416, b"one byte range (bytes=a-b) is required\n")
        served = peer.catalog.range(key, digest, ci, *span)
        if served is None:
            return self._reply(404, b"range not held\n")
        if not peer.uploads.acquire(timeout=SLOT_WAIT):
            peer.on_reject("busy")
            return self._reply(503, b"every upload slot is busy\n", {"Retry-After": "1"})
        try:
            try:
                fd = os.open(served.path, os.O_RDONLY)
            except OSError:
                return self._reply(404, b"range not held\n")
            try:
                size = os.fstat(fd).st_size
                if size < served.end:
                    return self._reply(404, b"range not held\n")
                if callable(served.make_durable):
                    served.make_durable()
                count = served.end - served.start
                self.send_response(206)
                self.send_header("Content-Type", "application/octet-stream")
                self.send_header("Content-Length", str(count))
                self.send_header("Content-Range", f"bytes {served.start}-{served.end - 1}/{size}")
                self.end_headers()
                self._send_body(fd, served.start, count)
            finally:
                os.close(fd)
        finally:
            peer.uploads.release()

    def _send_body(self, fd: int, offset: int, count: int) -> None:
        peer = self.server_ref
        if ktls_send(self.connection):
            with os.fdopen(os.dup(fd), "rb") as f:
                while count > 0:
                    n = min(count, SEND_BLOCK)
                    peer.bucket.take(n)
                    sent = self.connection.sendfile(f, offset, n)
                    if not sent:
                        raise ConnectionError("sendfile sent nothing")
                    offset, count = offset + sent, count - sent
                    peer.on_upload(sent)
            peer.zero_copy_sends += 1
            return
        buf = bytearray(min(SEND_BLOCK, count))
        view = memoryview(buf)
        while count > 0:
            n = os.preadv(fd, [view[: min(len(view), count)]], offset)
            if n <= 0:
                raise ConnectionError(f"file ended at byte {offset}")
            peer.bucket.take(n)
            self.wfile.write(view[:n])
            offset, count = offset + n, count - n
            peer.on_upload(n)

    def _reply(self, code: int, body: bytes, headers: dict[str, str] | None = None) -> None:
        self.send_response(code)
        for k, v in (headers or {}).items():
            self.send_header(k, v)
        self.send_header("Content-Length", str(len(body)))
        if "Content-Type" not in (headers or {}):
            self.send_header("Content-Type", "text/plain; charset=utf-8")
        self.end_headers()
        self.wfile.write(body)

    def handle(self) -> None:
        with contextlib.suppress(OSError):  # a peer gone mid-reply (reset, timeout, TLS alert)
            super().handle()
