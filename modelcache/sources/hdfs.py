"""HDFS over WebHDFS: ``hdfs://path`` and ``webhdfs://path``, configured as KServe does it.

KServe takes everything after the scheme as the path (``hdfs://user/me/model`` is
``/user/me/model``, or relative to ``HDFS_ROOTPATH`` when that is set) and the namenode(s) from
the ``HDFS_NAMENODE`` file of the secret dir; we do the same so existing URIs keep working.
The ``hdfs`` client lists (GETFILESTATUS, recursive LISTSTATUS), tries HA namenodes in turn
and maps RemoteException errors; reads are WebHDFS ``OPEN`` with ``offset``/``length`` (WebHDFS
has no HTTP Range), so a big file moves as parallel chunks. The NameNode's answer (with Kerberos,
proxy user and HA failover) goes through the ``hdfs`` client; its 307 to a DataNode (whose URL
carries the delegation token) is read through the one HTTP data path (``httpread``), as is a
gateway's direct answer. Each read is checked to deliver exactly the bytes asked for, and each file is verified
against HDFS's own MD5-of-MD5-of-CRC32C (GETFILECHECKSUM, see ``hdfs_checksum``).
"""

from __future__ import annotations

import json
import logging
import posixpath
from collections.abc import Iterator
from concurrent.futures import ThreadPoolExecutor
from typing import TYPE_CHECKING, Any
from urllib.parse import parse_qs, urlsplit

import requests
from hdfs import Client, HdfsError
from hdfs.client import _Request

from modelcache.errors import (
    AccessDeniedError,
    AuthError,
    ModelcacheError,
    NotFoundError,
    RateLimitedError,
    SourceError,
    TransientError,
)
from modelcache.sources.base import Checksum, EmptyStream, RangeStream, RemoteFile, Source, safe_relpath
from modelcache.sources.hdfs_checksum import checksum_from_webhdfs
from modelcache.sources.httpread import REDIRECT_CODES, HTTPStream, discard, make_pool, send, status_error
from modelcache.sources.kerberos import Kerberos, KerberosLogin
from modelcache.sources.objectstore import quiet_sdk_logs
from modelcache.sources.pinned_tls import adapter as tls_adapter
from modelcache.sources.ratelimit import retry_after, wait_out
from modelcache.sources.uri import HDFSLocation

if TYPE_CHECKING:
    from modelcache.sources.credentials import Settings

_MAX_DEPTH = 64
# The hdfs client logs a 401's raw body at ERROR before raising; we raise one clear line instead.
logging.getLogger("hdfs.client").setLevel(logging.CRITICAL)
log = logging.getLogger(__name__)
# urllib3's DEBUG request lines would carry the delegation token a Kerberized NameNode puts in
# its redirect to the DataNode (``&delegation=...``): they lose their query strings.
quiet_sdk_logs()


