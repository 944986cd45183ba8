"""The peer server: other agents read pieces of this node's models from it, over TLS only.

Every request must carry a bearer token that ``authorize`` accepts (the agent checks it with a
Kubernetes TokenReview: a ServiceAccount token of the agents, for the peer audience); without
one the answer is 401, with another identity's 403. No anonymous read of model weights.

Serving never starves the node: at most ``max_uploads`` file reads run at once (more wait half
a second for a slot, then get 503 with ``Retry-After`` and ask another holder), one client
holds all but one of them at most, and ``upload_rate`` bytes/s caps all of them together.

Anyone who reaches the port costs a bounded share of the node (docs/peers.md, "Limits and
costs"): connections are capped in total and per client address, and a new one beyond a cap
closes the oldest connection that has not yet authenticated (or, if there is none, is closed
itself); a connection has ``HANDSHAKE_TIMEOUT`` for its TLS handshake and ``HEAD_TIMEOUT`` for
its first request head (each a total, not per read), a kept-alive one ``IDLE_TIMEOUT`` for the
whole of its next one; a head is at most ``MAX_HEAD`` bytes; a refused credential closes the
connection, and an address that keeps sending refused credentials is refused without a check
for a while. An upload has a deadline too (a reader that stops reading frees its slot).

Zero-copy: a connection whose TLS the kernel does (kTLS: Python 3.14+ with OpenSSL 3 built for
it and the kernel's ``tls`` module) sends file ranges with ``sendfile``. Elsewhere TLS is done
in user space, where sendfile cannot apply: the range is read with ``preadv`` into one reused
buffer per upload and written to the TLS socket (one copy).
"""

from __future__ import annotations

import contextlib
import io
import logging
import os
import socket
import ssl
import threading
import time
from collections.abc import Callable
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from typing import Any, Protocol
from urllib.parse import parse_qs, urlsplit

from modelcache.peers.local import ServedRange, open_beneath
from modelcache.peers.protocol import MAX_WAIT, HaveReply, parse_path, parse_range

log = logging.getLogger("modelcache.peers.server")

#: Seconds for a new connection's TLS handshake, then for its first request head (each whole),
#: and for a kept-alive connection's next request head (whole, from the end of the last reply).
HANDSHAKE_TIMEOUT = 10.0
HEAD_TIMEOUT = 10.0
IDLE_TIMEOUT = 30.0
#: Largest request head (request line and headers) read from a client.
MAX_HEAD = 16 << 10
#: Connections at once in total and per client address (a downloading peer keeps a poll and up
#: to --workers piece reads per model open: 32 leaves room for three models at once).
MAX_CONNECTIONS, MAX_PER_CLIENT = 256, 32
#: An upload is given at least UPLOAD_MIN_TIME, and bytes / UPLOAD_MIN_RATE: a reader that stops
#: reading frees its slot (readers give up sooner themselves: 1 MiB/s, client.py).
UPLOAD_MIN_TIME, UPLOAD_MIN_RATE = 30.0, 64 << 10
#: Refused credentials from one address within REFUSALS_WINDOW s, after which its requests are
#: refused for that long without a check (each check is a TokenReview against the API server).
REFUSALS, REFUSALS_WINDOW = 20, 60.0
SEND_BLOCK = 256 << 10
#: How long a request waits for an upload slot before it is answered 503 (busy): short, so the
#: peer asks another holder soon, but long enough to spare it a round trip per piece.
SLOT_WAIT = 0.5
#: Verdicts of ``authorize``: THROTTLED means "cannot check now" (503, asked again soon).
OK, UNAUTHENTICATED, FORBIDDEN, THROTTLED = "ok", "unauthenticated", "forbidden", "throttled"


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


class _Entry:
    """One open connection: its socket (shut down to evict it), address, and whether a request
    of it authenticated (then it is never evicted for a newcomer)."""

    __slots__ = ("accepted", "addr", "authed", "sock")

    def __init__(self, sock: socket.socket, addr: str) -> None:
        self.sock, self.addr = sock, addr
        self.accepted = time.monotonic()
        self.authed = False


