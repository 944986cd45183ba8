"""HTTP pulls against real nginx: exact bytes for every size class, Range or not, TLS, headers, digests."""

from __future__ import annotations

import base64
import hashlib
import json
import subprocess
import sys
from collections.abc import Callable
from pathlib import Path

import pytest

from modelcache.engine.transfer import TransferOptions
from modelcache.errors import AuthError, IntegrityError, NotFoundError, SourceError
from modelcache.pull import pull, pull_many
from modelcache.sources.credentials import Settings
from modelcache.sources.remote import RemoteFile
from modelcache.sources.uri import storage_key
from modelcache.store import NodeStore
from tests.contract import BackendContract, NetworkContract, ProxyTarget, Target
from tests.faultproxy import FaultProxy
from tests.fixtures.http import NginxServer

CHUNK = 64 * 1024
OPTS = TransferOptions(workers=4, chunk_size=CHUNK, backoff_initial=0.01)


def sha(p: Path) -> str:
    return hashlib.sha256(p.read_bytes()).hexdigest()


def model_file(root: Path, uri: str) -> Path:
    folder = root / "models" / storage_key(uri)
    (only,) = [p for p in folder.rglob("*") if p.is_file()]
    return only


@pytest.mark.parametrize(
    "size",
    [0, 1, CHUNK, CHUNK - 1, CHUNK + 1, 2 * CHUNK - 1, 2 * CHUNK, 2 * CHUNK + 1, 37 * CHUNK + 4097],
)
@pytest.mark.parametrize("listener", ["http", "norange"])
def test_exact_bytes_for_every_size(nginx, tmp_path, size, listener):
    src = nginx.write(f"m/f{size}.bin", size)
    uri = nginx.url(f"m/f{size}.bin", listener)
    res = pull(uri, root=tmp_path / "root", options=OPTS, settings=Settings.from_env({}))
    out = model_file(tmp_path / "root", uri)
    assert sha(out) == sha(src)
    assert res.bytes == size and res.files == 1 and not res.cached
    gets = nginx.requests_for(f"m/f{size}.bin")
    if listener == "norange" or size <= 1:
        assert len(gets) <= 2  # probe + one whole-file stream
    else:
        # the one-byte probe plus at most one GET per chunk (fewer when the engine sees
        # that starting a response costs more than a chunk's transfer and merges requests)
        assert 2 <= len(gets) <= 1 + -(-size // CHUNK)
        assert all(e.status == 206 for e in gets) or size <= CHUNK
    assert NodeStore.at(tmp_path / "root").verify(storage_key(uri)) == []


def test_many_files_one_call_and_cache_hit(nginx, tmp_path):
    uris = []
    for i in range(24):
        nginx.write(f"shards/{i}.bin", 1000 * i + 7)
        uris.append(nginx.url(f"shards/{i}.bin"))
    results = pull_many(uris, root=tmp_path / "root", options=OPTS, settings=Settings.from_env({}))
    assert all(not isinstance(r, BaseException) for r in results), results
    for i, uri in enumerate(uris):
        assert sha(model_file(tmp_path / "root", uri)) == sha(nginx.docroot / f"shards/{i}.bin")
    nginx.clear_access_log()
    again = pull_many(uris, root=tmp_path / "root", options=OPTS, settings=Settings.from_env({}))
    assert all(r.cached for r in again)  # type: ignore[union-attr]
    assert nginx.access_log() == []  # a cache hit sends no request at all


def test_nested_folder_from_local_source(tmp_path):
    src = tmp_path / "src"
    for rel, size in {"a/b/c.bin": 3 * CHUNK + 5, "a/x.json": 12, "top.safetensors": CHUNK, "empty": 0}.items():
        (src / rel).parent.mkdir(parents=True, exist_ok=True)
        (src / rel).write_bytes(bytes(range(256)) * (size // 256) + b"z" * (size % 256))
    res = pull(f"file://{src}", root=tmp_path / "root", options=OPTS, settings=Settings.from_env({}))
    for rel in ("a/b/c.bin", "a/x.json", "top.safetensors", "empty"):
        assert sha(res.path / rel) == sha(src / rel)
    assert res.files == 4


def test_https_with_custom_ca(nginx, tmp_path):
    nginx.write("tls/w.bin", 3 * CHUNK)
    uri = nginx.url("tls/w.bin", "https")
    settings = Settings.from_env({"MODELCACHE_CA_BUNDLE": str(nginx.ca_path)})
    res = pull(uri, root=tmp_path / "root", options=OPTS, settings=settings)
    assert sha(res.path / "w.bin") == sha(nginx.docroot / "tls/w.bin")


def test_https_untrusted_ca_is_a_clear_error(nginx, tmp_path):
    nginx.write("tls/w.bin", 10)
    uri = nginx.url("tls/w.bin", "https")
    with pytest.raises(SourceError, match=r"TLS verification failed.*CA_BUNDLE"):
        pull(uri, root=tmp_path / "root", options=OPTS, settings=Settings.from_env({}))


def test_host_headers_env(nginx, tmp_path):
    nginx.write("w.bin", 2 * CHUNK + 3)
    uri = nginx.url("auth/w.bin")
    with pytest.raises(AuthError, match=r"401.*'127\.0\.0\.1-headers'"):
        pull(uri, root=tmp_path / "r1", options=OPTS, settings=Settings.from_env({}))
    name, value = nginx.auth_header
    env = {"127.0.0.1-headers": json.dumps({name: value})}
    res = pull(uri, root=tmp_path / "r2", options=OPTS, settings=Settings.from_env(env))
    assert sha(res.path / "w.bin") == sha(nginx.docroot / "w.bin")


def _b64(digest: bytes) -> str:
    return base64.b64encode(digest).decode()


@pytest.mark.parametrize("header", ["Repr-Digest", "Digest", "Content-MD5"])
def test_digest_headers_verified_and_recorded(nginx, tmp_path, header):
    data_path = nginx.write("d/ok.bin", 5 * CHUNK + 11)
    data = data_path.read_bytes()
    value = {
        "Repr-Digest": f"sha-256=:{_b64(hashlib.sha256(data).digest())}:",
        "Digest": f"SHA-256={_b64(hashlib.sha256(data).digest())}",
        "Content-MD5": _b64(hashlib.md5(data).digest()),
    }[header]
    nginx.set_headers("d/ok.bin", {header: value})
    uri = nginx.url("d/ok.bin")
    res = pull(uri, root=tmp_path / "root", options=OPTS, settings=Settings.from_env({}))
    manifest = NodeStore.at(tmp_path / "root").manifest(res.storage_key)
    assert manifest is not None
    algo = "md5" if header == "Content-MD5" else "sha256"
    expected = hashlib.md5(data).hexdigest() if algo == "md5" else hashlib.sha256(data).hexdigest()
    assert manifest.files[0].checksums == {algo: expected}


def test_wrong_digest_header_never_publishes(nginx, tmp_path):
    nginx.write("d/bad.bin", 3 * CHUNK, headers={"Repr-Digest": f"sha-256=:{_b64(b'0' * 32)}:"})
    uri = nginx.url("d/bad.bin")
    with pytest.raises(IntegrityError, match=r"d?bad\.bin: sha256 mismatch after 3 attempts"):
        pull(uri, root=tmp_path / "root", options=OPTS, settings=Settings.from_env({}))
    assert not (tmp_path / "root" / "models" / storage_key(uri)).exists()
    assert not NodeStore.at(tmp_path / "root").is_present(storage_key(uri))


def test_pinned_digest_fragment(nginx, tmp_path):
    src = nginx.write("p/w.bin", 2 * CHUNK + 1)
    good = nginx.url("p/w.bin") + "#sha256=" + hashlib.sha256(src.read_bytes()).hexdigest()
    res = pull(good, root=tmp_path / "root", options=OPTS, settings=Settings.from_env({}))
    assert res.storage_key == storage_key(good)
    bad = nginx.url("p/w.bin") + "#sha256=" + "0" * 64
    with pytest.raises(IntegrityError, match="sha256 mismatch"):
        pull(bad, root=tmp_path / "root", options=OPTS, settings=Settings.from_env({}))


def test_errors_name_the_url(nginx, tmp_path):
    with pytest.raises(NotFoundError, match=r"http://127\.0\.0\.1:\d+/nope\.bin: HTTP 404"):
        pull(nginx.url("nope.bin"), root=tmp_path / "root", options=OPTS, settings=Settings.from_env({}))


@pytest.mark.parametrize(
    ("path", "needle"),
    [("status/401/x.bin", "HTTP 401"), ("status/403/x.bin", "HTTP 403"), ("nope.bin", "HTTP 404")],
)
def test_cli_one_line_errors(nginx, tmp_path, path, needle):
    uri = nginx.url(path) + "?X-Amz-Signature=topsecret"
    proc = subprocess.run(
        [sys.executable, "-m", "modelcache", "pull", uri, "--root", str(tmp_path / "root"), "--progress", "none"],
        capture_output=True, text=True, timeout=60,
    )
    assert proc.returncode == 1
    lines = proc.stderr.strip().splitlines()
    assert len(lines) == 1, proc.stderr
    assert needle in lines[0] and nginx.url(path) in lines[0]
    assert "topsecret" not in proc.stderr + proc.stdout


def test_cli_unreachable_host(tmp_path):
    from tests.helpers import free_port

    port = free_port()
    proc = subprocess.run(
        [sys.executable, "-m", "modelcache", "pull", f"http://127.0.0.1:{port}/m.bin", "--root",
         str(tmp_path / "root"), "--progress", "none", "--max-attempts", "2"],
        capture_output=True, text=True, timeout=60,
    )
    assert proc.returncode == 1
    assert proc.stderr.strip().splitlines() == [
        f"error: http://127.0.0.1:{port}/m.bin: cannot connect to 127.0.0.1:{port}: connection refused"
    ]


# ---- the backend contract (tests/contract.py) -----------------------------------------------


class _HTTPTarget(ProxyTarget):
    """nginx behind a FaultProxy; a URI names one file, pinned by its sha256 (nginx sends no digest)."""

    single_file = True

    def __init__(self, nginx: NginxServer, proxy: FaultProxy) -> None:
        super().__init__(proxy)
        self.nginx = nginx
        self.n = 0

    def model(self, files: dict[str, bytes]) -> str:
        ((name, data),) = files.items()
        self.n += 1
        path = self.nginx.docroot / f"m{self.n}" / name
        path.parent.mkdir(parents=True)
        path.write_bytes(data)
        return self.proxy.url(f"m{self.n}/{name}") + f"#sha256={hashlib.sha256(data).hexdigest()}"

    def missing(self) -> str:
        return self.proxy.url("nothing/here.bin")

    def env(self) -> dict[str, str]:
        return {}

    def replace(self, uri: str, path: str, data: bytes) -> None:
        rel = uri.split("#", 1)[0].split(f":{self.proxy.port}/", 1)[1]
        (self.nginx.docroot / rel).write_bytes(data)

    def data_path(self, uri: str, path: str) -> str:
        return "/" + uri.split("#", 1)[0].split(f":{self.proxy.port}/", 1)[1]


class TestHTTPContract(NetworkContract):
    @pytest.fixture
    def target(self, nginx: NginxServer, fault_proxy: FaultProxy) -> _HTTPTarget:
        return _HTTPTarget(nginx, fault_proxy)


class _LocalTarget(Target):
    """Local files: no network, no checksums (each file is stat'ed again once copied)."""

    checksums = False

    def __init__(self, root: Path, monkeypatch: pytest.MonkeyPatch) -> None:
        self.root = root
        self.n = 0
        self.monkeypatch = monkeypatch

    def model(self, files: dict[str, bytes]) -> str:
        self.n += 1
        for rel, data in files.items():
            p = self.root / f"m{self.n}" / rel
            p.parent.mkdir(parents=True, exist_ok=True)
            p.write_bytes(data)
        return str(self.root / f"m{self.n}")

    def missing(self) -> str:
        return str(self.root / "nothing-here")

    def env(self) -> dict[str, str]:
        return {}

    def replace(self, uri: str, path: str, data: bytes) -> None:
        (Path(uri) / path).write_bytes(data)

    def on_read(self, uri: str, path: str, nth: int, action: Callable[[], None]) -> None:
        from modelcache.sources.local import LocalSource

        real = LocalSource.open_range
        seen = [0]

        def open_range(src: LocalSource, file: RemoteFile, start: int, end: int | None) -> object:
            if file.path == path:
                seen[0] += 1
                if seen[0] == nth:
                    action()
            return real(src, file, start, end)

        self.monkeypatch.setattr(LocalSource, "open_range", open_range)


class TestLocalContract(BackendContract):
    @pytest.fixture
    def target(self, tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> _LocalTarget:
        return _LocalTarget(tmp_path / "src", monkeypatch)
def test_a_folder_url_is_refused_not_saved_as_its_html_listing(nginx, tmp_path):
    # A folder URL: nginx redirects /idx/model to /idx/model/ and answers with its HTML listing.
    nginx.write("idx/model/w.bin", 1000)
    nginx.set_autoindex("idx")
    uri = nginx.url("idx/model")
    with pytest.raises(SourceError) as exc:
        pull(uri, root=tmp_path / "root", options=OPTS, settings=Settings.from_env({}))
    assert str(exc.value) == (f"{uri}: the server sent an HTML page (text/html) where a file was expected: a "
                              "directory listing or an error page, not a model file; point the URI at the file itself")
    assert not (tmp_path / "root" / "models").exists() or not any((tmp_path / "root" / "models").iterdir())
    proc = subprocess.run([sys.executable, "-m", "modelcache", "pull", uri, "--root", str(tmp_path / "r2"),
                           "--progress", "none"], capture_output=True, text=True, timeout=60)
    assert proc.returncode == 1 and proc.stderr.strip().splitlines() == [f"error: {exc.value}"]


def test_an_error_page_sent_with_200_is_refused_but_an_html_file_is_a_file(nginx, tmp_path):
    nginx.write("e/model.bin", b"<!DOCTYPE html><html><body>Sign in to continue</body></html>")
    nginx.set_content_type("e/model.bin", "text/html; charset=utf-8")
    with pytest.raises(SourceError, match=r"HTML page \(text/html\) where a file was expected"):
        pull(nginx.url("e/model.bin"), root=tmp_path / "root", options=OPTS, settings=Settings.from_env({}))
    nginx.write("e/card.html", b"<html>model card</html>")
    nginx.set_content_type("e/card.html", "text/html")
    res = pull(nginx.url("e/card.html"), root=tmp_path / "root", options=OPTS, settings=Settings.from_env({}))
    assert (res.path / "card.html").read_bytes() == b"<html>model card</html>"
    nginx.write("e/config.json", b"{}")  # any other type is fine (KServe refuses all but octet-stream)
    nginx.set_content_type("e/config.json", "application/json")
    assert pull(nginx.url("e/config.json"), root=tmp_path / "root", options=OPTS,
                settings=Settings.from_env({})).files == 1


def test_a_server_that_ignores_range_is_named_with_its_cost(nginx, tmp_path, caplog):
    nginx.write("n/w.bin", 3 * CHUNK)
    uri = nginx.url("n/w.bin", "norange")
    with caplog.at_level("INFO", logger="modelcache.sources.http"):
        pull(uri, root=tmp_path / "root", options=OPTS, settings=Settings.from_env({}))
    notes = [r.getMessage() for r in caplog.records if r.levelname == "WARNING" and "ignores Range" in r.getMessage()]
    assert notes == [f"{uri}: the server ignores Range (HTTP 200 to a ranged request): one stream instead of "
                     "parallel ranged reads, and an interrupted download of its 192.0 KiB starts over from byte 0"]
    caplog.clear()
    with caplog.at_level("INFO", logger="modelcache.sources.http"):
        pull(nginx.url("n/w.bin"), root=tmp_path / "root", options=OPTS, settings=Settings.from_env({}))
    assert not [r for r in caplog.records if "ignores Range" in r.getMessage()]
