"""Talking to one peer: a pinned-certificate TLS connection pool and the two requests.

A peer's certificate is not checked against a CA: its SHA-256 fingerprint, published with its
endpoint in its LocalModelNode status, is pinned (urllib3 ``assert_fingerprint``), checked after
the handshake and before a byte of the request (and of our token) is sent. Our own credential
is a bearer token read from a file that the kubelet rotates (a projected ServiceAccount token
with the peer audience); it is read again every minute.
"""

from __future__ import annotations

import contextlib
import ssl
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

import urllib3
from urllib3.exceptions import HTTPError

from modelcache.peers.protocol import HaveReply, file_path, have_path

#: Seconds to open a connection to a peer, and without a byte once connected.
CONNECT_TIMEOUT = 3.0
READ_TIMEOUT = 15.0


class PeerError(Exception):
    """The peer failed this request (connection, timeout, an HTTP error): try another."""


class PeerBusy(PeerError):
    """Every upload slot of the peer is taken: ask another holder, or this one again later."""


class PeerGone(PeerError):
    """The peer does not hold (any more) what was asked: its download moved on or restarted."""


class PeerRefused(PeerError):
    """The peer refused our credential (401/403): not retried until the token changes."""


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


class PeerClient:
    """Connection pools to peers, one per (address, certificate)."""

    def __init__(self, token: Callable[[], str], streams: int = 8) -> None:
        self.token = token
        self.streams = streams
        self._pools: dict[tuple[str, int, str], urllib3.HTTPSConnectionPool] = {}
        self._lock = threading.Lock()
        # One context for every connection: no CA is consulted (the fingerprint is pinned), and
        # urllib3 would otherwise build one per connection, loading the system's CAs each time.
        self._ssl = ssl.SSLContext(ssl.PROTOCOL_TLS_CLIENT)
        self._ssl.check_hostname = False
        self._ssl.verify_mode = ssl.CERT_NONE
        self._ssl.minimum_version = ssl.TLSVersion.TLSv1_2

    def _pool(self, peer: PeerInfo) -> urllib3.HTTPSConnectionPool:
        key = (peer.host, peer.port, peer.fingerprint)
        with self._lock:
            pool = self._pools.get(key)
            if pool is None:
                pool = self._pools[key] = urllib3.HTTPSConnectionPool(
                    peer.host, peer.port, maxsize=self.streams + 2, block=False, retries=False,
                    timeout=urllib3.Timeout(connect=CONNECT_TIMEOUT, read=READ_TIMEOUT),
                    cert_reqs="CERT_NONE", assert_hostname=False, assert_fingerprint=peer.fingerprint,
                    ssl_context=self._ssl)
            return pool

    def _headers(self) -> dict[str, str]:
        return {"Authorization": f"Bearer {self.token()}", "User-Agent": "modelcache-agent-peer"}

    def have(self, peer: PeerInfo, key: str, digest: str, files: int, epoch: str, since: int,
             wait: float) -> HaveReply:
        query = f"?epoch={epoch}&since={since}&wait={wait:.1f}"
        timeout = urllib3.Timeout(connect=CONNECT_TIMEOUT, read=wait + READ_TIMEOUT)
        try:
            resp = self._pool(peer).urlopen("GET", have_path(key, digest) + query, headers=self._headers(),
                                            timeout=timeout, preload_content=True, redirect=False)
        except (HTTPError, OSError) as exc:
            raise PeerError(f"{peer.name}: {type(exc).__name__}: {exc}") from exc
        self._check(peer, resp.status, 200)
        try:
            return HaveReply.from_json(resp.data[: 64 << 20], files)
        except ValueError as exc:
            raise PeerError(f"{peer.name}: malformed reply ({exc})") from exc

    def read(self, peer: PeerInfo, key: str, digest: str, file: int, start: int, end: int, view: memoryview) -> int:
        """Read ``[start, end)`` of file ``file`` into ``view``; returns the byte count (== end - start)."""
        headers = {**self._headers(), "Range": f"bytes={start}-{end - 1}"}
        try:
            resp = self._pool(peer).urlopen("GET", file_path(key, digest, file), headers=headers,
                                            preload_content=False, redirect=False)
        except (HTTPError, OSError) as exc:
            raise PeerError(f"{peer.name}: {type(exc).__name__}: {exc}") from exc
        done = False
        try:
            self._check(peer, resp.status, 206)
            want = end - start
            if not str(resp.headers.get("Content-Range", "")).startswith(f"bytes {start}-{end - 1}/"):
                raise PeerError(f"{peer.name}: answered another range ({resp.headers.get('Content-Range')!r})")
            got = 0
            while got < want:
                n = resp.readinto(view[got:want])
                if not n:
                    raise PeerError(f"{peer.name}: connection ended after {got} of {want} bytes")
                got += n
            done = True
            return got
        except (HTTPError, OSError) as exc:
            raise PeerError(f"{peer.name}: {type(exc).__name__}: {exc}") from exc
        finally:
            if done or resp.status in (404, 416, 503):
                with contextlib.suppress(HTTPError, OSError):
                    resp.drain_conn()  # a short answer: the connection serves the next request
                resp.release_conn()
            else:
                resp.close()

    @staticmethod
    def _check(peer: PeerInfo, status: int, ok: int) -> None:
        if status == ok:
            return
        if status == 503:
            raise PeerBusy(f"{peer.name}: every upload slot is busy")
        if status in (404, 416):
            raise PeerGone(f"{peer.name}: does not hold it (any more)")
        if status in (401, 403):
            raise PeerRefused(f"{peer.name}: refused our peer credential ({status}); check --peer-token-file")
        raise PeerError(f"{peer.name}: answered HTTP {status}")

    def close(self) -> None:
        with self._lock:
            pools, self._pools = list(self._pools.values()), {}
        for pool in pools:
            pool.close()