class _Gate:
    """Connections at once: at most ``total``, and ``per_client`` per address. A newcomer past
    a cap evicts the oldest unauthenticated connection (of its address, for the per-address
    cap): a flood of idle connections cannot keep an agent out."""

    def __init__(self, total: int, per_client: int) -> None:
        self.total, self.per_client = total, per_client
        self._lock = threading.Lock()
        self._open: dict[int, _Entry] = {}  # in the order they came

    def admit(self, sock: socket.socket, addr: str) -> _Entry | None:
        victims: list[_Entry] = []
        with self._lock:
            mine = [e for e in self._open.values() if e.addr == addr]
            if len(mine) >= self.per_client:
                victim = next((e for e in mine if not e.authed), None)
                if victim is None:
                    return None
                victims.append(victim)
            if len(self._open) - len(victims) >= self.total:
                victim = next((e for e in self._open.values() if not e.authed and e not in victims), None)
                if victim is None:
                    return None
                victims.append(victim)
            for victim in victims:
                del self._open[id(victim)]
            entry = _Entry(sock, addr)
            self._open[id(entry)] = entry
        for victim in victims:
            _shutdown(victim.sock)
        return entry

    def leave(self, entry: _Entry) -> None:
        with self._lock:
            self._open.pop(id(entry), None)

    def count(self) -> int:
        with self._lock:
            return len(self._open)


class _Refusals:
    """Addresses that keep sending refused credentials: refused without a check for a while."""

    def __init__(self, limit: int = REFUSALS, window: float = REFUSALS_WINDOW) -> None:
        self.limit, self.window = limit, window
        self._lock = threading.Lock()
        self._seen: dict[str, list[float]] = {}

    def blocked(self, addr: str) -> bool:
        now = time.monotonic()
        with self._lock:
            times = [t for t in self._seen.get(addr, ()) if now - t < self.window]
            if times:
                self._seen[addr] = times
            else:
                self._seen.pop(addr, None)
            return len(times) >= self.limit

    def refused(self, addr: str) -> None:
        with self._lock:
            if len(self._seen) > 4096:  # junk from many addresses: forget the oldest
                self._seen.pop(next(iter(self._seen)))
            self._seen.setdefault(addr, []).append(time.monotonic())


def _shutdown(sock: socket.socket) -> None:
    try:
        socket.socket.shutdown(sock, socket.SHUT_RDWR)  # the plain socket's: a blocked read returns
    except OSError:
        pass


class _HeadReader(io.RawIOBase):
    """The connection's reads for ``rfile``: each waits at most until ``deadline`` (a total for
    the request head, not a per-read timeout a trickling client could renew byte by byte), and
    at most ``budget`` bytes are read until the head is whole (then both are lifted)."""

    def __init__(self, sock: socket.socket) -> None:
        self.sock = sock
        self.deadline = time.monotonic() + HEAD_TIMEOUT
        self.budget = MAX_HEAD

    def readable(self) -> bool:
        return True

    def readinto(self, buf: Any) -> int:
        left = self.deadline - time.monotonic()
        if left <= 0:
            raise TimeoutError("request head not complete in time")
        if self.budget <= 0:
            raise ConnectionError("request head too large")
        self.sock.settimeout(min(left, IDLE_TIMEOUT))
        view = memoryview(buf)
        n = self.sock.recv_into(view[: min(len(view), self.budget)])
        self.budget -= n
        return n


class _Writer(io.BufferedIOBase):
    """``wfile``: every write sent whole (``sendall``), under the socket's current timeout."""

    def __init__(self, sock: socket.socket) -> None:
        self.sock = sock

    def writable(self) -> bool:
        return True

    def write(self, data: Any) -> int:
        self.sock.sendall(data)
        return len(data)


