"""The one HTTP data path: every backend whose bytes are plain HTTP ranged GETs reads them here.

HTTP(S), the Hub, S3, GCS, Azure Blob, OCI blobs and WebHDFS differ in how a request is
authorised (a header, a signed or presigned URL, a token in a redirect) and in how a listing is
made, which their SDKs keep doing. The bytes are the same everywhere: a GET with ``Range`` on a
urllib3 pool, read from the socket straight into the engine's buffer. Kept here once:

* ``make_pool``: the connection pool (retries off: the engine retries, with progress);
* ``send``: one request, redirects followed on every request (a presigned target may expire),
  credentials dropped when a redirect leaves the host;
* ``status_error``: the one status-to-error classifier (with ``ratelimit.retry_after``, the one
  Retry-After parser: seconds and HTTP dates);
* ``open_range``: the empty-range rule, a ranged GET held against the listing (the checks of
  ``ranges``), and ``HTTPStream``, the reader.
"""

from __future__ import annotations

import http.client
import os
import socket
import ssl
import threading
import urllib.request
from collections.abc import Callable, Mapping
from dataclasses import dataclass
from typing import Any
from urllib.parse import urljoin, urlsplit

import urllib3
from urllib3.exceptions import HTTPError, NewConnectionError, ProtocolError, ReadTimeoutError, SSLError
from urllib3.exceptions import TimeoutError as Urllib3Timeout

from modelcache.errors import (
    AccessDeniedError,
    AuthError,
    ModelcacheError,
    NotFoundError,
    RateLimitedError,
    SourceChangedError,
    SourceError,
    TransientError,
)
from modelcache.sources.base import EmptyStream, empty_range
from modelcache.sources.ranges import check_length, check_total, parse_content_range
from modelcache.sources.ratelimit import retry_after
from modelcache.sources.remote import RangeStream, RemoteFile

REDIRECT_CODES = (301, 302, 303, 307, 308)
MAX_REDIRECTS = 10
# http.client's readinto fills the whole buffer before it returns (BufferedReader loops over
# recv), so one 1 MiB read blocks until the whole MiB arrived: on a link slower than 1 MiB per
# stall timeout the watchdog saw "no data" although bytes flowed, and a read it aborted lost
# everything it had received. At most this much per call bounds both (the recv calls are the
# same; only Python-level calls grow, ~4k/s at 1 GB/s). Bodies with a Content-Length read one
# recv per call instead (HTTPStream._read); this bounds the others (chunked, coded, unframed).
MAX_READ = 256 << 10


class Pool:
    """One source's connections: a urllib3 PoolManager, and a ProxyManager per proxy the
    environment names for a host (HTTPS_PROXY / HTTP_PROXY / NO_PROXY, as the SDKs honour them)."""

    def __init__(self, kwargs: dict[str, Any], tls: _CustomCA | None = None) -> None:
        self._kwargs = kwargs
        self._tls = tls
        self._direct = _PoolManager(tls, **kwargs)
        self._proxies: dict[str, urllib3.ProxyManager] = {}
        self._env = urllib.request.getproxies()

    def _for(self, url: str) -> urllib3.PoolManager:
        parts = urlsplit(url)
        proxy = self._env.get(parts.scheme)
        if not proxy or urllib.request.proxy_bypass(parts.hostname or ""):
            return self._direct
        manager = self._proxies.get(proxy)
        if manager is None:
            kwargs = dict(self._kwargs)
            if self._tls is not None:
                kwargs["ssl_context"] = self._tls.context()
            manager = self._proxies[proxy] = urllib3.ProxyManager(proxy, **kwargs)
        return manager

    def request(self, method: str, url: str, **kwargs: Any) -> urllib3.BaseHTTPResponse:
        return self._for(url).request(method, url, **kwargs)

    def clear(self) -> None:
        self._direct.clear()
        for manager in self._proxies.values():
            manager.clear()


