"""HTTP(S) source: one file per URI, ranged GETs when the server honours Range.

Listing is a HEAD (size, ETag, digest headers) and a one-byte ranged GET that tells whether
the server honours ``Range``; a server that ignores it is read as one stream (said at INFO, with
what it costs). An HTML page where the file should be (a folder's listing, an error page sent
with 200) is refused: it is never a model file. Ranged reads
send ``If-Match`` with a strong ETag so a file replaced on the server mid-download fails
loudly instead of mixing two versions. Digest headers (RFC 9530 ``Repr-Digest``, RFC 3230
``Digest``, ``Content-MD5``) and a ``#sha256=<hex>`` pin in the URI become checksums.

Servers and caches do not all honour ``If-Match``, and some send no validator at all, so every
response is also checked against the listing: its ``ETag`` and ``Last-Modified`` (when it has
them), the start and total of ``Content-Range``, and the ``Content-Length`` of a whole-file
answer. A file whose server gives no validator is probed again once read. A body with neither
``Content-Length`` nor chunked framing ends when the connection closes, so a cut looks like
the end: such a file is accepted only with a checksum to catch it.
"""

from __future__ import annotations

import base64
import http.client
import logging
import re
import socket
import ssl
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any, TypeVar
from urllib.parse import urljoin, urlsplit

import urllib3
from urllib3.exceptions import (
    HTTPError,
    NewConnectionError,
    ProtocolError,
    ReadTimeoutError,
    SSLError,
)
from urllib3.exceptions import (
    TimeoutError as Urllib3Timeout,
)

from modelcache.errors import (
    AccessDeniedError,
    AuthError,
    NotFoundError,
    RateLimitedError,
    SourceChangedError,
    SourceError,
    TransientError,
)
from modelcache.integrity import safe_b64_to_hex
from modelcache.progress import human_bytes
from modelcache.sources.base import Checksum, RemoteFile, Source, register_source, safe_relpath
from modelcache.sources.ranges import changed, check_length, check_total, parse_content_range
from modelcache.uri import HTTPLocation, redact_uri

log = logging.getLogger(__name__)

_REDIRECT_CODES = (301, 302, 303, 307, 308)
_HTML_TYPES = ("text/html", "application/xhtml+xml")
_HTML_NAMES = (".html", ".htm", ".xhtml")
_MAX_REDIRECTS = 10

# Digest algorithm names in HTTP headers -> our hasher names.
_HTTP_ALGOS = {"sha-256": "sha256", "sha-512": "sha512", "md5": "md5", "sha": "sha1", "sha-1": "sha1"}


def parse_digest_headers(headers: Any) -> list[Checksum]:
    """Checksums of the whole representation from Repr-Digest, Digest and Content-MD5."""
    found: dict[str, str] = {}
    repr_digest = headers.get("Repr-Digest")
    if repr_digest:  # RFC 9530 structured dictionary: sha-256=:BASE64:, ...
        for m in re.finditer(r"([A-Za-z0-9-]+)\s*=\s*:([A-Za-z0-9+/=]+):", repr_digest):
            algo = _HTTP_ALGOS.get(m.group(1).lower())
            hexval = safe_b64_to_hex(m.group(2))
            if algo and hexval:
                found.setdefault(algo, hexval)
    digest = headers.get("Digest")
    if digest:  # RFC 3230: SHA-256=BASE64,MD5=BASE64
        for part in digest.split(","):
            name, _, value = part.strip().partition("=")
            algo = _HTTP_ALGOS.get(name.strip().lower())
            hexval = safe_b64_to_hex(value.strip())
            if algo and hexval:
                found.setdefault(algo, hexval)
    md5 = headers.get("Content-MD5")
    if md5:
        hexval = safe_b64_to_hex(md5)
        if hexval:
            found.setdefault("md5", hexval)
    return [Checksum(a, v) for a, v in sorted(found.items())]


# http.client's readinto fills the whole buffer before it returns (BufferedReader loops over
# recv), so one 1 MiB read blocks until the whole MiB arrived: on a link slower than 1 MiB per
# stall timeout the watchdog saw "no data" although bytes flowed, and a read it aborted lost
# everything it had received. At most this much per call bounds both (the recv calls are the
# same; only Python-level calls grow, ~4k/s at 1 GB/s).
_MAX_READ = 256 << 10


