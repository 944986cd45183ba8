"""Hugging Face Hub source: ``hf://owner/model[:revision][/sub/dir]``.

The revision (branch, tag or commit) is resolved to a commit sha once; the tree is listed and
every byte is read at that commit, so a ``main`` that moves during a pull cannot mix two
versions. huggingface_hub does what is Hub-specific (revision info, paginated tree listing,
URL building, error types); the bytes move as ranged GETs on ``/resolve/<commit>/<path>``
through one pooled ``requests`` session, so the transfer engine can split big files into
parallel chunks and resume them. LFS files are redirected to a CDN on another host; requests
drops the Authorization header on that hop, as huggingface_hub itself does.

Checksums: LFS files carry their sha256 (``lfs.oid``); small files their git blob sha1.
"""

from __future__ import annotations

import posixpath
import re
import threading
from collections.abc import Callable, Mapping
from typing import Any, TypeVar
from urllib.parse import urlsplit

import httpx2
import requests
import urllib3
from huggingface_hub import HfApi, hf_hub_url
from huggingface_hub.errors import (
    DisabledRepoError,
    GatedRepoError,
    HfHubHTTPError,
    RemoteEntryNotFoundError,
    RepositoryNotFoundError,
    RevisionNotFoundError,
)
from huggingface_hub.hf_api import RepoFile
from huggingface_hub.utils import filter_repo_objects

from modelcache.credentials import Settings
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
from modelcache.sources.base import Checksum, RangeStream, RemoteFile, Source, safe_relpath
from modelcache.sources.pinned_tls import adapter as tls_adapter
from modelcache.sources.ranges import check_total
from modelcache.sources.ratelimit import retry_after, wait_out
from modelcache.uri import HFLocation, Location

_USER_AGENT = "modelcache/0.1 (hf source)"
_COMMIT = re.compile(r"[0-9a-f]{40}")
# Listing calls (revision info, the access check) answered 429 wait Retry-After (ratelimit.wait_out);
# the tree listing is retried the same way by huggingface_hub's own backoff.
_T = TypeVar("_T")


