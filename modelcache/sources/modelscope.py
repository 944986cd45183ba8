"""ModelScope Hub: ``modelscope://owner/model[:revision][/sub/dir]``.

The form mirrors ``hf://``: a repository, a branch or tag (``master`` when none is given) and
an optional sub-folder. The Hub's v1 API, as its official client calls it: the revision must be
one of the repository's branches or tags (``/revisions``), the files are listed recursively
(``/repo/files``, each with its size and sha256), and each file is read by ranged GETs on
``/repo?Revision=...&FilePath=...`` (which the Hub may redirect to its object storage) through
the one HTTP data path. Every byte is verified against the listed sha256, so a branch that
moves during a pull cannot publish a mixed file.

Settings, read from the environment as the official client reads them: ``MODELSCOPE_ENDPOINT``
(default https://www.modelscope.cn) and ``MODELSCOPE_API_TOKEN`` (sent to the Hub only, as a
bearer token and the session cookie the v1 API takes).
"""

from __future__ import annotations

import json
import re
from dataclasses import dataclass
from typing import Any
from urllib.parse import quote, quote_plus, urlencode

from modelcache.errors import AccessDeniedError, AuthError, InvalidURIError, ModelcacheError, NotFoundError, SourceError
from modelcache.sources.base import Source, safe_relpath
from modelcache.sources.credentials import Settings
from modelcache.sources.httpread import Hints, discard, make_pool, open_range, send, status_error
from modelcache.sources.ratelimit import wait_out
from modelcache.sources.remote import Checksum, RangeStream, RemoteFile
from modelcache.sources.uri import Location, redact_uri

DEFAULT_ENDPOINT = "https://www.modelscope.cn"
FORM = "modelscope://owner/model[:revision][/sub/dir]"
_REPO = re.compile(r"[A-Za-z0-9][A-Za-z0-9._-]*/[A-Za-z0-9][A-Za-z0-9._-]*")
_SHA256 = re.compile(r"[0-9a-f]{64}")
#: The Hub returns at most this many entries for one listing (and says nothing about the rest).
_LISTING_LIMIT = 3000


def _invalid(uri: str, why: str) -> InvalidURIError:
    return InvalidURIError(f"invalid storage URI '{redact_uri(uri)}': {why}. Accepted form: {FORM}")


@dataclass(frozen=True)
class ModelScopeLocation(Location):
    credentials_hint = "use MODELSCOPE_API_TOKEN"
    repo_id: str = ""
    revision: str = "master"
    subfolder: str = ""

    @classmethod
    def parse(cls, uri: str) -> ModelScopeLocation:
        rest = uri.split("://", 1)[1].strip("/")
        segments = rest.split("/")
        if len(segments) < 2 or not all(segments):
            raise _invalid(uri, "expected an owner and a model name")
        model, _, revision = segments[1].partition(":")
        if ":" in segments[1] and not revision:
            raise _invalid(uri, "empty revision after ':'")
        repo_id = f"{segments[0]}/{model}"
        if not _REPO.fullmatch(repo_id):
            raise _invalid(uri, f"'{repo_id}' is not a valid ModelScope model id")
        if ".." in segments[2:]:
            raise _invalid(uri, "the sub-folder must not contain '..'")
        return cls(uri=uri, repo_id=repo_id, revision=revision or "master", subfolder="/".join(segments[2:]))


