"""A small Hugging Face Hub server for tests, faithful to what huggingface_hub calls.

Endpoints (those huggingface_hub calls): ``GET /api/models/{repo}[/revision/{rev}]``,
``GET /api/models/{repo}/tree/{rev}[/{path}]`` (recursive, expand, ``Link: rel="next"``
pagination), ``GET /api/models/{repo}/refs``, ``POST /api/models/{repo}/paths-info/{rev}``,
``HEAD|GET /{repo}/resolve/{rev}/{path}``. LFS
files answer with a 302 to a second listener (the "CDN", another origin, so clients must
drop the Authorization header) carrying ``X-Repo-Commit``, ``X-Linked-Etag`` and
``X-Linked-Size`` as the real Hub does. Both listeners serve single ``Range`` requests
(206/416). Errors carry ``X-Error-Code`` like the Hub: RepoNotFound (401 anonymous, 404 with
a token), GatedRepo (401/403), RevisionNotFound, EntryNotFound.

Tests drive it while it runs: add repos and commits, move branches and tags, inject failures
(429 + Retry-After, 5xx), corrupt served bytes, hook requests, and count them.
"""

from __future__ import annotations

import base64
import hashlib
import hmac
import json
import re
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from urllib.parse import parse_qs, quote, unquote, urlsplit

from tests.hfhub.repo import Commit, HubFile, HubRepo

_REPO = r"(?P<repo>[^/]+/[^/]+)"
_ROUTES: list[tuple[str, re.Pattern[str], str]] = [
    ("GET", re.compile(rf"^/api/models/{_REPO}/revision/(?P<rev>.+)$"), "revision_info"),
    ("GET", re.compile(rf"^/api/models/{_REPO}/tree/(?P<rev>[^/]+)(?:/(?P<path>.*))?$"), "tree"),
    ("GET", re.compile(rf"^/api/models/{_REPO}/refs$"), "refs"),
    ("POST", re.compile(rf"^/api/models/{_REPO}/paths-info/(?P<rev>[^/]+)$"), "paths_info"),
    ("GET", re.compile(rf"^/api/models/{_REPO}$"), "model_info"),
    ("HEAD", re.compile(rf"^/{_REPO}/resolve/(?P<rev>[^/]+)/(?P<path>.+)$"), "resolve"),
    ("GET", re.compile(rf"^/{_REPO}/resolve/(?P<rev>[^/]+)/(?P<path>.+)$"), "resolve"),
]
_CDN_ROUTE = re.compile(r"^/lfs/(?P<sha>[0-9a-f]{64})$")
INVALID_TOKEN_MESSAGE = "Invalid credentials in Authorization header"


@dataclass(frozen=True)
class Request:
    """What the server saw; ``origin`` is "hub" or "cdn"."""

    origin: str
    method: str
    path: str
    query: str
    range: str | None
    authorized: bool


@dataclass
class _Failure:
    when: Callable[[Request], bool]
    status: int
    headers: dict[str, str]
    remaining: int


@dataclass
class _Hook:
    when: Callable[[Request], bool]
    action: Callable[[Request], None]
    remaining: int


class _HTTPError(Exception):
    def __init__(self, status: int, message: str, code: str | None = None) -> None:
        super().__init__(message)
        self.status, self.message, self.code = status, message, code