class _HTTPStream:
    def __init__(self, resp: urllib3.BaseHTTPResponse, where: str, expect: int | None = None) -> None:
        """``expect``: the bytes a body without Content-Length must hold (the listed size); one
        that goes on past them is another file, not a longer read."""
        self._resp = resp
        self._where = where
        self._left = expect
        # urllib3's readinto reads into a new bytes object and copies it; with no content coding
        # the underlying http.client response reads from the socket straight into our buffer,
        # which measured ~20% more throughput on 2 cores.
        raw = getattr(resp, "_fp", None)
        coded = resp.headers.get("Content-Encoding", "identity").lower() not in ("", "identity")
        self._raw = raw if isinstance(raw, http.client.HTTPResponse) and not coded else None

    def readinto(self, buf: memoryview) -> int:
        buf = buf[:_MAX_READ]
        if self._left is None:
            return self._read(buf)
        if self._left == 0:
            return 0
        n = self._read(buf[: self._left])
        self._left -= n
        if n and self._left == 0 and self._read(memoryview(bytearray(1))):
            raise SourceChangedError(f"{self._where}: the body goes on past the listed size: the file changed "
                                     "on the server during the download; pull again")
        return n

    def _read(self, buf: memoryview) -> int:
        try:
            if self._raw is not None:
                return self._raw.readinto(buf)
            return self._resp.readinto(buf)  # type: ignore[arg-type]
        except (ProtocolError, ReadTimeoutError, Urllib3Timeout, http.client.HTTPException) as exc:
            raise TransientError(f"{self._where}: connection broken while reading: {type(exc).__name__}") from exc
        except (OSError, HTTPError, ValueError) as exc:
            raise TransientError(f"{self._where}: read failed: {type(exc).__name__}") from exc

    def abort(self) -> None:
        """Wake a reader blocked in recv (the stall watchdog); close() alone may not."""
        conn = getattr(self._resp, "connection", None)
        sock = getattr(conn, "sock", None)
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


def _basic_auth(user: str, password: str) -> str:
    def enc(text: str) -> bytes:
        try:
            return text.encode("latin1")  # requests' encoding, for byte-identical headers
        except UnicodeEncodeError:
            return text.encode("utf-8")

    return "Basic " + base64.b64encode(enc(user) + b":" + enc(password)).decode("ascii")


