"""Talking to one peer: pinned-certificate TLS connections and the two requests, each bounded.

A peer's certificate is not checked against a CA: its SHA-256 fingerprint, published with its
endpoint in its LocalModelNode status, is pinned, checked after the handshake and before a byte
of the request (and of our token) is sent. Our own credential is a bearer token read from a file
that the kubelet rotates (a projected ServiceAccount token with the peer audience); it is read
again every minute.

Nothing a peer sends can hold a thread or memory beyond a bound (docs/peers.md, "Trust nothing
from a peer"):

- **Time.** Every request has a total deadline (the caller's: a piece's budget, a long poll's
  wait), checked between reads, and each read waits at most ``READ_TIMEOUT``; a peer that
  trickles one byte at a time is cut at the deadline, not after the last byte.
- **Bytes.** A reply head is at most ``MAX_HEAD`` bytes (h11 parses it); a piece must come with
  a ``Content-Length`` of exactly its size, a ``have`` reply with at most what the model's piece
  count needs, an error reply with at most ``MAX_SMALL_BODY`` (else the connection is closed
  instead of read to its end). Nothing is read past what was asked for.
- **Cancel.** A :class:`Cancel` shuts the request's socket down from another thread: a read
  blocked in the kernel returns at once (the engine's cancel and stall watchdog use it).
"""

from __future__ import annotations

import errno
import hashlib
import ipaddress
import os
import re
import select
import socket
import ssl
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import h11

from modelcache.peers.protocol import Geometry, HaveReply, file_path, have_path, max_have_bytes

#: Seconds to open a connection to a peer (TCP and TLS), and the longest silence within a reply.
CONNECT_TIMEOUT = 3.0
READ_TIMEOUT = 15.0
#: Largest reply head (status line and headers) read from a peer.
MAX_HEAD = 16 << 10
#: Largest error reply read to its end to keep the connection; a larger one closes it.
MAX_SMALL_BODY = 4 << 10
#: An idle pooled connection older than this is closed rather than reused (the server closes
#: idle connections after 30 s: one about to be closed would fail our next request).
IDLE_REUSE = 20.0
_RECV = 256 << 10
_CONTENT_RANGE = re.compile(r"bytes (\d+)-(\d+)/(\d+)")


class PeerError(Exception):
    """The peer failed this request (connection, timeout, an HTTP error): try another."""


class PeerBusy(PeerError):
    """Every upload slot of the peer is taken: ask another holder, or this one again later."""

    def __init__(self, message: str, retry_after: float = 1.0) -> None:
        super().__init__(message)
        self.retry_after = retry_after


class PeerGone(PeerError):
    """The peer does not hold (any more) what was asked: its download moved on or restarted."""


class PeerRefused(PeerError):
    """The peer refused our credential (401/403): not retried until the token changes."""


class PeerSlow(PeerError):
    """The reply did not complete within its deadline (a slow or trickling peer)."""


class PeerCancelled(PeerError):
    """The request was cancelled (the download's cancel or its stall watchdog)."""


@dataclass(frozen=True)
class PeerInfo:
    """A node that has, or is fetching, a model: what its LocalModelNode status says."""

    name: str
    host: str
    port: int
    #: SHA-256 (hex) of its certificate, DER: pinned for every connection.
    fingerprint: str
    zone: str = ""
    #: The listing digest it published for the model (None: it is still listing).
    digest: str | None = None
    #: It holds the whole model (Downloaded).
    complete: bool = False


class TokenFile:
    """The bearer token, read again once a minute (the kubelet replaces it before it expires)."""

    def __init__(self, path: Path, refresh: float = 60.0) -> None:
        self.path, self.refresh = path, refresh
        self._value, self._read_at = "", -1e9
        self._lock = threading.Lock()

    def __call__(self) -> str:
        with self._lock:
            if time.monotonic() - self._read_at >= self.refresh:
                try:
                    self._value = self.path.read_text().strip()
                except OSError:
                    pass  # keep the last one: a rotation replaces the file by a rename
                self._read_at = time.monotonic()
            return self._value


class Cancel:
    """Cancels the request it is given to, from any thread: its socket is shut down, so a read
    blocked in the kernel returns at once; a cancelled request fails with :class:`PeerCancelled`."""

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._sock: socket.socket | None = None
        self.cancelled = False

    def attach(self, sock: socket.socket | None) -> None:
        with self._lock:
            self._sock = sock
            if self.cancelled and sock is not None:
                _shutdown(sock)

    def cancel(self) -> None:
        with self._lock:
            self.cancelled = True
            if self._sock is not None:
                _shutdown(self._sock)


