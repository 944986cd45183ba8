"""A small ModelScope Hub for tests, shaped as the official client (modelscope / modelscope-hub)
calls it: the v1 API under ``/api/v1/models/{owner}/{name}``.

``GET  /api/v1/models/{id}``                          the model's info (404 if unknown or private)
``GET  /api/v1/models/{id}/revisions``                ``RevisionMap`` of branches and tags
``GET  /api/v1/models/{id}/repo/files``               ``Revision``, ``Recursive``, ``Root``: the files
                                                       (Path, Name, Type, Size, Sha256, Revision)
``GET|HEAD /api/v1/models/{id}/repo``                 ``Revision``, ``FilePath``: the bytes, single
                                                       ``Range`` (206/416); files of ``redirect_over``
                                                       bytes or more answer with a 302 to a second
                                                       listener (the object storage, another origin)

Every answer is JSON ``{"Code": ..., "Message": ..., "Data": ..., "Success": ...}`` as the Hub's.
A private model needs ``Authorization: Bearer <token>`` or the ``m_session_id`` cookie.

Tests drive it while it runs: models with branches and tags, 429 (Retry-After) or 5xx answers,
a flipped byte in one body, a rate limit, hooks before requests, and counters.
"""

from __future__ import annotations

import hashlib
import json
import re
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from urllib.parse import parse_qs, urlsplit

_ID = r"(?P<repo>[^/]+/[^/]+)"
_ROUTES: list[tuple[tuple[str, ...], re.Pattern[str], str]] = [
    (("GET",), re.compile(rf"^/api/v1/models/{_ID}/revisions$"), "revisions"),
    (("GET",), re.compile(rf"^/api/v1/models/{_ID}/repo/files$"), "files"),
    (("GET", "HEAD"), re.compile(rf"^/api/v1/models/{_ID}/repo$"), "repo"),
    (("GET",), re.compile(rf"^/api/v1/models/{_ID}$"), "info"),
]


@dataclass
class MSFile:
    path: str
    data: bytes

    @property
    def sha256(self) -> str:
        return hashlib.sha256(self.data).hexdigest()


@dataclass
class MSModel:
    """A model: each revision (branch or tag) names a file tree; a commit moves a branch."""

    model_id: str
    private: bool = False
    revisions: dict[str, dict[str, MSFile]] = field(default_factory=dict)
    tags: set[str] = field(default_factory=set)
    commits: int = 0

    def commit(self, files: dict[str, bytes], branch: str = "master") -> None:
        """A new tree on ``branch``: its files updated or added (others kept)."""
        tree = dict(self.revisions.get(branch, {}))
        tree.update({p: MSFile(p, d) for p, d in files.items()})
        self.revisions[branch] = tree
        self.commits += 1

    def tag(self, name: str, branch: str = "master") -> None:
        self.revisions[name] = dict(self.revisions[branch])
        self.tags.add(name)


@dataclass(frozen=True)
class MSRequest:
    origin: str  # "hub" or "storage"
    method: str
    path: str
    query: dict[str, str]
    range: str | None
    token: str | None


@dataclass
class _Rule:
    when: Callable[[MSRequest], bool]
    remaining: int
    status: int = 0
    headers: dict[str, str] = field(default_factory=dict)
    action: Callable[[MSRequest], None] | None = None