def make_pool(
    verify: bool | str | None,
    maxsize: int,
    connect_timeout: float,
    read_timeout: float,
    cert: str | tuple[str, str] | None = None,
) -> Pool:
    """A pool for one source. ``verify``: False (no verification), a CA file, True (the system's
    CAs) or None (as ``requests`` would: REQUESTS_CA_BUNDLE / CURL_CA_BUNDLE if set, for the
    backends whose SDK listing goes through requests and so trusts those)."""
    if verify is None:
        verify = os.environ.get("REQUESTS_CA_BUNDLE") or os.environ.get("CURL_CA_BUNDLE") or True
    kwargs: dict[str, Any] = {
        "timeout": urllib3.Timeout(connect=connect_timeout, read=read_timeout),
        "retries": False,
        "maxsize": maxsize,
        "block": False,
    }
    if verify is False:
        kwargs["cert_reqs"] = "CERT_NONE"
        urllib3.disable_warnings(urllib3.exceptions.InsecureRequestWarning)
    tls = _CustomCA(verify) if isinstance(verify, str) else None
    if cert is not None:
        kwargs["cert_file"], kwargs["key_file"] = cert if isinstance(cert, tuple) else (cert, None)
    return Pool(kwargs, tls)


class _CustomCA:
    """The TLS context of a pool with a custom CA: it trusts the CA besides the system's, and is
    built at the first https pool, not with the source: loading the system's CAs and the bundle
    costs 0.04-0.08 CPU-s (measured, issue 28), which a pull from an http:// endpoint (an
    in-cluster S3 server) never needs. It also applies to an https URL that an http one
    redirects to (PoolManager drops TLS keyword settings for plain http pools)."""

    def __init__(self, ca: str) -> None:
        self._ca = ca
        self._context: ssl.SSLContext | None = None
        self._lock = threading.Lock()

    def context(self) -> ssl.SSLContext:
        with self._lock:
            if self._context is None:
                ctx = ssl.create_default_context()
                if os.path.isdir(self._ca):
                    ctx.load_verify_locations(capath=self._ca)
                else:
                    ctx.load_verify_locations(cafile=self._ca)
                self._context = ctx
            return self._context


class _PoolManager(urllib3.PoolManager):
    """A PoolManager whose https pools get a ``_CustomCA``'s context, made when first needed."""

    def __init__(self, tls: _CustomCA | None, **kwargs: Any) -> None:
        super().__init__(**kwargs)
        self._tls = tls

    def _new_pool(self, scheme: str, host: str, port: int,
                  request_context: dict[str, Any] | None = None) -> urllib3.HTTPConnectionPool:
        if scheme == "https" and self._tls is not None:
            request_context = dict(self.connection_pool_kw if request_context is None else request_context)
            request_context["ssl_context"] = self._tls.context()
        return super()._new_pool(scheme, host, port, request_context)


def reason(exc: BaseException) -> str:
    """The root cause without the URL (which may carry a signature)."""
    root: BaseException = exc
    while root.__context__ is not None and root.__context__ is not root:
        root = root.__context__
    if isinstance(root, ConnectionRefusedError) or "Connection refused" in str(exc):
        return "connection refused"
    if isinstance(root, socket.gaierror) or "Name or service not known" in str(exc):
        return "host name not found"
    if isinstance(root, (TimeoutError, socket.timeout)) or isinstance(exc, Urllib3Timeout):
        return "timed out"
    return type(root).__name__


@dataclass(frozen=True)
class Hints:
    """What each failure means for one backend: the fix named in its one-line error."""

    auth: str = "the server wants credentials"
    denied: str = "the credentials do not allow reading it"
    missing: str = "check the URI"
    tls: str = "trust the server's CA with MODELCACHE_CA_BUNDLE or CA_BUNDLE_CONFIGMAP_NAME"


def status_error(status: int, headers: Mapping[str, str], where: str, hints: Hints = Hints()) -> ModelcacheError:
    """The one status-to-error classifier of the data path."""
    if status == 401:
        return AuthError(f"{where}: HTTP 401 Unauthorized: {hints.auth}")
    if status == 403:
        return AccessDeniedError(f"{where}: HTTP 403 Forbidden: {hints.denied}")
    if status in (404, 410):
        return NotFoundError(f"{where}: HTTP {status} Not Found: {hints.missing}")
    if status == 412:
        return SourceChangedError(f"{where}: the file changed on the server during the download; pull again")
    if status == 429:
        return RateLimitedError(f"{where}: HTTP 429 Too Many Requests", retry_after(headers))
    if status >= 500 or status == 408:
        # A 503 is how S3 and others say "slow down": its Retry-After is honoured like a 429's.
        wait = retry_after(headers)
        if status == 503 and wait is not None:
            return RateLimitedError(f"{where}: HTTP 503 from the server", wait)
        return TransientError(f"{where}: HTTP {status} from the server")
    return SourceError(f"{where}: unexpected HTTP {status}")