def _shutdown(sock: socket.socket) -> None:
    # The plain socket's shutdown, not SSLSocket's (which unwraps TLS first, racing the reader).
    try:
        socket.socket.shutdown(sock, socket.SHUT_RDWR)
    except OSError:
        pass


class _Conn:
    """One TLS connection to a peer, and bytes read past the last reply (none, normally)."""

    def __init__(self, sock: ssl.SSLSocket) -> None:
        self.sock = sock
        self.pending = b""
        self.idle_since = time.monotonic()

    def close(self) -> None:
        try:
            self.sock.close()
        except OSError:
            pass


@dataclass
class _Reply:
    status: int
    headers: dict[str, str]
    length: int | None  # Content-Length (None: none given)
    body: bytes  # the first body bytes, read with the head
    keep: bool  # the peer keeps the connection open after this reply
    #: A refusal (404, 503, ...) whose short body was read to its end: the connection is reusable.
    refusal_read: bool = False


class PeerClient:
    """Pinned TLS connections to peers (idle ones kept per address and certificate), and the
    two requests: ``have`` and ``read``."""

    def __init__(self, token: Callable[[], str], streams: int = 8) -> None:
        self.token = token
        self.streams = streams
        self._idle: dict[tuple[str, int, str], list[_Conn]] = {}
        self._lock = threading.Lock()
        # One context for every connection: no CA is consulted (the fingerprint is pinned).
        self._ssl = ssl.SSLContext(ssl.PROTOCOL_TLS_CLIENT)
        self._ssl.check_hostname = False
        self._ssl.verify_mode = ssl.CERT_NONE
        self._ssl.minimum_version = ssl.TLSVersion.TLSv1_2

    # ---- the two requests -------------------------------------------------------------------

    def have(self, peer: PeerInfo, key: str, digest: str, geometry: Geometry, epoch: str, since: int,
             wait: float, cancel: Cancel | None = None) -> HaveReply:
        """What ``peer`` holds of the model (a long poll of up to ``wait`` seconds). ``geometry``:
        how we cut the model, which bounds the reply's size and indices."""
        deadline = time.monotonic() + wait + READ_TIMEOUT
        limit = max_have_bytes(geometry.pieces)
        target = f"{have_path(key, digest)}?epoch={epoch}&since={since}&wait={wait:.1f}"
        conn, reply = self._request(peer, target, {}, deadline, cancel)
        body = bytearray()
        with _Finish(self, peer, conn, reply):
            self._check(peer, conn, reply, 200)
            if reply.length is None or reply.length > limit:
                raise PeerError(f"{peer.name}: have reply of {reply.length} bytes, more than the {limit} a model of "
                                f"{geometry.pieces} pieces needs")
            body = bytearray(reply.length)
            self._body(peer, conn, reply, memoryview(body), deadline, cancel)
        try:
            return HaveReply.from_json(bytes(body), geometry)
        except ValueError as exc:
            raise PeerError(f"{peer.name}: malformed reply ({exc})") from exc

    def read(self, peer: PeerInfo, key: str, digest: str, file: int, start: int, end: int, view: memoryview,
             deadline: float, cancel: Cancel | None = None) -> int:
        """Read ``[start, end)`` of file ``file`` into ``view`` by ``deadline`` (monotonic);
        returns the byte count (== end - start)."""
        want = end - start
        conn, reply = self._request(peer, file_path(key, digest, file), {"Range": f"bytes={start}-{end - 1}"},
                                    deadline, cancel)
        with _Finish(self, peer, conn, reply):
            self._check(peer, conn, reply, 206)
            m = _CONTENT_RANGE.fullmatch(reply.headers.get("content-range", ""))
            if m is None or (int(m.group(1)), int(m.group(2))) != (start, end - 1):
                raise PeerError(f"{peer.name}: answered another range ({reply.headers.get('content-range')!r})")
            if reply.length != want:
                raise PeerError(f"{peer.name}: a piece of {want} bytes came with Content-Length {reply.length}")
            self._body(peer, conn, reply, view[:want], deadline, cancel)
        return want

    # ---- one request, one reply -------------------------------------------------------------------

    def _request(self, peer: PeerInfo, target: str, extra: dict[str, str], deadline: float,
                 cancel: Cancel | None) -> tuple[_Conn, _Reply]:
        headers = {"Host": f"{peer.host}:{peer.port}", "Authorization": f"Bearer {self.token()}",
                   "User-Agent": "modelcache-agent-peer", **extra}
        for attempt in (0, 1):
            conn = self._take(peer) if attempt == 0 else None
            reused = conn is not None
            if conn is None:
                conn = self._connect(peer, deadline, cancel)
            try:
                return conn, self._exchange(peer, conn, target, headers, deadline, cancel)
            except _StaleConnection:
                conn.close()
                if not reused:
                    raise PeerError(f"{peer.name}: connection closed before a reply") from None
            except BaseException:
                conn.close()
                raise
            finally:
                if cancel is not None:
                    cancel.attach(None)
        raise AssertionError("unreachable")

    def _connect(self, peer: PeerInfo, deadline: float, cancel: Cancel | None) -> _Conn:
        if cancel is not None and cancel.cancelled:
            raise PeerCancelled(f"{peer.name}: cancelled")
        raw = _open(peer, min(deadline, time.monotonic() + CONNECT_TIMEOUT), cancel)
        try:
            raw.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
            if cancel is not None:
                cancel.attach(raw)
            # The handshake has one total deadline (CPython's): a trickled handshake is cut.
            raw.settimeout(_remaining(peer, deadline, CONNECT_TIMEOUT))
            sock = self._ssl.wrap_socket(raw, server_hostname=None)
        except (OSError, ssl.SSLError) as exc:
            raw.close()
            if cancel is not None and cancel.cancelled:
                raise PeerCancelled(f"{peer.name}: cancelled") from exc
            raise PeerError(f"{peer.name}: TLS handshake failed: {exc}") from exc
        der = sock.getpeercert(binary_form=True) or b""
        if hashlib.sha256(der).hexdigest() != peer.fingerprint.replace(":", "").lower():
            sock.close()
            raise PeerError(f"{peer.name}: Fingerprints did not match: its certificate is not the one its status "
                            "names (nothing was sent)")
        return _Conn(sock)

    def _exchange(self, peer: PeerInfo, conn: _Conn, target: str, headers: dict[str, str], deadline: float,
                  cancel: Cancel | None) -> _Reply:
        if cancel is not None:
            cancel.attach(conn.sock)
            if cancel.cancelled:
                raise PeerCancelled(f"{peer.name}: cancelled")
        proto = h11.Connection(h11.CLIENT, max_incomplete_event_size=MAX_HEAD)
        data = proto.send(h11.Request(method="GET", target=target, headers=list(headers.items())))
        data += proto.send(h11.EndOfMessage()) or b""
        heard = False
        try:
            conn.sock.settimeout(_remaining(peer, deadline, READ_TIMEOUT))
            conn.sock.sendall(data)
            if conn.pending:
                proto.receive_data(conn.pending)
                conn.pending = b""
            while True:
                try:
                    event = proto.next_event()
                except h11.RemoteProtocolError as exc:
                    raise PeerError(f"{peer.name}: malformed reply head ({exc})") from exc
                if event is h11.NEED_DATA:
                    conn.sock.settimeout(_remaining(peer, deadline, READ_TIMEOUT))
                    chunk = conn.sock.recv(_RECV)
                    if not chunk:
                        if not heard:
                            raise _StaleConnection()
                        raise PeerError(f"{peer.name}: connection ended within the reply head")
                    heard = True
                    proto.receive_data(chunk)
                    continue
                if isinstance(event, h11.InformationalResponse):
                    continue
                if not isinstance(event, h11.Response):
                    raise PeerError(f"{peer.name}: unexpected reply ({type(event).__name__})")
                break
        except TimeoutError as exc:
            raise self._late(peer, deadline, cancel) from exc
        except (ConnectionResetError, BrokenPipeError, ssl.SSLEOFError) as exc:
            if cancel is not None and cancel.cancelled:
                raise PeerCancelled(f"{peer.name}: cancelled") from exc
            if not heard:
                raise _StaleConnection() from exc
            raise PeerError(f"{peer.name}: {type(exc).__name__}: {exc}") from exc
        except (OSError, ssl.SSLError) as exc:
            if cancel is not None and cancel.cancelled:
                raise PeerCancelled(f"{peer.name}: cancelled") from exc
            raise PeerError(f"{peer.name}: {type(exc).__name__}: {exc}") from exc
        hdrs = {k.decode("latin-1").lower(): v.decode("latin-1") for k, v in event.headers}
        body, _closed = proto.trailing_data
        length: int | None = None
        if "content-length" in hdrs:
            length = int(hdrs["content-length"])  # h11 checked it is one non-negative integer
        keep = (event.http_version == b"1.1" and "close" not in hdrs.get("connection", "").lower()
                and "transfer-encoding" not in hdrs and length is not None)
        return _Reply(event.status_code, hdrs, length, bytes(body), keep)

    def _body(self, peer: PeerInfo, conn: _Conn, reply: _Reply, view: memoryview, deadline: float,
              cancel: Cancel | None) -> None:
        """Read exactly ``len(view)`` body bytes by ``deadline``; bytes past them are kept for
        the next reply on the connection."""
        want = len(view)
        first = reply.body[:want]
        view[: len(first)] = first
        conn.pending = reply.body[want:]
        got = len(first)
        if cancel is not None:
            cancel.attach(conn.sock)
        try:
            while got < want:
                if cancel is not None and cancel.cancelled:
                    raise PeerCancelled(f"{peer.name}: cancelled")
                conn.sock.settimeout(_remaining(peer, deadline, READ_TIMEOUT))
                n = conn.sock.recv_into(view[got:], min(want - got, _RECV))
                if not n:
                    if cancel is not None and cancel.cancelled:
                        raise PeerCancelled(f"{peer.name}: cancelled")
                    raise PeerError(f"{peer.name}: connection ended after {got} of {want} bytes")
                got += n
        except TimeoutError as exc:
            raise self._late(peer, deadline, cancel, f" ({got} of {want} bytes)") from exc
        except (OSError, ssl.SSLError) as exc:
            if cancel is not None and cancel.cancelled:
                raise PeerCancelled(f"{peer.name}: cancelled") from exc
            raise PeerError(f"{peer.name}: {type(exc).__name__}: {exc}") from exc
        finally:
            if cancel is not None:
                cancel.attach(None)

    @staticmethod
    def _late(peer: PeerInfo, deadline: float, cancel: Cancel | None, detail: str = "") -> PeerError:
        if cancel is not None and cancel.cancelled:
            return PeerCancelled(f"{peer.name}: cancelled")
        if time.monotonic() >= deadline - 0.01:
            return PeerSlow(f"{peer.name}: no complete reply by its deadline{detail}")
        return PeerError(f"{peer.name}: no byte for {READ_TIMEOUT:.0f}s{detail}")

    def _check(self, peer: PeerInfo, conn: _Conn, reply: _Reply, ok: int) -> None:
        if reply.status == ok:
            return
        # A short error body is read so the connection serves the next request; a long one is not.
        if reply.length is not None and reply.length <= MAX_SMALL_BODY and reply.keep:
            try:
                self._body(peer, conn, reply, memoryview(bytearray(reply.length)), time.monotonic() + 2.0, None)
                reply.refusal_read = True
            except PeerError:
                pass
        if reply.status == 503:
            try:
                retry = float(reply.headers.get("retry-after", "1"))
            except ValueError:
                retry = 1.0
            raise PeerBusy(f"{peer.name}: every upload slot is busy", min(max(retry, 0.1), 30.0))
        if reply.status in (404, 416):
            raise PeerGone(f"{peer.name}: does not hold it (any more)")
        if reply.status in (401, 403):
            raise PeerRefused(f"{peer.name}: refused our peer credential ({reply.status}); check --peer-token-file")
        raise PeerError(f"{peer.name}: answered HTTP {reply.status}")

    # ---- the pool --------------------------------------------------------------------------------

    @staticmethod
    def _key(peer: PeerInfo) -> tuple[str, int, str]:
        return (peer.host, peer.port, peer.fingerprint)

    def _take(self, peer: PeerInfo) -> _Conn | None:
        now = time.monotonic()
        with self._lock:
            idle = self._idle.get(self._key(peer)) or []
            while idle:
                conn = idle.pop()
                if now - conn.idle_since < IDLE_REUSE:
                    return conn
                conn.close()
        return None

    def _release(self, peer: PeerInfo, conn: _Conn, reply: _Reply, clean: bool) -> None:
        """Back to the pool if the reply was read to its end and the peer keeps the connection."""
        if not (clean and reply.keep) or conn.sock.fileno() < 0:
            conn.close()
            return
        conn.idle_since = time.monotonic()
        with self._lock:
            idle = self._idle.setdefault(self._key(peer), [])
            if len(idle) < self.streams + 2:
                idle.append(conn)
                return
        conn.close()

    def close(self) -> None:
        with self._lock:
            pools, self._idle = list(self._idle.values()), {}
        for idle in pools:
            for conn in idle:
                conn.close()


