"""Hugging Face Hub source: ``hf://owner/model[:revision][/sub/dir]``.

The revision (branch, tag or commit) is resolved to a commit sha once; the tree is listed and
every byte is read at that commit, so a ``main`` that moves during a pull cannot mix two
versions. huggingface_hub does what is Hub-specific (revision info, paginated tree listing,
URL building, error types); the bytes move as ranged GETs on ``/resolve/<commit>/<path>``
through the one HTTP data path (``httpread``), so the transfer engine can split big files into
parallel chunks and resume them. LFS files are redirected to a CDN on another host; the token
is not sent on that hop, as huggingface_hub does.

Checksums: LFS files carry their sha256 (``lfs.oid``); small files their git blob sha1.
"""

from __future__ import annotations

import posixpath
import re
from collections.abc import Callable, Mapping
from pathlib import Path
from typing import Any, TypeVar
from urllib.parse import urlsplit

import httpx2
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

from modelcache.errors import (
    AccessDeniedError,
    AuthError,
    ModelcacheError,
    NotFoundError,
    RateLimitedError,
    SourceError,
    TransientError,
)
from modelcache.sources.base import Checksum, RangeStream, RemoteFile, Source, safe_relpath
from modelcache.sources.credentials import Settings
from modelcache.sources.httpread import discard, make_pool, open_range, send
from modelcache.sources.ratelimit import retry_after, wait_out
from modelcache.sources.uri import HFLocation, Location

_HEADERS = {"User-Agent": "modelcache/0.1 (hf source)"}
_COMMIT = re.compile(r"[0-9a-f]{40}")
#: Where huggingface_hub keeps its records of a ``local_dir`` download (``_local_folder.py``).
_LOCAL_DIR_METADATA = Path(".cache") / "huggingface" / "download"
#: A folder with more records than this is not read (a model has far fewer files).
_METADATA_MAX_FILES = 100_000
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
        http = settings.http
        # A custom CA is trusted besides the system's; MODELCACHE_HTTP_VERIFY_SSL=0 turns it off.
        verify: bool | str = http.ca_bundle or True if http.verify else False
        self.pool = make_pool(verify, self.max_streams + 4, http.connect_timeout, http.read_timeout)
        self._commit: str | None = None
        #: repo path -> CDN URL the Hub redirected it to (signed: never logged or shown).
        self._cdn_urls: dict[str, str] = {}

    @classmethod
    def revision_in(cls, folder: Path) -> str | None:
        """The commit ``snapshot_download(local_dir=...)`` (KServe's initializer and download Jobs)
        recorded for the files it wrote: ``.cache/huggingface/download/<path>.metadata``, whose
        first line is the commit. One commit for every file, or None (none recorded, or a folder
        that mixes revisions: then it says nothing usable)."""
        base = folder / _LOCAL_DIR_METADATA
        commits: set[str] = set()
        try:
            for i, path in enumerate(base.rglob("*.metadata")):
                if i >= _METADATA_MAX_FILES or path.is_symlink() or not path.is_file():
                    return None
                with open(path, "rb") as f:
                    first = f.read(64).split(b"\n", 1)[0].decode("ascii", "replace").strip()
                if not _COMMIT.fullmatch(first):
                    return None
                commits.add(first)
        except OSError:
            return None
        return commits.pop() if len(commits) == 1 else None

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

    def _auth(self) -> dict[str, str]:
        """The token, for the Hub's host only (not for the CDN a file is redirected to)."""
        return {"Authorization": f"Bearer {self.token}"} if self.token else {}

    def _check_access(self, file: RemoteFile) -> None:
        resp, _ = send(self.pool, "HEAD", self._url(file), _HEADERS, self.loc.display, private=self._auth(),
                       follow=False)
        discard(resp)
        if resp.status >= 400:
            raise self._http_error(resp.status, resp.headers, file)

    def open_range(self, file: RemoteFile, start: int, end: int | None) -> RangeStream:
        """GET a range. An LFS file's CDN location (signed, on another host) is remembered per
        file so each chunk costs one request instead of a Hub hit plus a redirect (the Hub
        rate-limits ``/resolve``); a refused cached location falls back to the Hub once."""
        key = file.meta_get("repo_path", file.path)
        where = f"{self.loc.display}: {file.path}"

        def errors(resp: Any) -> ModelcacheError:
            return self._http_error(resp.status, resp.headers, file)

        cached = self._cdn_urls.get(key)
        if cached is not None:
            try:
                return open_range(self.pool, cached, file, start, end, where, headers=_HEADERS, errors=errors)
            except (AuthError, AccessDeniedError, NotFoundError):
                self._cdn_urls.pop(key, None)  # expired or moved: ask the Hub again
        url = self._url(file)

        def answered(final: str) -> None:
            if _origin(final) != _origin(url):
                self._cdn_urls[key] = final

        # Pinned to a commit, but a CDN or proxy in between may be stale or broken: the sizes
        # are held against the listing all the same.
        return open_range(self.pool, url, file, start, end, where, headers=_HEADERS, private=self._auth(),
                          errors=errors, answered=answered)

    def close(self) -> None:
        self.pool.clear()

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


def _origin(url: str) -> tuple[str, str, int | None]:
    parts = urlsplit(url)
    return (parts.scheme, (parts.hostname or "").lower(), parts.port)