def _host(url: str) -> str:
    return urlsplit(url).netloc.rsplit("@", 1)[-1].lower()


def send(
    pool: Pool,
    method: str,
    url: str,
    headers: Mapping[str, str],
    where: str,
    private: Mapping[str, str] | None = None,
    hints: Hints = Hints(),
    follow: bool = True,
) -> tuple[urllib3.BaseHTTPResponse, str]:
    """One request, redirects followed (unless not ``follow``); returns the response and the
    URL that answered.

    ``private`` headers (a token, a signature) go to ``url``'s host only: a redirect to another
    host (a CDN, a DataNode, a presigned bucket URL) gets the others."""
    sent = {**headers, **(private or {})}
    for _ in range(MAX_REDIRECTS + 1):
        try:
            resp = pool.request(method, url, headers=sent, preload_content=False, redirect=False)
        except SSLError as exc:
            why = str(exc.__context__ or exc).split("(_ssl", 1)[0][:200]
            raise SourceError(f"{where}: TLS verification failed ({why}); {hints.tls}") from exc
        except NewConnectionError as exc:
            raise TransientError(f"{where}: cannot connect to {_host(url)}: {reason(exc)}") from exc
        except (Urllib3Timeout, ProtocolError, HTTPError, OSError) as exc:
            raise TransientError(f"{where}: request failed: {reason(exc)}") from exc
        location = resp.headers.get("Location")
        if not follow or resp.status not in REDIRECT_CODES or not location:
            return resp, url
        resp.drain_conn()
        resp.release_conn()
        target = urljoin(url, location)
        if _host(target) != _host(url):
            sent = dict(headers)
        url = target
    raise SourceError(f"{where}: more than {MAX_REDIRECTS} redirects")


def discard(resp: urllib3.BaseHTTPResponse) -> None:
    """Done with a response that is not read: a short error body keeps its connection."""
    try:
        if resp.status < 500 and (resp.length_remaining or 0) <= 64 << 10:
            resp.drain_conn()
            resp.release_conn()
        else:
            resp.close()
    except Exception:
        resp.close()


class HTTPStream:
    """A ranged response body, read from the socket straight into the caller's buffer.

    It ends exactly at ``length`` bytes when known (a body that ends early is a TransientError,
    the engine retries the rest; one that goes on past ``length`` of a whole-file answer without
    Content-Length means the file changed), and ``abort`` wakes a reader blocked in recv.
    """

    def __init__(self, resp: urllib3.BaseHTTPResponse, where: str, length: int | None,
                 framed: bool = True) -> None:
        """``length``: the bytes this stream delivers; ``framed``: whether the response has its own
        end (Content-Length or chunked) beyond which ``length`` is the listing's promise only."""
        self._resp = resp
        self._where = where
        self._left = length
        self._framed = framed
        self._got = 0
        # urllib3's readinto reads into a new bytes object and copies it; with no content coding
        # the underlying http.client response reads from the socket straight into our buffer,
        # which measured ~20% more throughput on 2 cores.
        raw = getattr(resp, "_fp", None)
        coded = str(resp.headers.get("Content-Encoding", "identity")).lower() not in ("", "identity")
        self._raw = raw if isinstance(raw, http.client.HTTPResponse) and not coded else None

    def readinto(self, buf: memoryview, /) -> int:
        if self._left is None:
            return self._read(buf[:MAX_READ])
        if self._left == 0:
            return 0
        n = self._read(buf[: self._left])
        if n == 0:
            raise TransientError(f"{self._where}: body ended after {self._got} of {self._got + self._left} bytes "
                                 "(stream cut, or the file changed)")
        self._left -= n
        self._got += n
        if self._left == 0 and not self._framed and self._read(memoryview(bytearray(1))):
            raise SourceChangedError(f"{self._where}: the body goes on past the listed size: the file changed "
                                     "on the server during the download; pull again")
        return n

    def _read(self, buf: memoryview) -> int:
        raw = self._raw
        try:
            if raw is None:
                return self._resp.readinto(buf[:MAX_READ])
            if raw.chunked or not raw.length or raw.fp is None:
                return raw.readinto(buf[:MAX_READ])
            # One recv straight into the caller's buffer (after what the header parse left
            # buffered): it returns what has arrived, so each call is as large as the socket
            # allows (~200-700 KiB here against 256 KiB capped) and never waits for more,
            # which also keeps the stall watchdog's view of progress per recv.
            n = raw.fp.readinto1(buf[: raw.length])
            if n:
                raw.length -= n
                if not raw.length:
                    raw.read()  # http.client's end of body: it frees the connection for reuse
            return n
        except (ProtocolError, ReadTimeoutError, Urllib3Timeout, http.client.HTTPException) as exc:
            raise TransientError(f"{self._where}: connection broken while reading: {type(exc).__name__}") from exc
        except (OSError, HTTPError, ValueError) as exc:
            raise TransientError(f"{self._where}: read failed: {type(exc).__name__}") from exc

    def abort(self) -> None:
        """Wake a reader blocked in recv (the stall watchdog, a cancel); close() alone may not."""
        sock = getattr(getattr(self._resp, "connection", None), "sock", None)
        if sock is not None:
            try:
                sock.shutdown(socket.SHUT_RDWR)
            except OSError:
                pass
        self.close()

    def close(self) -> None:
        try:
            remaining = self._raw.length if self._raw is not None else self._resp.length_remaining
            if remaining == 0 or (self._raw is not None and self._raw.isclosed() and remaining is None):
                self._resp.release_conn()
            else:  # an unread body: drop the connection rather than read the rest
                self._resp.close()
        except Exception:
            pass