class _Finish:
    """Ends a request: its connection back to the pool when the reply was read whole and cleanly,
    closed otherwise (an error, a cut, a refused reply with a long body)."""

    def __init__(self, client: PeerClient, peer: PeerInfo, conn: _Conn, reply: _Reply) -> None:
        self.client, self.peer, self.conn, self.reply = client, peer, conn, reply

    def __enter__(self) -> _Finish:
        return self

    def __exit__(self, kind: object, exc: BaseException | None, tb: object) -> None:
        self.client._release(self.peer, self.conn, self.reply, clean=exc is None or self.reply.refusal_read)


class _StaleConnection(Exception):
    """A pooled connection the peer had closed: the request is sent again on a new one."""


def _resolve(peer: PeerInfo, deadline: float, cancel: Cancel | None) -> tuple[Any, ...]:
    """The peer's address by ``deadline``, given up at once on cancel. An address is used as it
    is; a name (``--peer-address HOST``) is looked up in a thread of its own: getaddrinfo cannot
    be interrupted, and a name whose DNS server does not answer holds it 5 s per try and server
    (glibc's resolver), which a peer that publishes such a name would make every read wait."""
    try:
        ipaddress.ip_address(peer.host)
    except ValueError:
        pass
    else:
        return socket.getaddrinfo(peer.host, peer.port, type=socket.SOCK_STREAM, flags=socket.AI_NUMERICHOST)[0]
    found: list[Any] = []
    done = threading.Event()

    def lookup() -> None:
        try:
            found.append(socket.getaddrinfo(peer.host, peer.port, type=socket.SOCK_STREAM)[0])
        except OSError as exc:
            found.append(exc)
        done.set()

    threading.Thread(target=lookup, name=f"peer-resolve-{peer.name}", daemon=True).start()
    while not done.wait(0.1):
        if cancel is not None and cancel.cancelled:
            raise PeerCancelled(f"{peer.name}: cancelled")
        if time.monotonic() >= deadline:
            raise PeerError(f"{peer.name}: cannot resolve {peer.host} within {CONNECT_TIMEOUT:.0f}s")
    if isinstance(found[0], OSError):
        raise PeerError(f"{peer.name}: cannot resolve {peer.host}: {found[0]}")
    return tuple(found[0])


