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
import logging
import mimetypes
import re
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any, TypeVar
from urllib.parse import urlsplit

import urllib3

from modelcache.errors import RateLimitedError, SourceError, TransientError
from modelcache.runtime.progress import human_bytes
from modelcache.sources.archive import archive_kind, archive_suffix
from modelcache.sources.base import Checksum, RemoteFile, Source, safe_relpath
from modelcache.sources.httpread import Hints, discard, int_header, make_pool, open_range, send, status_error
from modelcache.sources.integrity import safe_b64_to_hex
from modelcache.sources.ranges import changed
from modelcache.sources.ratelimit import wait_out
from modelcache.sources.remote import RangeStream
from modelcache.sources.uri import HTTPLocation, redact_uri

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


def _basic_auth(user: str, password: str) -> str:
    def enc(text: str) -> bytes:
        try:
            return text.encode("latin1")  # requests' encoding, for byte-identical headers
        except UnicodeEncodeError:
            return text.encode("utf-8")

    return "Basic " + base64.b64encode(enc(user) + b":" + enc(password)).decode("ascii")


_warned_hosts: set[str] = set()


def _warn_clear_text(host: str, where: str) -> None:
    """Basic auth over http:// is the user's choice (KServe sends it too), but it is readable by
    anyone on the path: said once per host and process."""
    if host in _warned_hosts:
        return
    _warned_hosts.add(host)
    log.warning("%s: the user and password in the URI go to %s as HTTP basic auth over plain http://, "
                "readable by anyone on the network path; use https://", where, host)