class PeerServer:
    def __init__(self, host: str, port: int, context: ssl.SSLContext, catalog: Catalog,
                 authorize: Callable[[str], str], max_uploads: int = 4, upload_rate: int = 0,
                 on_upload: Callable[[int], None] | None = None,
                 on_reject: Callable[[str], None] | None = None,
                 on_poll: Callable[[], None] | None = None,
                 max_connections: int = MAX_CONNECTIONS, max_per_client: int = MAX_PER_CLIENT) -> None:
        self.catalog, self.authorize = catalog, authorize
        self.max_uploads = max(1, max_uploads)
        self.bucket = TokenBucket(upload_rate)
        self.on_upload = on_upload or (lambda n: None)
        self.on_reject = on_reject or (lambda reason: None)
        self.on_poll = on_poll or (lambda: None)
        self.zero_copy_sends = 0
        self.gate = _Gate(max(1, max_connections), max(1, max_per_client))
        self.refusals = _Refusals()
        self._uploading: dict[str, int] = {}  # client address -> uploads it holds
        self._slots = threading.Condition()
        outer = self

        class Server(ThreadingHTTPServer):
            daemon_threads = True
            allow_reuse_address = True
            request_queue_size = 128

            def process_request(self, request: Any, client_address: Any) -> None:
                # Before a thread is made: past the caps, the oldest unauthenticated connection
                # goes (or this one does).
                entry = outer.gate.admit(request, str(client_address[0]))
                if entry is None:
                    outer.on_reject("connections")
                    self.shutdown_request(request)
                    return
                try:
                    threading.Thread(target=self._serve, args=(request, client_address, entry),
                                     name="peer-conn", daemon=True).start()
                except RuntimeError:  # no thread to be had (a pids limit): this one waits its turn
                    outer.gate.leave(entry)
                    self.shutdown_request(request)

            def _serve(self, request: Any, client_address: Any, entry: _Entry) -> None:
                try:
                    self.finish_request(request, client_address, entry)
                except Exception:
                    pass
                finally:
                    outer.gate.leave(entry)
                    self.shutdown_request(request)

            def finish_request(self, request: Any, client_address: Any, entry: Any = None) -> None:
                request.settimeout(HANDSHAKE_TIMEOUT)  # one total deadline in CPython's handshake
                # A reply is its head, then its body, two sends: with Nagle's algorithm the body
                # waits for the head's ACK, which the client delays (40 ms on Linux): every poll
                # took 48 ms on localhost (bench/poll_cost.py), and every piece paid it once.
                with contextlib.suppress(OSError):
                    request.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
                try:
                    conn = context.wrap_socket(request, server_side=True)
                except (ssl.SSLError, OSError):
                    outer.on_reject("tls")
                    return
                if entry is not None:
                    entry.sock = conn
                try:
                    outer._handler_class(conn, client_address, self, entry)
                finally:
                    with contextlib.suppress(OSError):
                        conn.close()

        class Handler(_Handler):
            server_ref = outer

        self._handler_class = Handler
        self.httpd = Server((host, port), Handler)
        self.port: int = self.httpd.server_address[1]
        self._thread = threading.Thread(target=self.httpd.serve_forever, name="peer-server", daemon=True)

    def start(self) -> PeerServer:
        self._thread.start()
        return self

    def stop(self) -> None:
        self.httpd.shutdown()
        self.httpd.server_close()

    def take_upload(self, addr: str) -> bool:
        """An upload slot for a request of ``addr``, which holds all but one of them at most (one
        node, or one slow reader, never takes every slot); waits ``SLOT_WAIT`` at most."""
        deadline = time.monotonic() + SLOT_WAIT
        with self._slots:
            while sum(self._uploading.values()) >= self.max_uploads or (
                    self.max_uploads > 1 and self._uploading.get(addr, 0) >= self.max_uploads - 1):
                left = deadline - time.monotonic()
                if left <= 0:
                    return False
                self._slots.wait(left)
            self._uploading[addr] = self._uploading.get(addr, 0) + 1
            return True

    def release_upload(self, addr: str) -> None:
        with self._slots:
            left = self._uploading.get(addr, 0) - 1
            if left > 0:
                self._uploading[addr] = left
            else:
                self._uploading.pop(addr, None)
            self._slots.notify_all()

    @property
    def uploads_in_flight(self) -> int:
        with self._slots:
            return sum(self._uploading.values())


def _read_exactly(fd: int, start: int, end: int) -> None:
    """Read ahead the range about to be served, and nothing past it. The kernel's own readahead
    runs on into the rest of the file, which in a download in flight is preallocated and not yet
    written: ext4 zeroes a page-cache page for every block of it (which the engine's O_DIRECT
    write then invalidates). In bench/fleet.py's 16 agents (perf) that zeroing, under the peer
    server's preadv, was 6 % of an agent's CPU."""
    with contextlib.suppress(OSError, AttributeError):  # no posix_fadvise here: the default readahead
        os.posix_fadvise(fd, 0, 0, os.POSIX_FADV_RANDOM)
        os.posix_fadvise(fd, start, end - start, os.POSIX_FADV_WILLNEED)