@dataclass
class HubServer:
    """Start with ``start()`` (binds two free ports on 127.0.0.1), stop with ``stop()``."""

    lfs_threshold: int = 64 * 1024
    tree_page_size: int = 1000
    redirect_status: int = 302
    #: Bytes per second for file bodies (None: unthrottled), to catch a client mid-download.
    throttle_bps: float | None = None
    tokens: set[str] = field(default_factory=set)
    repos: dict[str, HubRepo] = field(default_factory=dict)
    requests: list[Request] = field(default_factory=list)

    def __post_init__(self) -> None:
        self._lock = threading.RLock()
        self._failures: list[_Failure] = []
        self._hooks: list[_Hook] = []
        self._secret = b"cdn-signing-key"
        self.body_bytes_sent = 0
        #: sha256 of a file -> how many of its next non-empty bodies get their first byte flipped.
        self.flip_next: dict[str, int] = {}
        self.flipped = 0
        self._hub: ThreadingHTTPServer | None = None
        self._cdn: ThreadingHTTPServer | None = None

    # ---- lifecycle -------------------------------------------------------------------
    def start(self) -> HubServer:
        self._hub = _serve(self, "hub")
        self._cdn = _serve(self, "cdn")
        return self

    def stop(self) -> None:
        for srv in (self._hub, self._cdn):
            if srv is not None:
                srv.shutdown()
                srv.server_close()

    @property
    def url(self) -> str:
        assert self._hub is not None
        return f"http://127.0.0.1:{self._hub.server_address[1]}"

    @property
    def cdn_url(self) -> str:
        assert self._cdn is not None
        return f"http://127.0.0.1:{self._cdn.server_address[1]}"

    # ---- test controls ---------------------------------------------------------------
    def create_repo(self, repo_id: str, *, private: bool = False, gated: bool = False) -> HubRepo:
        with self._lock:
            repo = HubRepo(repo_id, lfs_threshold=self.lfs_threshold, private=private, gated=gated)
            self.repos[repo_id] = repo
            return repo

    def fail(
        self,
        status: int = 429,
        *,
        count: int = 1,
        retry_after: float | None = None,
        error_code: str | None = None,
        when: Callable[[Request], bool] = lambda r: True,
    ) -> None:
        """Answer the next ``count`` matching requests with ``status`` (Retry-After, X-Error-Code if given)."""
        headers = {} if retry_after is None else {"Retry-After": f"{retry_after:g}"}
        if error_code is not None:
            headers["X-Error-Code"] = error_code
        with self._lock:
            self._failures.append(_Failure(when, status, headers, count))

    def on_request(self, action: Callable[[Request], None], *, when: Callable[[Request], bool], count: int = 1) -> None:
        """Run ``action`` before serving the next ``count`` matching requests."""
        with self._lock:
            self._hooks.append(_Hook(when, action, count))

    def clear_injections(self) -> None:
        """Drop pending injected failures and request hooks."""
        with self._lock:
            self._failures.clear()
            self._hooks.clear()

    def count(self, *, origin: str | None = None, method: str | None = None, contains: str = "") -> int:
        with self._lock:
            return sum(
                1
                for r in self.requests
                if (origin is None or r.origin == origin)
                and (method is None or r.method == method)
                and contains in r.path
            )

    def rotate_cdn_secret(self) -> None:
        """Invalidate every CDN URL handed out so far (as expiring signed URLs do)."""
        self._secret = hashlib.sha256(self._secret).digest()

    def cdn_url_for(self, f: HubFile) -> str:
        sig = hmac.new(self._secret, f.sha256.encode(), hashlib.sha256).hexdigest()
        return f"{self.cdn_url}/lfs/{f.sha256}?X-Sig={sig}&X-Expires=4102444800"

    # ---- request handling (called from handler threads) ------------------------------
    def _admit(self, req: Request) -> _Failure | None:
        with self._lock:
            self.requests.append(req)
            hooks = [h for h in self._hooks if h.remaining > 0 and h.when(req)]
            for h in hooks:
                h.remaining -= 1
            failure = next((f for f in self._failures if f.remaining > 0 and f.when(req)), None)
            if failure is not None:
                failure.remaining -= 1
        for h in hooks:
            h.action(req)
        return failure

    def _repo_for(self, repo_id: str, token: str | None, *, files: bool) -> HubRepo:
        if token is not None and token not in self.tokens:
            raise _HTTPError(401, INVALID_TOKEN_MESSAGE)
        repo = self.repos.get(repo_id)
        if repo is None or (repo.private and token not in repo.allowed_tokens):
            # The Hub does not reveal whether a private repo exists.
            raise _HTTPError(401 if token is None else 404, "Repository not found", "RepoNotFound")
        if files and repo.gated and token not in repo.allowed_tokens:
            raise _HTTPError(
                401 if token is None else 403,
                f"Access to model {repo_id} is restricted. You must have access to it and be authenticated.",
                "GatedRepo",
            )
        return repo

    @staticmethod
    def _commit(repo: HubRepo, rev: str) -> Commit:
        commit = repo.resolve(rev)
        if commit is None:
            raise _HTTPError(404, f"Invalid rev id: {rev}", "RevisionNotFound")
        return commit