class HFSource(Source):
    max_streams = 16

    def __init__(self, location: Location, settings: Settings) -> None:
        super().__init__(location, settings)
        assert isinstance(location, HFLocation)
        self.loc = location
        self.endpoint = settings.hf.endpoint
        self.token = settings.hf.token
        # token=False: never fall back to a token file or env var of this process (Settings is
        # the only reader of the environment).
        self._api = HfApi(endpoint=self.endpoint, token=self.token or False, library_name="modelcache")
        self._session_lock = threading.Lock()
        self._session: requests.Session | None = None
        self._commit: str | None = None
        #: repo path -> CDN URL the Hub redirected it to (signed: never logged or shown).
        self._cdn_urls: dict[str, str] = {}

    # ---- listing ---------------------------------------------------------------------
    def list_files(self) -> list[RemoteFile]:
        commit = self._rate_limited(self._resolve_commit)
        files = [self._remote_file(entry, commit) for entry in self._tree(commit)]
        files = list(
            filter_repo_objects(
                files,
                allow_patterns=list(self.settings.allow_patterns) or None,
                ignore_patterns=list(self.settings.ignore_patterns) or None,
                key=lambda f: f.path,
            )
        )
        if not files:
            where = f"folder '{self.loc.subfolder}' of " if self.loc.subfolder else ""
            patterns = " matching STORAGE_ALLOW_PATTERNS/STORAGE_IGNORE_PATTERNS" if self._filtered() else ""
            raise NotFoundError(
                f"{self.loc.display}: no files{patterns} in {where}Hugging Face repository "
                f"'{self.loc.repo_id}' at commit {commit}"
            )
        # One HEAD before any bytes move: a gated repo lists fine but refuses downloads.
        self._rate_limited(lambda: self._check_access(files[0]))
        self._resolved = commit
        return files

    def _filtered(self) -> bool:
        return bool(self.settings.allow_patterns or self.settings.ignore_patterns)

    def _resolve_commit(self) -> str:
        revision = self.loc.revision or "main"
        try:
            info = self._api.model_info(self.loc.repo_id, revision=revision, timeout=self.settings.http.read_timeout)
        except Exception as exc:
            raise self._api_error(exc, revision) from exc
        sha = info.sha or ""
        if not _COMMIT.fullmatch(sha):
            raise SourceError(
                f"{self.loc.display}: the Hub at {self.endpoint} returned no commit for revision "
                f"'{revision}' of '{self.loc.repo_id}'"
            )
        if _COMMIT.fullmatch(revision) and sha != revision:
            raise SourceError(f"{self.loc.display}: the Hub resolved commit {revision} to a different commit {sha}")
        self._commit = sha
        return sha

    def _rate_limited(self, call: Callable[[], _T]) -> _T:
        """Run a listing call, waiting as the Hub's Retry-After says on 429 (bounded)."""
        return wait_out(call, self.loc.display)

    def _tree(self, commit: str) -> list[RepoFile]:
        sub = self.loc.subfolder.strip("/")
        try:
            entries = list(
                self._api.list_repo_tree(self.loc.repo_id, path_in_repo=sub or None, recursive=True, revision=commit)
            )
        except RemoteEntryNotFoundError:
            entries = []
        except Exception as exc:
            raise self._api_error(exc, commit) from exc
        files = [e for e in entries if isinstance(e, RepoFile)]
        if sub and not files:
            # git has no empty folders: the tree of a file's path is empty (or a 404), so
            # hf://owner/model/config.json names one file, saved under its own name as KServe
            # does for a single-file HDFS or S3 path.
            files = self._single_file(sub, commit)
            if not files:
                raise NotFoundError(
                    f"{self.loc.display}: no folder or file '{sub}' in Hugging Face repository "
                    f"'{self.loc.repo_id}' at commit {commit}"
                )
        return files

    def _single_file(self, sub: str, commit: str) -> list[RepoFile]:
        try:
            infos = self._rate_limited(lambda: self._paths_info(sub, commit))
        except RemoteEntryNotFoundError:
            return []
        return [i for i in infos if isinstance(i, RepoFile) and i.path == sub]

    def _paths_info(self, sub: str, commit: str) -> list[Any]:
        try:
            return list(self._api.get_paths_info(self.loc.repo_id, [sub], revision=commit))
        except RemoteEntryNotFoundError:
            raise
        except Exception as exc:
            raise self._api_error(exc, commit) from exc

    def _remote_file(self, entry: RepoFile, commit: str) -> RemoteFile:
        sub = self.loc.subfolder.strip("/")
        if sub and entry.path == sub:
            rel = posixpath.basename(sub)  # the sub-path names this one file
        else:
            rel = entry.path[len(sub) + 1 :] if sub and entry.path.startswith(sub + "/") else entry.path
        path = safe_relpath(rel, self.loc.display)
        if entry.lfs is not None:
            checksum = Checksum("sha256", entry.lfs.sha256.lower())
        else:
            checksum = Checksum("git-blob-sha1", entry.blob_id.lower())
        return RemoteFile(
            path=path,
            size=int(entry.size),
            version=commit,
            checksums=(checksum,),
            meta=(("repo_path", entry.path), ("lfs", "1" if entry.lfs is not None else "0")),
        )

    @property
    def resolved_uri(self) -> str:
        if not self._resolved:
            return self.loc.uri
        sub = f"/{self.loc.subfolder.strip('/')}" if self.loc.subfolder.strip("/") else ""
        return f"hf://{self.loc.repo_id}:{self._resolved}{sub}"

    # ---- bytes -------------------------------------------------------------------------
    def _url(self, file: RemoteFile) -> str:
        commit = file.version or self._commit or self._resolve_commit()
        return hf_hub_url(
            self.loc.repo_id, file.meta_get("repo_path", file.path), revision=commit, endpoint=self.endpoint
        )

    def _headers(self, extra: Mapping[str, str] | None = None, auth: bool = True) -> dict[str, str]:
        headers = {"User-Agent": _USER_AGENT, "Accept-Encoding": "identity", **(extra or {})}
        if self.token and auth:
            # Set per request, not on the session: requests strips it when a redirect leaves the host.
            headers["Authorization"] = f"Bearer {self.token}"
        return headers

    def session(self) -> requests.Session:
        with self._session_lock:
            if self._session is None:
                s = requests.Session()
                # A custom CA or verify=False is pinned on the adapter: REQUESTS_CA_BUNDLE in the
                # environment would otherwise replace Session.verify (see pinned_tls).
                verify = self.settings.http.requests_verify
                pool = tls_adapter(
                    None if verify is True else verify,
                    pool_connections=4,
                    pool_maxsize=self.max_streams + 4,
                    max_retries=0,
                )
                s.mount("http://", pool)
                s.mount("https://", pool)
                s.verify = verify
                self._session = s
            return self._session

    def _timeout(self) -> tuple[float, float]:
        return (self.settings.http.connect_timeout, self.settings.http.read_timeout)

    def _check_access(self, file: RemoteFile) -> None:
        try:
            resp = self.session().head(
                self._url(file), headers=self._headers(), allow_redirects=False, timeout=self._timeout()
            )
        except requests.RequestException as exc:
            raise TransientError(
                f"{self.loc.display}: cannot reach the Hub at {self.endpoint}: {type(exc).__name__}"
            ) from exc
        if resp.status_code >= 400:
            raise self._http_error(resp.status_code, resp.headers, file)

    def open_range(self, file: RemoteFile, start: int, end: int | None) -> RangeStream:
        stop = file.size if end is None else end
        if stop is not None and start >= stop:
            return _HTTPRangeStream(None, 0, self, file)
        rng = f"bytes={start}-" if end is None else f"bytes={start}-{end - 1}"
        resp = self._get(file, rng)
        if resp.status_code not in (200, 206):
            resp.close()
            raise self._http_error(resp.status_code, resp.headers, file)
        expected = None if stop is None else stop - start
        stream = _HTTPRangeStream(resp, expected, self, file)
        if resp.status_code == 200 and start > 0:
            stream.skip(start)  # a server (or proxy) that ignored Range: discard the head
        elif resp.status_code == 206:
            got = resp.headers.get("Content-Range", "")
            m = re.match(r"bytes (\d+)-", got)
            if m is None or int(m.group(1)) != start:
                stream.close()
                raise TransientError(f"{self.loc.display}: {file.path}: asked for {rng}, got Content-Range '{got}'")
            try:  # pinned to a commit, but a CDN or proxy in between may be stale or broken
                check_total(f"{self.loc.display}: {file.path}", got, file.size)
            except SourceChangedError:
                stream.close()
                raise
        return stream

    def _get(self, file: RemoteFile, rng: str) -> requests.Response:
        """GET a range. An LFS file's CDN location (signed, on another host) is remembered per
        file so each chunk costs one request instead of a Hub hit plus a redirect (the Hub
        rate-limits ``/resolve``); a refused cached location falls back to the Hub once."""
        key = file.meta_get("repo_path", file.path)
        cached = self._cdn_urls.get(key)
        try:
            if cached is not None:
                resp = self.session().get(
                    cached, headers=self._headers({"Range": rng}, auth=False), stream=True, timeout=self._timeout()
                )
                if resp.status_code not in (401, 403, 404, 410):
                    return resp
                resp.close()
                self._cdn_urls.pop(key, None)
            url = self._url(file)
            resp = self.session().get(url, headers=self._headers({"Range": rng}), stream=True, timeout=self._timeout())
        except requests.RequestException as exc:
            raise TransientError(f"{self.loc.display}: {file.path}: connection error: {type(exc).__name__}") from exc
        if resp.history and resp.status_code in (200, 206) and _origin(resp.url) != _origin(url):
            self._cdn_urls[key] = resp.url
        return resp

    def close(self) -> None:
        with self._session_lock:
            if self._session is not None:
                self._session.close()
                self._session = None

    # ---- errors ------------------------------------------------------------------------
    def _repo(self) -> str:
        return f"Hugging Face repository '{self.loc.repo_id}'"

    def _no_access(self, gated: bool) -> ModelcacheError:
        d, repo = self.loc.display, self._repo()
        if gated:
            if self.token:
                return AccessDeniedError(
                    f"{d}: {repo} is gated and the account of HF_TOKEN has not been granted access; "
                    "request access on the model page"
                )
            return AuthError(f"{d}: {repo} is gated; accept its terms on the Hub and set HF_TOKEN")
        if self.token:
            return NotFoundError(f"{d}: {repo} not found at {self.endpoint}, or HF_TOKEN cannot read it")
        return NotFoundError(f"{d}: {repo} not found at {self.endpoint} (if it is private or gated, set HF_TOKEN)")

    def _status_error(self, status: int, headers: Mapping[str, str], what: str) -> ModelcacheError:
        d = self.loc.display
        if status == 429:
            return RateLimitedError(
                f"{d}: rate-limited by the Hub at {self.endpoint} (HTTP 429) while reading {what}; "
                "retry later or set HF_TOKEN",
                retry_after=retry_after(headers),
            )
        if status == 401:
            return AuthError(f"{d}: HF_TOKEN was rejected by the Hub at {self.endpoint}; set a valid token")
        if status == 403:
            return AccessDeniedError(f"{d}: access to {what} of {self._repo()} denied (HTTP 403)")
        if status >= 500 or status == 408:
            return TransientError(f"{d}: the Hub answered HTTP {status} for {what} of {self._repo()}")
        return SourceError(f"{d}: the Hub answered HTTP {status} for {what} of {self._repo()}")

    def _http_error(self, status: int, headers: Mapping[str, str], file: RemoteFile) -> ModelcacheError:
        code = headers.get("X-Error-Code", "")
        message = headers.get("X-Error-Message", "")
        if code == "GatedRepo":
            return self._no_access(gated=True)
        if code == "RepoNotFound" or (status == 401 and message != "Invalid credentials in Authorization header"):
            return self._no_access(gated=False)
        if code == "RevisionNotFound":
            return NotFoundError(f"{self.loc.display}: commit {file.version} not found in {self._repo()}")
        if code == "EntryNotFound" or status == 404:
            return NotFoundError(
                f"{self.loc.display}: file '{file.meta_get('repo_path', file.path)}' not found in {self._repo()} "
                f"at commit {file.version}"
            )
        if status == 416:
            return SourceError(
                f"{self.loc.display}: {file.path} is shorter than its listed size {file.size} (HTTP 416)"
            )
        return self._status_error(status, headers, f"file '{file.path}'")

    def _api_error(self, exc: BaseException, revision: str) -> ModelcacheError:
        d = self.loc.display
        if isinstance(exc, ModelcacheError):
            return exc
        if isinstance(exc, GatedRepoError):
            return self._no_access(gated=True)
        if isinstance(exc, RevisionNotFoundError):
            return NotFoundError(f"{d}: revision '{revision}' not found in {self._repo()}")
        if isinstance(exc, DisabledRepoError):
            return AccessDeniedError(f"{d}: {self._repo()} is disabled on the Hub")
        if isinstance(exc, RepositoryNotFoundError):
            return self._no_access(gated=False)
        if isinstance(exc, HfHubHTTPError) and exc.response is not None:
            return self._status_error(exc.response.status_code, exc.response.headers, f"revision '{revision}'")
        if isinstance(exc, (httpx2.TransportError, OSError)):
            return TransientError(f"{d}: cannot reach the Hub at {self.endpoint}: {type(exc).__name__}")
        return SourceError(f"{d}: unexpected error from the Hub at {self.endpoint}: {type(exc).__name__}")