class ModelScopeSource(Source):
    max_streams = 16

    def __init__(self, location: Location, settings: Settings) -> None:
        super().__init__(location, settings)
        assert isinstance(location, ModelScopeLocation)
        self.loc = location
        env = settings.env
        self.endpoint = (env.get("MODELSCOPE_ENDPOINT") or DEFAULT_ENDPOINT).rstrip("/")
        self.token = (env.get("MODELSCOPE_API_TOKEN") or "").strip() or None
        http = settings.http
        verify: bool | str = http.ca_bundle or True if http.verify else False
        self.pool = make_pool(verify, self.max_streams + 4, http.connect_timeout, http.read_timeout)
        self.api = f"{self.endpoint}/api/v1/models/{self.loc.repo_id}"
        self.where = location.display
        self.hints = Hints(
            auth="set MODELSCOPE_API_TOKEN to a token that can read it" if not self.token else
                 "MODELSCOPE_API_TOKEN was refused; set a valid token",
            denied="the token of MODELSCOPE_API_TOKEN cannot read this model",
            missing=f"check the model id '{self.loc.repo_id}' and revision '{self.loc.revision}' "
                    f"at {self.endpoint} (a private model needs MODELSCOPE_API_TOKEN)",
        )

    def _auth(self) -> dict[str, str]:
        """The token, to the Hub's host only (never to the storage a file is redirected to)."""
        if not self.token:
            return {}
        return {"Authorization": f"Bearer {self.token}",
                "Cookie": f"m_session_id={self.token}; modelscope_session={self.token}"}

    def _get_json(self, path: str, params: dict[str, str] | None = None) -> Any:
        url = f"{self.api}{path}" + (f"?{urlencode(params)}" if params else "")
        resp, _ = send(self.pool, "GET", url, {"Accept": "application/json"}, self.where, private=self._auth(),
                       hints=self.hints)
        try:
            if resp.status != 200:
                raise status_error(resp.status, resp.headers, self.where, self.hints)
            body = resp.read(64 << 20)
        finally:
            discard(resp)
        try:
            doc = json.loads(body)
        except ValueError:
            raise SourceError(f"{self.where}: the ModelScope Hub at {self.endpoint} answered {path} with no JSON") \
                from None
        if not isinstance(doc, dict) or doc.get("Success") is False or doc.get("Code") not in (None, 200, 0):
            message = str(doc.get("Message", "")) if isinstance(doc, dict) else ""
            raise SourceError(f"{self.where}: the ModelScope Hub refused {path}: {message[:200] or 'no detail'}")
        return doc.get("Data")

    # ---- listing -------------------------------------------------------------------------
    def list_files(self) -> list[RemoteFile]:
        return wait_out(self._list_files, self.where)  # a 429 on the listing waits its Retry-After

    def _list_files(self) -> list[RemoteFile]:
        revision = self.loc.revision
        revisions = self._get_json("/revisions") or {}
        known = {str(r.get("Revision")) for kind in ("Branches", "Tags")
                 for r in (revisions.get("RevisionMap") or {}).get(kind) or [] if isinstance(r, dict)}
        if revision not in known:
            raise NotFoundError(f"{self.where}: revision '{revision}' not found in ModelScope model "
                                f"'{self.loc.repo_id}' (it has: {', '.join(sorted(known)) or 'none'})")
        sub = self.loc.subfolder.strip("/")
        params = {"Revision": revision, "Recursive": "True"}
        if sub:
            params["Root"] = sub
        data = self._get_json("/repo/files", params) or {}
        entries = data.get("Files") if isinstance(data, dict) else data
        entries = [e for e in entries or [] if isinstance(e, dict)]
        if len(entries) >= _LISTING_LIMIT:
            raise SourceError(f"{self.where}: the listing holds {len(entries)} entries, the most the Hub returns at "
                              "once; pull sub-folders of the model one by one")
        found = (self._file(e, sub) for e in entries if e.get("Type", "blob") != "tree")
        files = [f for f in found if f is not None]
        if not files:
            what = f"folder '{sub}' of " if sub else ""
            raise NotFoundError(f"{self.where}: no files in {what}ModelScope model '{self.loc.repo_id}' at revision "
                                f"'{revision}'")
        self._resolved = revision
        return sorted(files, key=lambda f: f.path)

    def _file(self, entry: dict[str, Any], sub: str) -> RemoteFile | None:
        path = str(entry.get("Path") or "")
        if sub and path == sub:
            rel = path.rsplit("/", 1)[-1]  # the sub-path names this one file
        elif sub and path.startswith(sub + "/"):
            rel = path[len(sub) + 1:]
        elif sub:
            return None
        else:
            rel = path
        sha = str(entry.get("Sha256") or "").lower()
        checksums = (Checksum("sha256", sha),) if _SHA256.fullmatch(sha) else ()
        return RemoteFile(path=safe_relpath(rel, self.where), size=int(entry.get("Size") or 0),
                          version=sha or str(entry.get("Revision") or "") or None, checksums=checksums,
                          meta=(("repo_path", path),))

    # ---- bytes ---------------------------------------------------------------------------
    def open_range(self, file: RemoteFile, start: int, end: int | None) -> RangeStream:
        url = (f"{self.api}/repo?Revision={quote_plus(self.loc.revision)}"
               f"&FilePath={quote_plus(file.meta_get('repo_path', file.path))}")
        return open_range(self.pool, url, file, start, end, f"{self.where}: {file.path}", private=self._auth(),
                          hints=self.hints, errors=lambda resp: self._read_error(resp, file))

    def _read_error(self, resp: Any, file: RemoteFile) -> ModelcacheError | None:
        if resp.status == 404:
            return NotFoundError(f"{self.where}: file '{file.path}' is gone from ModelScope model "
                                 f"'{self.loc.repo_id}' at revision '{self.loc.revision}' (moved since listing?); "
                                 "pull again")
        if resp.status in (401, 403):
            err = status_error(resp.status, resp.headers, self.where, self.hints)
            return AuthError(str(err)) if resp.status == 401 else AccessDeniedError(str(err))
        return None

    @property
    def resolved_uri(self) -> str:
        sub = f"/{quote(self.loc.subfolder.strip('/'))}" if self.loc.subfolder.strip("/") else ""
        return f"modelscope://{self.loc.repo_id}:{self.loc.revision}{sub}"

    def close(self) -> None:
        self.pool.clear()