def _serve(hub: HubServer, origin: str) -> ThreadingHTTPServer:
    handler = type(f"{origin.title()}Handler", (_Handler,), {"hub": hub, "origin": origin})
    srv = ThreadingHTTPServer(("127.0.0.1", 0), handler)
    srv.daemon_threads = True
    threading.Thread(target=srv.serve_forever, args=(0.05,), name=f"hfhub-{origin}", daemon=True).start()
    return srv


def _iso(commit: Commit) -> str:
    return commit.date.strftime("%Y-%m-%dT%H:%M:%S.000Z")


def _truthy(values: list[str] | None) -> bool:
    return bool(values) and values[0].lower() in ("1", "true", "yes")


def _parse_range(header: str | None, size: int) -> tuple[int, int] | str | None:
    """(start, end_inclusive), None to serve the whole file, "unsatisfiable" for a 416."""
    if not header:
        return None
    m = re.fullmatch(r"\s*bytes\s*=\s*(\d*)\s*-\s*(\d*)\s*", header)
    if m is None or (not m.group(1) and not m.group(2)):
        return None  # multi-range or malformed: RFC 9110 lets a server ignore it
    if not m.group(1):
        n = int(m.group(2))
        if n == 0:
            return "unsatisfiable"
        return (max(0, size - n), size - 1)
    start = int(m.group(1))
    end = int(m.group(2)) if m.group(2) else size - 1
    if start >= size or end < start:
        return "unsatisfiable"
    return (start, min(end, size - 1))