@register_source("http")
class HTTPSource(Source):
    preferred_chunk_size = 16 << 20
    max_streams = 16

    def __init__(self, location: HTTPLocation, settings: Any) -> None:  # type: ignore[override]
        super().__init__(location, settings)
        self.loc = location
        http = settings.http
        self.where = redact_uri(location.uri.split("#", 1)[0])  # userinfo shown as <redacted>@
        self.base_headers = {"Accept-Encoding": "identity", "User-Agent": "modelcache"}
        self.headers = {**self.base_headers, **http.headers_for(location.host)}
        if location.basic_auth is not None:
            # As requests (KServe's initializer) does with a URL's userinfo: basic auth, which
            # wins over a configured Authorization header; dropped on a redirect to another host.
            self.headers["Authorization"] = _basic_auth(*location.basic_auth)
        timeout = urllib3.Timeout(connect=http.connect_timeout, read=http.read_timeout)
        # retries=False: the engine retries (with progress). It also turns urllib3's redirects
        # off, so _request follows them itself. A custom CA also applies to an https URL that an
        # http one redirects to (PoolManager drops TLS settings for plain http pools); without
        # one, a context (~15 ms to build) only for https URLs.
        kwargs: dict[str, Any] = {"timeout": timeout, "retries": False, "maxsize": 32, "block": False}
        if http.verify and not (http.ca_bundle or location.url.startswith("https://")):
            pass  # urllib3's default verification for an https redirect target
        elif http.verify:
            ctx = ssl.create_default_context()
            if http.ca_bundle:
                ctx.load_verify_locations(cafile=http.ca_bundle)
            kwargs["ssl_context"] = ctx
        else:
            kwargs["cert_reqs"] = "CERT_NONE"
            urllib3.disable_warnings(urllib3.exceptions.InsecureRequestWarning)
        self.pool = urllib3.PoolManager(**kwargs)
        self._etag: str | None = None
        self._modified: str | None = None
        self._listed: _Listing | None = None

    def _request(self, method: str, headers: dict[str, str] | None = None) -> urllib3.BaseHTTPResponse:
        """Send one request, following redirects on every request (a presigned target may expire)."""
        url = self.loc.url
        sent = {**self.headers, **(headers or {})}
        for _ in range(_MAX_REDIRECTS + 1):
            resp = self._send(method, url, sent)
            location = resp.headers.get("Location")
            if resp.status not in _REDIRECT_CODES or not location:
                return resp
            resp.drain_conn()
            resp.release_conn()
            target = urljoin(url, location)
            if urlsplit(target).netloc.rsplit("@", 1)[-1] != urlsplit(url).netloc.rsplit("@", 1)[-1]:
                # Headers configured for this host (tokens) are not for another one.
                sent = {**self.base_headers, **(headers or {})}
            url = target
        raise SourceError(f"{self.where}: more than {_MAX_REDIRECTS} redirects")

    def _send(self, method: str, url: str, headers: dict[str, str]) -> urllib3.BaseHTTPResponse:
        try:
            return self.pool.request(method, url, headers=headers, preload_content=False, redirect=False)
        except SSLError as exc:
            reason = str(exc.__context__ or exc).split("(_ssl", 1)[0][:200]
            raise SourceError(
                f"{self.where}: TLS verification failed ({reason}); trust the server's CA with "
                "MODELCACHE_CA_BUNDLE or CA_BUNDLE_CONFIGMAP_NAME"
            ) from exc
        except NewConnectionError as exc:
            netloc = urlsplit(self.loc.url).netloc.rsplit("@", 1)[-1]
            raise TransientError(f"{self.where}: cannot connect to {netloc}: {_reason(exc)}") from exc
        except (Urllib3Timeout, ProtocolError, HTTPError, OSError) as exc:
            raise TransientError(f"{self.where}: request failed: {_reason(exc)}") from exc

    def _check_status(self, resp: urllib3.BaseHTTPResponse, ok: tuple[int, ...]) -> None:
        code = resp.status
        if code in ok:
            return
        resp.drain_conn() if code < 500 else resp.close()
        if code == 401 and self.loc.basic_auth is not None:
            raise AuthError(f"{self.where}: HTTP 401 Unauthorized: the server refused the user and password "
                            "written in the URI (sent as basic auth); check them")
        if code == 401:
            raise AuthError(
                f"{self.where}: HTTP 401 Unauthorized: set request headers in the env variable "
                f'\'{self.loc.host}-headers\' (JSON, e.g. {{"Authorization": "Bearer ..."}})'
            )
        if code == 403:
            raise AccessDeniedError(f"{self.where}: HTTP 403 Forbidden: the credentials do not allow reading it")
        if code == 404 or code == 410:
            raise NotFoundError(f"{self.where}: HTTP {code} Not Found: check the URL")
        if code == 412:
            raise SourceChangedError(f"{self.where}: the file changed on the server during the download; pull again")
        if code == 429:
            raise RateLimitedError(f"{self.where}: HTTP 429 Too Many Requests", _retry_after(resp))
        if code >= 500 or code == 408:
            raise TransientError(f"{self.where}: HTTP {code} from the server")
        raise SourceError(f"{self.where}: unexpected HTTP {code}")

    def list_files(self) -> list[RemoteFile]:
        return [_retrying(self._probe)]

    def _look(self) -> _Listing:
        """What the server says about the file now: HEAD, then a one-byte ranged GET."""
        head = self._request("HEAD")
        checksums: list[Checksum] = []
        size: int | None = None
        etag = modified = None
        # No HEAD, or one refused: presigned S3/GCS URLs are signed for GET only and answer a
        # HEAD with 403 (KServe only GETs, so they work there). The ranged GET probe below then
        # tells everything, and reports the real error if GET is refused too.
        head_usable = head.status not in (405, 501) and not (400 <= head.status < 500 and
                                                               head.status not in (404, 410, 429))
        if not head_usable:
            head.drain_conn()
            head.release_conn()
        else:
            self._check_status(head, (200,))
            checksums = parse_digest_headers(head.headers)
            size = _int(head.headers.get("Content-Length"))
            etag = head.headers.get("ETag")
            modified = head.headers.get("Last-Modified")
            head.drain_conn()
            head.release_conn()
        probe = self._request("GET", {"Range": "bytes=0-0"})
        if probe.status == 416:  # empty file
            probe.drain_conn()
            size, ranged = 0, False
        else:
            self._check_status(probe, (200, 206))
            ranged = probe.status == 206
            if ranged:
                m = re.match(r"bytes \d+-\d+/(\d+)", probe.headers.get("Content-Range", ""))
                size = int(m.group(1)) if m else size
                if not head_usable:  # of a 206, only Repr-Digest is about the whole file
                    checksums = parse_digest_headers({"Repr-Digest": probe.headers.get("Repr-Digest")})
                probe.drain_conn()
                probe.release_conn()
            else:
                if not head_usable:
                    checksums = parse_digest_headers(probe.headers)
                size = _int(probe.headers.get("Content-Length"))
                probe.close()  # don't read a whole body just to learn it ignores Range
            etag = etag or probe.headers.get("ETag")
            modified = modified or probe.headers.get("Last-Modified")
            self._refuse_html(probe.headers.get("Content-Type"))
        return _Listing(size, etag, modified, ranged, checksums)

    def _probe(self) -> RemoteFile:
        seen = self._look()
        checksums = seen.checksums
        if not seen.ranged and seen.size:
            log.info("%s: the server ignores Range (HTTP 200 to a ranged request): one stream instead of parallel "
                     "ranged reads, and an interrupted download of its %s starts over from byte 0",
                     self.where, human_bytes(seen.size))
        if self.loc.pinned:
            pin = Checksum(*self.loc.pinned)
            checksums = [c for c in checksums if c.algo != pin.algo] + [pin]
        etag, modified = seen.etag, seen.modified
        if etag and not etag.startswith("W/"):
            self._etag = etag
        elif modified:
            # No strong ETag: Last-Modified is the version. Without it a file replaced by one of
            # the same size matched a staged download of the old one and the resume mixed both.
            self._modified = modified
        self._listed = seen
        # The resume key: equal versions must mean equal bytes. A weak ETag does not promise
        # that (only "equivalent" content), so alone it is no version: no resume.
        if etag and not etag.startswith("W/"):
            version: str | None = etag
        elif modified:
            version = f"last-modified {modified}" + (f" {etag}" if etag else "")
        else:
            version = None
        path = safe_relpath(self.loc.filename, self.where)
        return RemoteFile(path=path, size=seen.size, version=version, checksums=tuple(checksums),
                          ranged=seen.ranged and bool(seen.size))

    def _refuse_html(self, content_type: str | None) -> None:
        """A URI names one file; an HTML page in its place is a directory listing (a folder URL,
        often after a redirect to ``.../``) or an error page sent with 200, never model bytes.
        Any other Content-Type is accepted (KServe refuses all but octet-stream)."""
        kind = (content_type or "").split(";", 1)[0].strip().lower()
        if kind in _HTML_TYPES and not self.loc.filename.lower().endswith(_HTML_NAMES):
            raise SourceError(
                f"{self.where}: the server sent an HTML page ({kind}) where a file was expected: a directory "
                "listing or an error page, not a model file; point the URI at the file itself"
            )

    def open_range(self, file: RemoteFile, start: int, end: int | None) -> _HTTPStream:
        headers: dict[str, str] = {}
        whole = start == 0 and (end is None or end == file.size)
        if not whole:
            headers["Range"] = f"bytes={start}-{'' if end is None else end - 1}"
        if self._etag:  # the listed version or nothing: a replaced file answers 412
            headers["If-Match"] = self._etag
        elif self._modified:  # the same, by date, for servers without an ETag
            headers["If-Unmodified-Since"] = self._modified
        resp = self._request("GET", headers)
        if not whole and resp.status in (200, 206):
            # A cache may answer a range with the whole object (200, e.g. on a miss) or, broken,
            # with another range: never read gigabytes we did not ask for, nor write bytes at the
            # wrong offset. Drop the connection and let the engine retry.
            parsed = parse_content_range(resp.headers.get("Content-Range"))
            if resp.status == 200 or parsed is None or parsed[0] != start:
                resp.close()
                got = "HTTP 200 with the whole file" if resp.status == 200 else \
                    f"Content-Range {resp.headers.get('Content-Range', 'missing')!r}"
                raise TransientError(f"{self.where}: asked for bytes from {start}, got {got}")
        self._check_status(resp, (200,) if whole else (206,))
        try:
            expect = self._check_response(file, resp, whole)
        except BaseException:
            resp.close()
            raise
        return _HTTPStream(resp, self.where, expect)

    def _check_response(self, file: RemoteFile, resp: urllib3.BaseHTTPResponse, whole: bool) -> int | None:
        """Hold a response against the listing (``If-Match`` alone trusts the server to honour
        it). Returns how many bytes a body without ``Content-Length`` must end at, if known."""
        listed = self._listed
        etag, modified = resp.headers.get("ETag"), resp.headers.get("Last-Modified")
        if listed is not None and listed.etag and etag and _opaque(etag) != _opaque(listed.etag):
            raise changed(self.where, f"its ETag is now {etag}, listed {listed.etag}")
        if listed is not None and listed.modified and modified and modified != listed.modified:
            raise changed(self.where, f"its Last-Modified is now {modified}, listed {listed.modified}")
        length = _int(resp.headers.get("Content-Length"))
        if not whole:
            check_total(self.where, resp.headers.get("Content-Range"), file.size)
            parsed = parse_content_range(resp.headers.get("Content-Range"))
            if parsed and length is not None and length != parsed[1] - parsed[0] + 1:
                raise TransientError(f"{self.where}: Content-Length {length} does not match "
                                     f"Content-Range {resp.headers.get('Content-Range')!r}")
            return None
        check_length(self.where, length, file.size)
        chunked = "chunked" in resp.headers.get("Transfer-Encoding", "").lower()
        if file.size is None and length is None and not chunked and not file.checksums:
            raise SourceError(
                f"{self.where}: the server sends neither Content-Length nor chunked framing, so a cut "
                "connection cannot be told from the end of the file; pin its digest in the URI "
                "(#sha256=<hex>) to download it verified"
            )
        return file.size if length is None else None

    def check_unchanged(self, file: RemoteFile) -> None:
        """A server without ETag or Last-Modified gives nothing to hold each response against
        but sizes: once the file is read, it is probed again and its size compared."""
        listed = self._listed
        if listed is None or listed.etag or listed.modified:
            return
        seen = _retrying(self._look)
        if seen.size != file.size:
            raise changed(self.where, f"its size is now {seen.size} bytes, listed {file.size}")

    def close(self) -> None:
        self.pool.clear()