class HTTPSource(Source):
    applies_patterns = False  # one file, named by the URI

    def __init__(self, location: HTTPLocation, settings: Any) -> None:
        super().__init__(location, settings)
        self.loc = location
        http = settings.http
        self.where = redact_uri(location.uri.split("#", 1)[0])  # userinfo shown as <redacted>@
        self.base_headers = {"Accept-Encoding": "identity", "User-Agent": "modelcache"}
        self.headers = {**self.base_headers, **http.headers_for(location.host)}
        if location.basic_auth is not None:
            # As requests (KServe's initializer) does with a URL's userinfo: basic auth, which
            # wins over a configured Authorization header; private to the URL's host (send()).
            self.headers["Authorization"] = _basic_auth(*location.basic_auth)
            if location.url.startswith("http://"):
                _warn_clear_text(location.host, self.where)
        # A CA or verify=False applies to every hop; without one, the system's CAs.
        verify: bool | str = http.ca_bundle or True if http.verify else False
        self.pool = make_pool(verify, self.max_streams, http.connect_timeout, http.read_timeout)
        self.hints = Hints(
            auth="the server refused the user and password written in the URI (sent as basic auth); check them"
                 if location.basic_auth is not None else
                 # KServe's variable name (<host>-headers) is not one a shell can `export`: show the
                 # `env` form that works, and basic auth in the URI, which needs no variable at all.
                 "send credentials: put USER:PASSWORD@ before the host in the URI (sent as basic auth), or set "
                 f"""request headers in the variable '{location.host}-headers' (JSON; a """
                 f"""shell cannot export that name: env '{location.host}-headers={{"Authorization": "Bearer ..."}}' """
                 "modelcache pull ...)",
            denied="the credentials do not allow reading it",
            missing="check the URL",
        )
        self._etag: str | None = None
        self._modified: str | None = None
        self._listed: _Listing | None = None

    def _request(self, method: str, headers: dict[str, str] | None = None) -> urllib3.BaseHTTPResponse:
        """One request, redirects followed on every request (a presigned target may expire);
        the headers configured for this host (tokens) are not sent to another one."""
        resp, _ = send(self.pool, method, self.loc.url, {**self.base_headers, **(headers or {})}, self.where,
                       private=self.headers, hints=self.hints)
        return resp

    def _check_status(self, resp: urllib3.BaseHTTPResponse, ok: tuple[int, ...]) -> None:
        if resp.status not in ok:
            discard(resp)
            raise status_error(resp.status, resp.headers, self.where, self.hints)

    def list_files(self) -> list[RemoteFile]:
        # A 429 waits the server's Retry-After (wait_out); other transient errors retry at once.
        return [wait_out(lambda: _retrying(self._probe), self.where)]

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
            size = int_header(head.headers.get("Content-Length"))
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
                size = int_header(probe.headers.get("Content-Length"))
                probe.close()  # don't read a whole body just to learn it ignores Range
            etag = etag or probe.headers.get("ETag")
            modified = modified or probe.headers.get("Last-Modified")
            self._refuse_html(probe.headers.get("Content-Type"))
        return _Listing(size, etag, modified, ranged, checksums)

    def _probe(self) -> RemoteFile:
        seen = self._look()
        checksums = seen.checksums
        if not seen.ranged and seen.size:
            # A warning (the CLI shows warnings): an interrupted pull of this file cannot resume.
            log.warning("%s: the server ignores Range (HTTP 200 to a ranged request): one stream instead of parallel "
                        "ranged reads, and an interrupted download of its %s starts over from byte 0",
                        self.where, human_bytes(seen.size))
        if self.loc.pinned:
            pin = Checksum(*self.loc.pinned, params=(("from", "uri"),))  # named as the cause if it never matches
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
        path = safe_relpath(listed_name(self.loc), self.where)
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

    def open_range(self, file: RemoteFile, start: int, end: int | None) -> RangeStream:
        headers: dict[str, str] = {}
        if self._etag:  # the listed version or nothing: a replaced file answers 412
            headers["If-Match"] = self._etag
        elif self._modified:  # the same, by date, for servers without an ETag
            headers["If-Unmodified-Since"] = self._modified
        return open_range(self.pool, self.loc.url, file, start, end, self.where, headers={**self.base_headers,
                          **headers}, private=self.headers, hints=self.hints,
                          check=lambda resp: self._check_response(file, resp, start == 0 and end in (None, file.size)))

    def _check_response(self, file: RemoteFile, resp: urllib3.BaseHTTPResponse, whole: bool) -> None:
        """Hold a response against the listing's validators (``If-Match`` alone trusts the
        server to honour it); the sizes are checked by ``httpread.open_range``."""
        listed = self._listed
        etag, modified = resp.headers.get("ETag"), resp.headers.get("Last-Modified")
        if listed is not None and listed.etag and etag and _opaque(etag) != _opaque(listed.etag):
            raise changed(self.where, f"its ETag is now {etag}, listed {listed.etag}")
        if listed is not None and listed.modified and modified and modified != listed.modified:
            raise changed(self.where, f"its Last-Modified is now {modified}, listed {listed.modified}")
        framed = resp.headers.get("Content-Length") is not None or \
            "chunked" in resp.headers.get("Transfer-Encoding", "").lower()
        if whole and file.size is None and not framed and not file.checksums:
            raise SourceError(
                f"{self.where}: the server sends neither Content-Length nor chunked framing, so a cut "
                "connection cannot be told from the end of the file; pin its digest in the URI "
                "(#sha256=<hex>) to download it verified"
            )

    def check_unchanged(self, file: RemoteFile) -> None:
        """A server without ETag or Last-Modified gives nothing to hold each response against
        but sizes: once the file is read, it is probed again and its size compared."""
        listed = self._listed
        if listed is None or listed.etag or listed.modified:
            return
        seen = wait_out(lambda: _retrying(self._look), self.where)
        if seen.size != file.size:
            raise changed(self.where, f"its size is now {seen.size} bytes, listed {file.size}")

    def close(self) -> None:
        self.pool.clear()


T = TypeVar("T")


def _retrying(call: Callable[[], T]) -> T:
    """A listing request: three attempts on transient errors (the engine retries reads itself),
    but for a 429, which ``wait_out`` waits out as the server asks."""
    from tenacity import Retrying, retry_if_exception, stop_after_attempt, wait_exponential

    for attempt in Retrying(
        stop=stop_after_attempt(3),
        wait=wait_exponential(multiplier=0.3, max=3),
        retry=retry_if_exception(lambda e: isinstance(e, TransientError) and not isinstance(e, RateLimitedError)),
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


def listed_name(loc: HTTPLocation) -> str:
    """The file's name: the URL path's last segment. KServe takes an archive's type from the query
    when the path has no type of its own (``https://h/download?file=model.tar.gz``: its initializer
    unpacks it, kserve_storage.py ``_download_from_uri``); the name then gets that suffix, so the
    model is unpacked here as well, whatever the server calls the file."""
    parts = urlsplit(loc.url)
    if not parts.query or mimetypes.guess_type(parts.path)[0] is not None:
        return loc.filename
    suffix = archive_suffix(parts.query)
    return loc.filename + suffix if suffix and archive_kind(loc.filename) is None else loc.filename