class _Handler(BaseHTTPRequestHandler):
    protocol_version = "HTTP/1.1"
    server_ref: PeerServer
    _headers_buffer: list[bytes]  # BaseHTTPRequestHandler's: the reply head, sent by flush_headers

    def __init__(self, request: Any, client_address: Any, server: Any, entry: _Entry | None = None) -> None:
        self.entry = entry
        self.first = True
        super().__init__(request, client_address, server)

    def setup(self) -> None:
        # Not StreamRequestHandler's: its rfile would read without a deadline or a size limit.
        self.connection = self.request
        self.reader = _HeadReader(self.connection)
        self.rfile = io.BufferedReader(self.reader, 4096)
        self.wfile = _Writer(self.connection)

    def handle_one_request(self) -> None:
        # The next head must come whole by its deadline: the first within HEAD_TIMEOUT of the
        # handshake, a kept-alive one within IDLE_TIMEOUT of the last reply.
        self.reader.deadline = time.monotonic() + (HEAD_TIMEOUT if self.first else IDLE_TIMEOUT)
        self.reader.budget = MAX_HEAD
        self.first = False
        super().handle_one_request()

    def parse_request(self) -> bool:
        ok = super().parse_request()
        # The head is read: a GET has no body, so nothing more is read until the next request.
        self.reader.deadline, self.reader.budget = time.monotonic() + IDLE_TIMEOUT, MAX_HEAD
        return ok

    def log_message(self, *args: object) -> None:  # every piece is a request: not worth a line
        pass

    @property
    def addr(self) -> str:
        return str(self.client_address[0])

    def do_GET(self) -> None:
        peer = self.server_ref
        url = urlsplit(self.path)
        route = parse_path(url.path)
        if route is None:
            return self._reply(404, b"not found\n")
        auth = self.headers.get("Authorization", "")
        token = auth[7:].strip() if auth[:7].lower() == "bearer " else ""
        blocked = not token or peer.refusals.blocked(self.addr)
        verdict = UNAUTHENTICATED if blocked else peer.authorize(token)
        if verdict == OK:
            if self.entry is not None:
                self.entry.authed = True
        elif verdict == THROTTLED:
            peer.on_reject("throttled")
            return self._reply(503, b"cannot check credentials now\n", {"Retry-After": "1"})
        else:
            peer.on_reject(verdict)
            peer.refusals.refused(self.addr)
            self.close_connection = True  # a refused client keeps no thread
            if verdict == FORBIDDEN:
                return self._reply(403, b"forbidden: not a modelcache agent\n", {"Connection": "close"})
            return self._reply(401, b"a modelcache agent's peer token is required\n",
                               {"WWW-Authenticate": 'Bearer realm="modelcache-peer"', "Connection": "close"})
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
        self.server_ref.on_poll()
        self._reply(200, reply.to_json(), {"Content-Type": "application/json"})

    def _file(self, key: str, digest: str, ci: int) -> None:
        peer = self.server_ref
        span = parse_range(self.headers.get("Range"))
        if span is None:
            return self._reply(416, b"one byte range (bytes=a-b) is required\n")
        served = peer.catalog.range(key, digest, ci, *span)
        if served is None:
            return self._reply(404, b"range not held\n")
        if not peer.take_upload(self.addr):
            peer.on_reject("busy")
            return self._reply(503, b"every upload slot is busy\n", {"Retry-After": "1"})
        try:
            try:
                fd = open_beneath(served.root, served.rel)
            except OSError:
                return self._reply(404, b"range not held\n")
            try:
                size = os.fstat(fd).st_size
                if size < served.end or (served.size is not None and size != served.size):
                    return self._reply(404, b"range not held\n")
                _read_exactly(fd, served.start, served.end)
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
            peer.release_upload(self.addr)

    def _send_body(self, fd: int, offset: int, count: int) -> None:
        peer = self.server_ref
        deadline = time.monotonic() + max(UPLOAD_MIN_TIME, count / UPLOAD_MIN_RATE)

        def in_time() -> None:
            left = deadline - time.monotonic()
            if left <= 0:
                raise TimeoutError("upload not read in time")
            self.connection.settimeout(min(left, IDLE_TIMEOUT))

        if ktls_send(self.connection):
            with os.fdopen(os.dup(fd), "rb") as f:
                while count > 0:
                    n = min(count, SEND_BLOCK)
                    peer.bucket.take(n)
                    in_time()
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
            in_time()
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
        if self.request_version == "HTTP/0.9":
            self.end_headers()
            self.wfile.write(body)
            return
        # The head's blank line and the body in one send (end_headers, then the body, was two TLS
        # records, two wake-ups of the reader): a poll's reply is one record.
        self._headers_buffer.extend((b"\r\n", body))
        self.flush_headers()

    def handle(self) -> None:
        with contextlib.suppress(OSError, ValueError):  # a peer gone mid-reply (reset, timeout, TLS alert)
            super().handle()