class MSHub:
    def __init__(self, redirect_over: int = 256 << 10) -> None:
        self.models: dict[str, MSModel] = {}
        self.tokens: set[str] = set()
        self.redirect_over = redirect_over
        self.requests: list[MSRequest] = []
        self.throttle_bps: float | None = None
        self.body_bytes_sent = 0
        self.flip_next: dict[str, int] = {}  # sha256 -> bodies of it to flip one byte in
        self.flipped = 0
        self._rules: list[_Rule] = []
        self._lock = threading.RLock()
        self._servers: list[ThreadingHTTPServer] = []
        self.url = self.storage_url = ""

    # ---- lifecycle -------------------------------------------------------------------
    def start(self) -> MSHub:
        for origin in ("hub", "storage"):
            srv = ThreadingHTTPServer(("127.0.0.1", 0), _handler(self, origin))
            srv.daemon_threads = True
            threading.Thread(target=srv.serve_forever, daemon=True).start()
            self._servers.append(srv)
            url = f"http://127.0.0.1:{srv.server_address[1]}"
            if origin == "hub":
                self.url = url
            else:
                self.storage_url = url
        return self

    def stop(self) -> None:
        for srv in self._servers:
            srv.shutdown()
            srv.server_close()

    # ---- driving it ------------------------------------------------------------------
    def create_model(self, model_id: str, files: dict[str, bytes], private: bool = False) -> MSModel:
        model = MSModel(model_id, private)
        model.commit(files)
        self.models[model_id] = model
        return model

    def fail(self, status: int, *, when: Callable[[MSRequest], bool], count: int = 1,
             retry_after: float | None = None) -> None:
        headers = {} if retry_after is None else {"Retry-After": f"{retry_after:g}"}
        with self._lock:
            self._rules.append(_Rule(when, count, status, headers))

    def on_request(self, action: Callable[[MSRequest], None], *, when: Callable[[MSRequest], bool],
                   count: int = 1) -> None:
        with self._lock:
            self._rules.append(_Rule(when, count, action=action))

    def _admit(self, req: MSRequest) -> _Rule | None:
        with self._lock:
            self.requests.append(req)
            rules = [r for r in self._rules if r.remaining > 0 and r.when(req)]
            for r in rules:
                r.remaining -= 1
        for r in rules:
            if r.action is not None:
                r.action(req)
        return next((r for r in rules if r.status), None)

    def storage_link(self, f: MSFile) -> str:
        return f"{self.storage_url}/objects/{f.sha256}?Signature=test-{f.sha256[:8]}"

    def object(self, sha256: str) -> MSFile | None:
        for model in self.models.values():
            for tree in model.revisions.values():
                for f in tree.values():
                    if f.sha256 == sha256:
                        return f
        return None


class _Error(Exception):
    def __init__(self, status: int, message: str) -> None:
        super().__init__(message)
        self.status, self.message = status, message


def _token(h: BaseHTTPRequestHandler) -> str | None:
    auth = h.headers.get("Authorization", "")
    if auth.startswith("Bearer "):
        return auth[7:]
    m = re.search(r"m_session_id=([^;\s]+)", h.headers.get("Cookie", ""))
    return m.group(1) if m else None