class _HTTPRangeStream:
    """A ranged response body; stops at the expected length, maps socket errors to retryable ones."""

    def __init__(self, resp: requests.Response | None, expected: int | None, src: HFSource, file: RemoteFile) -> None:
        self._resp = resp
        self._raw: Any = resp.raw if resp is not None else None
        self._left = expected
        self._where = f"{src.loc.display}: {file.path}"

    def skip(self, n: int) -> None:
        buf = memoryview(bytearray(min(n, 1 << 20)))
        left, saved = n, self._left
        self._left = None
        while left:
            got = self.readinto(buf[: min(left, len(buf))])
            if got == 0:
                raise TransientError(f"{self._where}: body ended while skipping to byte {n}")
            left -= got
        self._left = saved

    def readinto(self, buf: memoryview) -> int:
        if self._raw is None or self._left == 0:
            return 0
        view = buf if self._left is None else buf[: self._left]
        try:
            n = self._raw.readinto(view)
        except (urllib3.exceptions.HTTPError, requests.RequestException, OSError) as exc:
            raise TransientError(f"{self._where}: connection error while reading: {type(exc).__name__}") from exc
        if self._left is not None:
            self._left -= n
        return n

    def abort(self) -> None:
        self.close()

    def close(self) -> None:
        if self._resp is not None:
            self._resp.close()
            self._resp = None
        self._raw = None


def _origin(url: str) -> tuple[str, str, int | None]:
    parts = urlsplit(url)
    return (parts.scheme, (parts.hostname or "").lower(), parts.port)