class HDFSSource(Source):
    max_streams = 8

    def __init__(self, location: HDFSLocation, settings: Settings) -> None:
        super().__init__(location, settings)
        self.where = location.display
        hs = settings.hdfs
        if not hs.namenode:
            raise SourceError(
                f"{self.where}: no WebHDFS namenode: put its URL (e.g. http://namenode:9870) in the file "
                f"HDFS_NAMENODE of the HDFS secret dir {hs.secret_dir} (HDFS_SECRET_DIR)"
            )
        raw = location.uri.split("://", 1)[1].split("?", 1)[0]
        # As KServe: without HDFS_ROOTPATH the path is absolute; with it, relative to that root.
        self.path = raw if hs.root_path else "/" + raw.lstrip("/")
        session = requests.Session()
        # As KServe: TLS_CA is the CA file, TLS_SKIP_VERIFY=true turns verification off; pinned
        # on the adapter so REQUESTS_CA_BUNDLE in the environment cannot override them.
        verify: bool | str | None = False if hs.tls_skip_verify else hs.tls_ca
        pool = tls_adapter(verify, pool_connections=4, pool_maxsize=32)
        session.mount("http://", pool)
        session.mount("https://", pool)
        if hs.tls_cert:
            session.cert = (hs.tls_cert, hs.tls_key) if hs.tls_key else hs.tls_cert
        session.headers.update(dict(hs.headers))
        # Kerberos as KServe configures it (KERBEROS_PRINCIPAL + KERBEROS_KEYTAB): SPNEGO with the
        # NameNode; the DataNode is then reached with the delegation token in its redirect.
        self._kerberos: Kerberos | None = None
        if hs.kerberos_principal or hs.kerberos_keytab:
            self._kerberos = Kerberos(
                KerberosLogin(hs.kerberos_principal, hs.kerberos_keytab, hs.secret_dir, self.where)
            )
            session.auth = self._kerberos.auth()
        # The hdfs client turns every non-2xx into an HdfsError without its status or headers;
        # a rate-limiting or overloaded gateway in front of WebHDFS must stay retryable, with its
        # Retry-After, so those answers are mapped here, before the client sees them.
        session.hooks["response"].append(self._gateway_status)
        self.client = _Client(
            hs.namenode,
            root=hs.root_path,
            proxy=hs.user_proxy,
            timeout=(settings.http.connect_timeout, settings.http.read_timeout),
            session=session,
        )
        self._session = session
        # The DataNode hop: the same TLS settings and headers, no Kerberos (its URL has the token).
        self._pool = make_pool(verify if verify is not None else True, self.max_streams,
                               settings.http.connect_timeout, settings.http.read_timeout,
                               cert=session.cert if isinstance(session.cert, (str, tuple)) else None)
        self._inode_reads = True  # until a gateway shows it cannot serve /.reserved/.inodes paths

    # -- errors -----------------------------------------------------------------------------

    def _gateway_status(self, resp: requests.Response, *args: object, **kwargs: object) -> requests.Response:
        code = resp.status_code
        # The request line without its query: only the op is shown (a query may carry a delegation token).
        url = urlsplit(resp.request.url or "")
        op = parse_qs(url.query).get("op", [""])[0]
        log.debug("webhdfs %s %s op=%s: HTTP %d", resp.request.method, url.path, op, code)
        if code in (429, 502, 503, 504):
            _ = resp.content  # a short error body: read it so the connection can be reused
            resp.close()
        if code == 401 and self._kerberos is None and "negotiate" in resp.headers.get("WWW-Authenticate", "").lower():
            _ = resp.content
            resp.close()
            raise AuthError(
                f"{self.where}: the WebHDFS namenode asks for Kerberos (SPNEGO); put KERBEROS_PRINCIPAL and "
                f"KERBEROS_KEYTAB in {self.settings.hdfs.secret_dir} (or the storage spec)"
            )
        if code == 429:
            raise RateLimitedError(
                f"{self.where}: WebHDFS answered HTTP 429 (rate-limited)", retry_after=retry_after(resp.headers)
            )
        if code in (502, 503, 504):
            raise TransientError(f"{self.where}: WebHDFS answered HTTP {code}")
        return resp

    def _error(self, exc: Exception, what: str) -> ModelcacheError:
        if isinstance(exc, requests.exceptions.SSLError):
            # Not transient: retrying the same certificates cannot succeed.
            return SourceError(
                f"{self.where}: TLS handshake with WebHDFS failed for {what}; check TLS_CA, TLS_CERT/TLS_KEY "
                f"or TLS_SKIP_VERIFY in {self.settings.hdfs.secret_dir}"
            )
        if isinstance(exc, requests.RequestException):
            return TransientError(f"{self.where}: cannot reach WebHDFS for {what}: {type(exc).__name__}")
        if not isinstance(exc, HdfsError):
            return SourceError(f"{self.where}: {what}: {exc}")
        kind = getattr(exc, "exception", None)
        text = str(exc).splitlines()[0][:300] if str(exc) else ""
        if kind == "FileNotFoundException":
            return NotFoundError(f"{self.where}: HDFS path '{what}' not found")
        if kind in ("AccessControlException", "SecurityException") and "Authentication" not in text:
            return AccessDeniedError(f"{self.where}: access to '{what}' denied by HDFS: {text}")
        if "Authentication failure" in text:
            hs = self.settings.hdfs
            if self._kerberos:
                hint = (
                    f"the NameNode refused the Kerberos login of '{hs.kerberos_principal}'; check that it runs "
                    f"SPNEGO as HTTP/<its host> and that KERBEROS_PRINCIPAL in {hs.secret_dir} may use it"
                )
            else:
                hint = f"check USER_PROXY, HEADERS or TLS_* in {hs.secret_dir}"
            return AuthError(f"{self.where}: WebHDFS authentication failed for '{what}'; {hint}")
        if kind in ("RetriableException", "StandbyException"):
            return TransientError(f"{self.where}: HDFS busy for '{what}' ({kind})")
        return SourceError(f"{self.where}: HDFS error for '{what}': {kind or ''} {text}".rstrip())

    # -- Source API -------------------------------------------------------------------------

    def list_files(self) -> list[RemoteFile]:
        # A 429 anywhere in the listing (status, LISTSTATUS, checksums) lists again after Retry-After.
        return wait_out(self._list_files, self.where)

    def _list_files(self) -> list[RemoteFile]:
        if self._kerberos:
            # Log in now: a bad keytab or principal fails with its own line, not as a bare 401.
            self._kerberos.check(urlsplit(self.settings.hdfs.namenode.split(";")[0].strip()).hostname or "")
        try:
            root = self.client.resolve(self.path)
            status = self.client.status(root)
        except (HdfsError, requests.RequestException) as exc:
            raise self._error(exc, self.path) from exc
        if status["type"] == "FILE":
            # A single file is saved under its own name, as KServe does.
            found = [(posixpath.basename(root), root, status)]
        else:
            found = list(self._walk(root, "", 0))
        if not found:
            raise NotFoundError(f"{self.where}: Failed to fetch model. No model found in '{root}'")
        # One GETFILECHECKSUM per file, a round trip each (and a datanode hop): in parallel.
        with ThreadPoolExecutor(max_workers=min(8, len(found))) as pool:
            files = list(pool.map(lambda f: self._file(*f), found))
        # HDFS has no revisions: a file rewritten meanwhile fails its checksum or length check.
        return sorted(files, key=lambda f: f.path)

    def _walk(self, folder: str, rel: str, depth: int) -> Iterator[tuple[str, str, dict]]:
        if depth > _MAX_DEPTH:
            raise SourceError(f"{self.where}: folders nested deeper than {_MAX_DEPTH} levels at '{folder}'")
        try:
            entries = self.client.list(folder, status=True)
        except (HdfsError, requests.RequestException) as exc:
            raise self._error(exc, folder) from exc
        for name, status in entries:
            child_rel = f"{rel}/{name}" if rel else name
            child = posixpath.join(folder, name)
            if status["type"] == "DIRECTORY":
                yield from self._walk(child, child_rel, depth + 1)
            else:
                yield child_rel, child, status

    def _file(self, rel: str, absolute: str, status: dict) -> RemoteFile:
        size = int(status["length"])
        checksum = self._checksum(absolute, int(status.get("blockSize") or 0)) if size else None
        return RemoteFile(
            path=safe_relpath(rel, self.where),
            size=size,
            version=str(status.get("modificationTime", "")) or None,
            checksums=(checksum,) if checksum else (),
            ranged=True,
            meta=(("hdfs.path", absolute), ("hdfs.inode", _inode_path(status))),
        )

    def _checksum(self, path: str, block_size: int) -> Checksum | None:
        """HDFS's own file checksum (computed by the datanodes from stored CRCs, no data read);
        None where the cluster or gateway cannot give one we can recompute."""
        try:
            doc = self.client.checksum(path)
        except (HdfsError, requests.RequestException, ValueError, KeyError):
            return None
        return checksum_from_webhdfs(doc, block_size)

    def open_range(self, file: RemoteFile, start: int, end: int | None) -> RangeStream:
        path = file.meta_get("hdfs.path")
        size = file.size or 0
        stop = size if end is None else min(end, size)
        length = max(0, stop - start)
        if length == 0:
            return EmptyStream()
        # HDFS has no versions, but a file has an inode id, and replacing the file (a rewrite,
        # a rename over it) makes a new inode: reading through the listed inode's reserved path
        # reads the listed file or fails, never a newer file under the same name.
        inode = (file.meta_get("hdfs.inode") if self._inode_reads else "") or path
        where = f"{self.where}: '{path}'"
        try:
            first = self.client._open_0(inode, offset=start, length=length)  # the NameNode, no redirect
        except (HdfsError, requests.RequestException) as exc:
            err = self._error(exc, path)
            if isinstance(err, NotFoundError) and inode != path:
                if self._same_file(path, inode):
                    # The file is there, unchanged: this gateway does not serve reserved paths.
                    self._inode_reads = False
                    return self.open_range(file, start, end)
                raise SourceError(
                    f"{self.where}: '{path}' changed while it was being downloaded (replaced or deleted in HDFS); "
                    "run the pull again"
                ) from exc
            raise err from exc
        # Exactly ``length`` bytes: a short body means the datanode stream was cut or the file
        # shrank; WebHDFS honours ``length``, so we never read past it.
        location = first.headers.get("Location")
        if first.status_code not in REDIRECT_CODES or not location:
            return HTTPStream(first.raw, where, length)  # a gateway (HttpFS) that answers itself
        first.close()
        log.debug("webhdfs OPEN %s: read from datanode %s", path, urlsplit(location).netloc)
        resp, _ = send(self._pool, "GET", location, dict(self.settings.hdfs.headers), where)
        if resp.status != 200:
            err = self._datanode_error(resp, path, where)
            discard(resp)
            raise err
        return HTTPStream(resp, where, length)

    def _datanode_error(self, resp: Any, path: str, where: str) -> ModelcacheError:
        """A DataNode's refusal: its RemoteException as the NameNode's would be mapped, else by status."""
        if resp.status in (408, 429) or resp.status >= 500:
            return status_error(resp.status, resp.headers, where)
        try:
            rex = json.loads(resp.read(64 << 10))["RemoteException"]
            return self._error(HdfsError(str(rex.get("message", "")), exception=rex.get("exception")), path)
        except (ValueError, KeyError, TypeError):
            return status_error(resp.status, resp.headers, where)

    def _same_file(self, path: str, inode: str) -> bool:
        try:
            status = self.client.status(path, strict=False)
        except (HdfsError, requests.RequestException):
            return False
        return status is not None and _inode_path(status) == inode

    def close(self) -> None:
        self._session.close()
        self._pool.clear()


def _inode_path(status: dict) -> str:
    """``/.reserved/.inodes/<fileId>``: the NameNode's name for exactly this file (empty when a
    gateway gives no fileId)."""
    file_id = status.get("fileId")
    return f"/.reserved/.inodes/{int(file_id)}" if isinstance(file_id, int) and file_id > 0 else ""


class _Client(Client):
    """The ``hdfs`` client with an OPEN that stops at the NameNode's redirect. Its metaclass
    names each operation after the attribute with digits and underscores dropped, so
    ``_open_hop0`` would be OPENHOP: the name has to reduce to ``open``."""

    _open_0 = _Request("GET", stream=True, allow_redirects=False)