def _handler(hub: MSHub, origin: str) -> type[BaseHTTPRequestHandler]:
    class Handler(BaseHTTPRequestHandler):
        protocol_version = "HTTP/1.1"

        def log_message(self, *args: object) -> None:
            pass

        def do_GET(self) -> None:
            self._dispatch()

        def do_HEAD(self) -> None:
            self._dispatch()

        def _dispatch(self) -> None:
            split = urlsplit(self.path)
            query = {k: v[0] for k, v in parse_qs(split.query).items()}
            req = MSRequest(origin, self.command, split.path, query, self.headers.get("Range"), _token(self))
            try:
                rule = hub._admit(req)
                if rule is not None:
                    raise _Error(rule.status, "injected failure") from None
                if origin == "storage":
                    self._object(split.path)
                    return
                for methods, pattern, name in _ROUTES:
                    if self.command in methods and (m := pattern.match(split.path)):
                        getattr(self, f"_{name}")(self._model(m["repo"], req), query)
                        return
                raise _Error(404, f"no route for {self.command} {split.path}")
            except _Error as err:
                headers = dict(rule.headers) if rule is not None and err.message == "injected failure" else {}
                self._json(err.status, None, err.message, headers)
            except (BrokenPipeError, ConnectionResetError):
                pass

        def _model(self, model_id: str, req: MSRequest) -> MSModel:
            model = hub.models.get(model_id)
            if model is None or (model.private and req.token not in hub.tokens):
                raise _Error(404, f"model {model_id} not found")
            return model

        @staticmethod
        def _tree(model: MSModel, revision: str) -> dict[str, MSFile]:
            tree = model.revisions.get(revision)
            if tree is None:
                raise _Error(404, f"revision {revision} not found")
            return tree

        # ---- API ---------------------------------------------------------------------
        def _info(self, model: MSModel, q: dict[str, str]) -> None:
            owner, name = model.model_id.split("/")
            self._json(200, {"Id": abs(hash(model.model_id)) % 10**6, "Name": name, "Path": owner,
                             "ChineseName": "", "Visibility": 1 if model.private else 5, "IsPublished": 1})

        def _revisions(self, model: MSModel, q: dict[str, str]) -> None:
            def entry(name: str) -> dict[str, object]:
                return {"Revision": name, "CreatedAt": 1700000000 + model.commits, "Description": ""}

            self._json(200, {"RevisionMap": {
                "Branches": [entry(n) for n in sorted(model.revisions) if n not in model.tags],
                "Tags": [entry(n) for n in sorted(model.tags)],
            }})

        def _files(self, model: MSModel, q: dict[str, str]) -> None:
            tree = self._tree(model, q.get("Revision", "master"))
            root = q.get("Root", "").strip("/")
            recursive = q.get("Recursive", "False").lower() == "true"
            out: list[dict[str, object]] = []
            dirs: set[str] = set()
            for path, f in sorted(tree.items()):
                if root and not (path == root or path.startswith(root + "/")):
                    continue
                rest = path[len(root) + 1:] if root and path != root else path
                if not recursive and "/" in rest:
                    dirs.add((root + "/" if root else "") + rest.split("/", 1)[0])
                    continue
                out.append({"Name": path.rsplit("/", 1)[-1], "Path": path, "Type": "blob", "Size": len(f.data),
                            "Sha256": f.sha256, "Revision": f"{model.commits:040x}", "IsLFS": len(f.data) > 1024,
                            "Mode": "33188"})
            out += [{"Name": d.rsplit("/", 1)[-1], "Path": d, "Type": "tree", "Size": 0} for d in sorted(dirs)]
            self._json(200, {"Files": out, "LatestCommitter": {}})

        def _repo(self, model: MSModel, q: dict[str, str]) -> None:
            tree = self._tree(model, q.get("Revision", "master"))
            f = tree.get(q.get("FilePath", ""))
            if f is None:
                raise _Error(404, f"file {q.get('FilePath')} not found")
            if len(f.data) >= hub.redirect_over:
                self._send(302, b"", {"Location": hub.storage_link(f)})
                return
            self._content(f)

        def _object(self, path: str) -> None:
            m = re.fullmatch(r"/objects/([0-9a-f]{64})", path)
            f = hub.object(m.group(1)) if m else None
            if f is None:
                self._send(404, b"<Error><Code>NoSuchKey</Code></Error>", {"Content-Type": "application/xml"})
                return
            self._content(f)

        # ---- responses ---------------------------------------------------------------
        def _content(self, f: MSFile) -> None:
            data = f.data
            headers = {"Accept-Ranges": "bytes", "ETag": f'"{f.sha256}"', "Content-Type": "application/octet-stream"}
            rng = self.headers.get("Range")
            status, body = 200, data
            if rng:
                m = re.fullmatch(r"bytes=(\d+)-(\d*)", rng.strip())
                start = int(m.group(1)) if m else 0
                end = min(int(m.group(2)), len(data) - 1) if m and m.group(2) else len(data) - 1
                if start >= len(data):
                    self._send(416, b"", {**headers, "Content-Range": f"bytes */{len(data)}"})
                    return
                status, body = 206, data[start:end + 1]
                headers["Content-Range"] = f"bytes {start}-{end}/{len(data)}"
            with hub._lock:
                if body and hub.flip_next.get(f.sha256, 0) > 0:
                    hub.flip_next[f.sha256] -= 1
                    hub.flipped += 1
                    body = bytes([body[0] ^ 0xFF]) + body[1:]
            self._send(status, body, headers, counted=True)

        def _json(self, status: int, data: object, message: str = "", headers: dict[str, str] | None = None) -> None:
            ok = status == 200
            doc = {"Code": 200 if ok else status, "Message": message or ("success" if ok else "error"),
                   "Data": data, "Success": ok, "RequestId": "test"}
            self._send(status, json.dumps(doc).encode(), {"Content-Type": "application/json", **(headers or {})})

        def _send(self, status: int, body: bytes, headers: dict[str, str], counted: bool = False) -> None:
            self.send_response(status)
            for k, v in headers.items():
                self.send_header(k, v)
            self.send_header("Content-Length", str(len(body)))
            self.end_headers()
            if self.command == "HEAD":
                return
            bps = hub.throttle_bps if counted else None
            step = 64 << 10 if bps is None else max(1024, int(bps / 20))
            for off in range(0, len(body), step):
                piece = body[off:off + step]
                self.wfile.write(piece)
                if counted:
                    with hub._lock:
                        hub.body_bytes_sent += len(piece)
                if bps:
                    time.sleep(len(piece) / bps)

    return Handler


__all__ = ["MSFile", "MSHub", "MSModel", "MSRequest"]