class _Handler(BaseHTTPRequestHandler):
    protocol_version = "HTTP/1.1"
    hub: HubServer
    origin: str
    post_body: bytes = b""

    def log_message(self, format: str, *args: object) -> None:  # quiet test output
        pass

    def do_GET(self) -> None:
        self._dispatch()

    def do_HEAD(self) -> None:
        self._dispatch()

    def do_POST(self) -> None:
        # Read the body first: an injected failure or an error must not leave it on a kept-alive connection.
        length = int(self.headers.get("Content-Length") or 0)
        self.post_body = self.rfile.read(length) if length else b""
        self._dispatch()

    def _token(self) -> str | None:
        auth = self.headers.get("Authorization", "")
        return auth[len("Bearer ") :].strip() if auth.startswith("Bearer ") else None

    def _dispatch(self) -> None:
        split = urlsplit(self.path)
        req = Request(
            self.origin,
            self.command,
            split.path,
            split.query,
            self.headers.get("Range"),
            "Authorization" in self.headers,
        )
        try:
            failure = self.hub._admit(req)
            if failure is not None:
                self._send_json(failure.status, {"error": "injected failure"}, failure.headers)
                return
            if self.origin == "cdn":
                self._cdn(split.path, parse_qs(split.query))
                return
            for method, pattern, name in _ROUTES:
                if method == self.command and (m := pattern.match(split.path)):
                    getattr(self, f"_{name}")(m, parse_qs(split.query))
                    return
            raise _HTTPError(404, f"no route for {self.command} {split.path}")
        except _HTTPError as err:
            headers = {"X-Error-Message": err.message}
            if err.code:
                headers["X-Error-Code"] = err.code
            self._send_json(err.status, {"error": err.message}, headers)
        except (BrokenPipeError, ConnectionResetError):
            pass

    # ---- responses -------------------------------------------------------------------
    def _send(self, status: int, body: bytes, headers: dict[str, str]) -> None:
        self.send_response(status)
        for k, v in headers.items():
            self.send_header(k, v)
        self.send_header("Content-Length", headers.get("Content-Length", str(len(body))))
        self.end_headers()
        if self.command != "HEAD":
            view = memoryview(body)
            bps = self.hub.throttle_bps if status in (200, 206) and headers.get("Accept-Ranges") else None
            piece = 1 << 20 if bps is None else max(1024, int(bps / 20))
            for off in range(0, len(view), piece):
                self.wfile.write(view[off : off + piece])
                with self.hub._lock:
                    self.hub.body_bytes_sent += len(view[off : off + piece])
                if bps is not None:
                    time.sleep(len(view[off : off + piece]) / bps)

    def _send_json(self, status: int, obj: object, headers: dict[str, str] | None = None) -> None:
        self._send(status, json.dumps(obj).encode(), {"Content-Type": "application/json", **(headers or {})})

    def _send_content(self, f: HubFile, extra: dict[str, str]) -> None:
        data = f.served_bytes()
        headers = {
            "Accept-Ranges": "bytes",
            "Content-Type": "application/octet-stream",
            "ETag": f'"{f.etag}"',
            **extra,
        }
        rng = _parse_range(self.headers.get("Range"), len(data))
        if rng == "unsatisfiable":
            self._send(416, b"", {**headers, "Content-Range": f"bytes */{len(data)}"})
        elif rng is None:
            self._send(200, data, headers)
        else:
            assert isinstance(rng, tuple)
            start, end = rng
            body = data[start : end + 1]
            with self.hub._lock:
                if body and self.hub.flip_next.get(f.sha256, 0) > 0:
                    self.hub.flip_next[f.sha256] -= 1
                    self.hub.flipped += 1
                    body = bytes([body[0] ^ 0xFF]) + body[1:]
            self._send(206, body, {**headers, "Content-Range": f"bytes {start}-{end}/{len(data)}"})

    # ---- Hub API -----------------------------------------------------------------------
    def _info(self, repo: HubRepo, commit: Commit) -> dict[str, object]:
        owner = repo.repo_id.split("/")[0]
        return {
            "_id": hashlib.md5(repo.repo_id.encode()).hexdigest()[:24],
            "id": repo.repo_id,
            "modelId": repo.repo_id,
            "author": owner,
            "sha": commit.sha,
            "lastModified": _iso(commit),
            "createdAt": _iso(commit),
            "private": repo.private,
            "gated": "manual" if repo.gated else False,
            "disabled": False,
            "downloads": 0,
            "likes": 0,
            "tags": [],
            "siblings": [{"rfilename": p} for p in sorted(commit.files)],
        }

    def _model_info(self, m: re.Match[str], q: dict[str, list[str]]) -> None:
        repo = self.hub._repo_for(m["repo"], self._token(), files=False)
        self._send_json(200, self._info(repo, self.hub._commit(repo, "main")))

    def _revision_info(self, m: re.Match[str], q: dict[str, list[str]]) -> None:
        repo = self.hub._repo_for(m["repo"], self._token(), files=False)
        self._send_json(200, self._info(repo, self.hub._commit(repo, unquote(m["rev"]))))

    def _refs(self, m: re.Match[str], q: dict[str, list[str]]) -> None:
        repo = self.hub._repo_for(m["repo"], self._token(), files=False)
        with repo.lock:
            refs = {
                "branches": [
                    {"name": n, "ref": f"refs/heads/{n}", "targetCommit": s} for n, s in repo.branches.items()
                ],
                "converts": [],
                "tags": [{"name": n, "ref": f"refs/tags/{n}", "targetCommit": s} for n, s in repo.tags.items()],
            }
        self._send_json(200, refs)

    def _tree(self, m: re.Match[str], q: dict[str, list[str]]) -> None:
        repo = self.hub._repo_for(m["repo"], self._token(), files=False)
        rev = unquote(m["rev"])
        commit = self.hub._commit(repo, rev)
        base = unquote(m["path"] or "").strip("/")
        recursive, expand = _truthy(q.get("recursive")), _truthy(q.get("expand"))
        entries = self._tree_entries(commit, base, recursive, expand)
        if base and not entries and base not in commit.files:
            raise _HTTPError(404, f'File not found: "{base}" does not exist on "{rev}"', "EntryNotFound")
        offset = int(base64.urlsafe_b64decode(q["cursor"][0]).decode()) if q.get("cursor") else 0
        page = entries[offset : offset + self.hub.tree_page_size]
        headers: dict[str, str] = {}
        if offset + len(page) < len(entries):
            cursor = base64.urlsafe_b64encode(str(offset + len(page)).encode()).decode()
            path = f"/api/models/{repo.repo_id}/tree/{quote(rev, safe='')}" + (f"/{quote(base)}" if base else "")
            nxt = f"http://{self.headers['Host']}{path}?recursive={recursive}&expand={expand}&cursor={cursor}"
            headers["Link"] = f'<{nxt}>; rel="next"'
        self._send_json(200, page, headers)

    def _paths_info(self, m: re.Match[str], q: dict[str, list[str]]) -> None:
        """``get_paths_info``: a form body ``paths=...&expand=...``; the entries that exist, as
        in a tree listing (missing paths are left out, not an error)."""
        form = parse_qs(self.post_body.decode())
        repo = self.hub._repo_for(m["repo"], self._token(), files=False)
        commit = self.hub._commit(repo, unquote(m["rev"]))
        wanted = {p.strip("/") for p in form.get("paths", [])}
        entries = self._tree_entries(commit, "", True, _truthy(form.get("expand")))
        self._send_json(200, [e for e in entries if e["path"] in wanted])

    @staticmethod
    def _tree_entries(commit: Commit, base: str, recursive: bool, expand: bool) -> list[dict[str, object]]:
        prefix = base + "/" if base else ""

        def wanted(path: str) -> bool:
            return path.startswith(prefix) and (recursive or "/" not in path[len(prefix) :])

        out: list[dict[str, object]] = []
        for d in commit.directories():
            if wanted(d):
                out.append({"type": "directory", "oid": commit.tree_oid(d), "size": 0, "path": d})
        for path, f in sorted(commit.files.items()):
            if not wanted(path):
                continue
            entry: dict[str, object] = {"type": "file", "oid": f.blob_oid, "size": len(f.data), "path": path}
            if f.lfs:
                entry["lfs"] = {"oid": f.sha256, "size": len(f.data), "pointerSize": f.pointer_size}
            if expand:
                entry["lastCommit"] = {"id": commit.sha, "title": commit.title, "date": _iso(commit)}
                entry["securityFileStatus"] = {
                    "status": "safe",
                    "avScan": {"virusFound": False, "virusNames": None},
                    "pickleImportScan": None,
                }
            out.append(entry)
        out.sort(key=lambda e: str(e["path"]))
        return out

    def _resolve(self, m: re.Match[str], q: dict[str, list[str]]) -> None:
        repo = self.hub._repo_for(m["repo"], self._token(), files=True)
        rev = unquote(m["rev"])
        commit = self.hub._commit(repo, rev)
        path = unquote(m["path"])
        f = commit.files.get(path)
        if f is None:
            raise _HTTPError(404, f"Entry not found: {path} at {rev}", "EntryNotFound")
        if f.lfs:
            location = self.hub.cdn_url_for(f)
            body = f"Found. Redirecting to {location}".encode()
            self._send(
                self.hub.redirect_status,
                body,
                {
                    "Location": location,
                    "X-Repo-Commit": commit.sha,
                    "X-Linked-Etag": f'"{f.sha256}"',
                    "X-Linked-Size": str(len(f.data)),
                    "ETag": f'"{f.blob_oid}"',
                    "Content-Type": "text/plain; charset=utf-8",
                },
            )
            return
        self._send_content(f, {"X-Repo-Commit": commit.sha})

    # ---- CDN ----------------------------------------------------------------------------
    def _cdn(self, path: str, q: dict[str, list[str]]) -> None:
        m = _CDN_ROUTE.match(path)
        if m is None or self.command not in ("GET", "HEAD"):
            raise _HTTPError(404, "NoSuchKey")
        sha = m["sha"]
        expected = hmac.new(self.hub._secret, sha.encode(), hashlib.sha256).hexdigest()
        if not hmac.compare_digest(expected, (q.get("X-Sig") or [""])[0]):
            raise _HTTPError(403, "AccessDenied: bad signature")
        f = self._find_lfs(sha)
        if f is None:
            raise _HTTPError(404, "NoSuchKey")
        self._send_content(f, {})

    def _find_lfs(self, sha: str) -> HubFile | None:
        for repo in list(self.hub.repos.values()):
            with repo.lock:
                for commit in repo.commits.values():
                    for f in commit.files.values():
                        if f.lfs and f.sha256 == sha:
                            return f
        return None