def int_header(value: str | None) -> int | None:
    try:
        return int(value) if value is not None else None
    except ValueError:
        return None


def range_header(start: int, end: int | None) -> str:
    return f"bytes={start}-{'' if end is None else end - 1}"


def open_range(
    pool: Pool,
    url: str,
    file: RemoteFile,
    start: int,
    end: int | None,
    where: str,
    *,
    headers: Mapping[str, str] | None = None,
    private: Mapping[str, str] | None = None,
    hints: Hints = Hints(),
    errors: Callable[[urllib3.BaseHTTPResponse], ModelcacheError | None] | None = None,
    check: Callable[[urllib3.BaseHTTPResponse], None] | None = None,
    answered: Callable[[str], None] | None = None,
) -> RangeStream:
    """GET ``[start, end)`` of ``file`` at ``url`` and hold the answer against the listing.

    ``errors`` maps a failed response to a backend's own error first (an S3 error code, the
    Hub's X-Error-Code), None for the shared classifier; ``check`` raises if a good answer
    contradicts the listing in a backend's own terms (an ETag); ``answered`` is told the URL
    that answered after redirects (the Hub remembers its CDN location).
    """
    if empty_range(file, start, end):  # the one empty-range rule: no request for no bytes
        return EmptyStream()
    whole = start == 0 and (end is None or end == file.size)
    sent = {"Accept-Encoding": "identity", **(headers or {})}
    if not whole:
        sent["Range"] = range_header(start, end)
    resp, final = send(pool, "GET", url, sent, where, private, hints)
    try:
        if resp.status not in (200, 206):
            err = errors(resp) if errors is not None else None
            raise err or status_error(resp.status, resp.headers, where, hints)
        if check is not None:  # the backend's own validator first: it names what changed
            check(resp)
        length = int_header(resp.headers.get("Content-Length"))
        content_range = resp.headers.get("Content-Range")
        if resp.status == 206:
            parsed = parse_content_range(content_range)
            if parsed is None or parsed[0] != start:
                # A broken cache or proxy: never write bytes at the wrong offset.
                raise TransientError(f"{where}: asked for bytes from {start}, got Content-Range {content_range!r}")
            check_total(where, content_range, file.size)
            if length is not None and length != parsed[1] - parsed[0] + 1:
                raise TransientError(f"{where}: Content-Length {length} does not match Content-Range "
                                     f"{content_range!r}")
        else:
            check_length(where, length, file.size)
            if start:
                # A cache may answer a range with the whole object (on a miss): never read
                # gigabytes we did not ask for; the engine retries.
                raise TransientError(f"{where}: asked for bytes from {start}, got HTTP 200 with the whole file")
    except BaseException:
        discard(resp)
        raise
    if answered is not None:
        answered(final)
    stop = end if end is not None else file.size
    want = None if stop is None else stop - start
    chunked = "chunked" in str(resp.headers.get("Transfer-Encoding", "")).lower()
    return HTTPStream(resp, where, want, framed=length is not None or chunked or not whole)