T = TypeVar("T")


def _retrying(call: Callable[[], T]) -> T:
    """A listing request: three attempts on transient errors (the engine retries reads itself)."""
    from tenacity import Retrying, retry_if_exception_type, stop_after_attempt, wait_exponential

    for attempt in Retrying(
        stop=stop_after_attempt(3),
        wait=wait_exponential(multiplier=0.3, max=3),
        retry=retry_if_exception_type(TransientError),
        reraise=True,
    ):
        with attempt:
            return call()
    raise AssertionError("unreachable")


@dataclass(frozen=True)
class _Listing:
    """What the server said about the file when it was listed (or probed again)."""

    size: int | None
    etag: str | None
    modified: str | None
    ranged: bool
    checksums: list[Checksum]


def _opaque(etag: str) -> str:
    """The tag without its weak marker: RFC 9110's weak comparison (a changed file gets a new tag
    either way; a cache may mark a strong one weak)."""
    return etag[2:] if etag.startswith("W/") else etag


def _int(value: str | None) -> int | None:
    try:
        return int(value) if value is not None else None
    except ValueError:
        return None


def _retry_after(resp: urllib3.BaseHTTPResponse) -> float | None:
    value = resp.headers.get("Retry-After")
    try:
        return float(value) if value else None
    except ValueError:
        return None


def _reason(exc: BaseException) -> str:
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