def _open(peer: PeerInfo, deadline: float, cancel: Cancel | None) -> socket.socket:
    """A TCP connection by ``deadline``, given up at once on cancel (a blocking connect cannot
    be interrupted: this one waits in slices of 0.1 s)."""
    family, kind, proto, _, addr = _resolve(peer, deadline, cancel)
    sock = socket.socket(family, kind, proto)
    try:
        sock.setblocking(False)
        err = sock.connect_ex(addr)
        poller = select.poll()  # not select(): an agent may hold more than 1024 descriptors
        poller.register(sock, select.POLLOUT)
        while err in (errno.EINPROGRESS, errno.EALREADY, errno.EWOULDBLOCK):
            if cancel is not None and cancel.cancelled:
                raise PeerCancelled(f"{peer.name}: cancelled")
            left = deadline - time.monotonic()
            if left <= 0:
                raise PeerError(f"{peer.name}: cannot connect to {peer.host}:{peer.port} within {CONNECT_TIMEOUT:.0f}s")
            if poller.poll(int(min(0.1, left) * 1000) + 1):
                err = sock.getsockopt(socket.SOL_SOCKET, socket.SO_ERROR)
                break
        if err:
            raise PeerError(f"{peer.name}: cannot connect to {peer.host}:{peer.port}: {os.strerror(err)}")
        sock.setblocking(True)
        return sock
    except BaseException:
        sock.close()
        raise


def _remaining(peer: PeerInfo, deadline: float, cap: float) -> float:
    left = deadline - time.monotonic()
    if left <= 0:
        raise PeerSlow(f"{peer.name}: no complete reply by its deadline")
    return min(left, cap)
