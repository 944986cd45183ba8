"""The Hugging Face source against the test Hub (tests/hfhub): listing, ranged reads, pinning, errors."""

from __future__ import annotations

import hashlib
import os
import shutil
import subprocess

import pytest
import urllib3

from modelcache.errors import (
    AccessDeniedError,
    AuthError,
    ModelcacheError,
    NotFoundError,
    RateLimitedError,
    TransientError,
)
from modelcache.sources.base import RemoteFile, Source, open_source
from modelcache.sources.credentials import Settings
from tests.hfhub import HubServer

TOKEN = "hf_alice_token"
OTHER = "hf_bob_token"
BIG = os.urandom(3 * 64 * 1024 + 123)  # LFS (threshold 64 KiB)
FILES: dict[str, bytes] = {
    "config.json": b'{"model_type": "tiny"}\n',
    "model.safetensors": BIG,
    "tokenizer/vocab.txt": b"a\nb\nc\n",
    "tokenizer/deep/merges.txt": b"x y\n",
    "empty.txt": b"",
    "odd dir/naïve #1.txt": b"quoted path\n",
}


def _git_hash(data: bytes) -> str:
    git = shutil.which("git")
    if git is None:
        return hashlib.sha1(b"blob %d\x00" % len(data) + data).hexdigest()
    out = subprocess.run([git, "hash-object", "--stdin"], input=data, capture_output=True, check=True)
    return out.stdout.decode().strip()


@pytest.fixture
def hub(hf_hub: HubServer) -> HubServer:
    hf_hub.tokens.update({TOKEN, OTHER})
    hf_hub.create_repo("org/tiny").commit(FILES, message="init")
    return hf_hub


def _source(hub: HubServer, uri: str, **env: str) -> Source:
    return open_source(uri, Settings.from_env({"HF_ENDPOINT": hub.url, **env}))


def _read(src: Source, f: RemoteFile, start: int = 0, end: int | None = None, step: int = 7000) -> bytes:
    out = bytearray()
    stream = src.open_range(f, start, end)
    try:
        buf = memoryview(bytearray(step))
        while n := stream.readinto(buf):
            out += buf[:n]
    finally:
        stream.close()
    return bytes(out)


def _read_chunked(src: Source, f: RemoteFile, chunk: int) -> bytes:
    assert f.size is not None
    return b"".join(_read(src, f, s, min(s + chunk, f.size)) for s in range(0, f.size, chunk)) if f.size else b""


def test_lists_nested_tree_with_sizes_and_checksums(hub: HubServer) -> None:
    src = _source(hub, "hf://org/tiny")
    files = {f.path: f for f in src.list_files()}
    assert set(files) == set(FILES)
    commit = hub.repos["org/tiny"].branches["main"]
    assert src.resolved_revision == commit and src.resolved_uri == f"hf://org/tiny:{commit}"
    for path, data in FILES.items():
        f = files[path]
        assert f.size == len(data) and f.version == commit and f.ranged
        if path == "model.safetensors":
            assert [(c.algo, c.value) for c in f.checksums] == [("sha256", hashlib.sha256(data).hexdigest())]
        else:
            assert [(c.algo, c.value) for c in f.checksums] == [("git-blob-sha1", _git_hash(data))]


def test_checksums_match_integrity_hashers(hub: HubServer) -> None:
    """What the source promises is what modelcache.sources.integrity computes over the bytes read."""
    from modelcache.sources.integrity import new_hasher

    src = _source(hub, "hf://org/tiny")
    for f in src.list_files():
        (checksum,) = f.checksums
        h = new_hasher(checksum, f.size)
        h.update(_read(src, f))
        assert h.hexdigest() == checksum.value, f.path


def test_ranged_reads_multi_chunk_and_redirect_without_auth_leak(hub: HubServer) -> None:
    hub.repos["org/tiny"].private = True
    hub.repos["org/tiny"].allowed_tokens.add(TOKEN)
    src = _source(hub, "hf://org/tiny", HF_TOKEN=TOKEN)
    files = {f.path: f for f in src.list_files()}
    big = files["model.safetensors"]
    assert _read_chunked(src, big, 50_000) == BIG
    assert _read(src, big, 1000, None) == BIG[1000:]
    assert _read(src, big, 5, 6) == BIG[5:6]
    assert _read(src, files["empty.txt"]) == b""
    assert _read(src, files["tokenizer/deep/merges.txt"]) == FILES["tokenizer/deep/merges.txt"]
    ranged = [r for r in hub.requests if r.method == "GET" and r.range]
    assert ranged and all(r.range.startswith("bytes=") for r in ranged)
    hub_reqs = [r for r in hub.requests if r.origin == "hub" and "/resolve/" in r.path]
    cdn_reqs = [r for r in hub.requests if r.origin == "cdn"]
    assert hub_reqs and all(r.authorized for r in hub_reqs)
    assert cdn_reqs and not any(r.authorized for r in cdn_reqs)
    # Every read is pinned to the listed commit, never to the branch name.
    commit = big.version
    assert all(f"/resolve/{commit}/" in r.path for r in hub_reqs)
    # The CDN location is reused: one Hub GET for the LFS file, however many chunks.
    assert hub.count(origin="hub", method="GET", contains="/model.safetensors") == 1
    assert hub.count(origin="cdn", method="GET") >= 6
    # An expired signed location falls back to the Hub for a fresh one.
    hub.rotate_cdn_secret()
    assert _read(src, big, 10, 20) == BIG[10:20]
    assert hub.count(origin="hub", method="GET", contains="/model.safetensors") == 2
    src.close()


def test_subfolder_paths_are_relative(hub: HubServer) -> None:
    src = _source(hub, "hf://org/tiny/tokenizer")
    files = {f.path: f for f in src.list_files()}
    assert set(files) == {"vocab.txt", "deep/merges.txt"}
    assert _read(src, files["deep/merges.txt"]) == FILES["tokenizer/deep/merges.txt"]
    assert src.resolved_uri.endswith("/tokenizer")


def test_revision_tag_and_commit_pinning(hub: HubServer) -> None:
    repo = hub.repos["org/tiny"]
    first = repo.branches["main"]
    repo.set_tag("v1", first)
    src = _source(hub, "hf://org/tiny")
    files = {f.path: f for f in src.list_files()}
    # main moves after listing: reads still return the listed commit's bytes.
    second = repo.commit({"config.json": b'{"v": 2}\n', "model.safetensors": os.urandom(70_000)})
    assert _read(src, files["config.json"]) == FILES["config.json"]
    assert _read(src, files["model.safetensors"]) == BIG
    for uri, want in (("hf://org/tiny:v1", first), (f"hf://org/tiny:{first}", first), ("hf://org/tiny", second)):
        s = _source(hub, uri)
        got = {f.path: f for f in s.list_files()}
        assert s.resolved_revision == want
        expected = FILES["config.json"] if want == first else b'{"v": 2}\n'
        assert _read(s, got["config.json"]) == expected


def test_allow_and_ignore_patterns(hub: HubServer) -> None:
    src = _source(hub, "hf://org/tiny", STORAGE_ALLOW_PATTERNS='["*.json", "tokenizer/*"]')
    assert {f.path for f in src.list_files()} == {"config.json", "tokenizer/vocab.txt", "tokenizer/deep/merges.txt"}
    src = _source(hub, "hf://org/tiny", STORAGE_IGNORE_PATTERNS="*.safetensors, tokenizer/deep/*")
    assert {f.path for f in src.list_files()} == {
        "config.json",
        "tokenizer/vocab.txt",
        "empty.txt",
        "odd dir/naïve #1.txt",
    }
    with pytest.raises(NotFoundError, match="STORAGE_ALLOW_PATTERNS"):
        _source(hub, "hf://org/tiny", STORAGE_ALLOW_PATTERNS="*.gguf").list_files()


def _one_line(err: pytest.ExceptionInfo[ModelcacheError], *needles: str) -> str:
    msg = str(err.value)
    assert "\n" not in msg and TOKEN not in msg and OTHER not in msg, msg
    for n in needles:
        assert n in msg, msg
    return msg


def test_errors_repo_revision_folder(hub: HubServer) -> None:
    with pytest.raises(NotFoundError) as e:
        _source(hub, "hf://org/missing").list_files()
    _one_line(e, "org/missing", "not found", "HF_TOKEN")
    with pytest.raises(NotFoundError) as e:
        _source(hub, "hf://org/tiny:v9").list_files()
    _one_line(e, "org/tiny", "revision 'v9' not found")
    with pytest.raises(NotFoundError) as e:
        _source(hub, "hf://org/tiny/nope").list_files()
    _one_line(e, "org/tiny", "no folder or file 'nope'")
    with pytest.raises(NotFoundError) as e:
        _source(hub, "hf://org/tiny/tokenizer/nope.txt").list_files()
    _one_line(e, "org/tiny", "no folder or file 'tokenizer/nope.txt'")
    with pytest.raises(AuthError) as e:
        _source(hub, "hf://org/tiny", HF_TOKEN="hf_wrong").list_files()
    _one_line(e, "HF_TOKEN was rejected")


def test_errors_private_and_gated(hub: HubServer) -> None:
    private = hub.create_repo("org/private", private=True)
    private.commit({"a.txt": b"secret"})
    private.allowed_tokens.add(TOKEN)
    with pytest.raises(NotFoundError) as e:
        _source(hub, "hf://org/private").list_files()
    _one_line(e, "org/private", "set HF_TOKEN")
    with pytest.raises(NotFoundError) as e:
        _source(hub, "hf://org/private", HF_TOKEN=OTHER).list_files()
    _one_line(e, "org/private", "HF_TOKEN cannot read it")
    assert [f.path for f in _source(hub, "hf://org/private", HF_TOKEN=TOKEN).list_files()] == ["a.txt"]

    gated = hub.create_repo("org/gated", gated=True)
    gated.commit({"w.bin": b"weights"})
    gated.allowed_tokens.add(TOKEN)
    with pytest.raises(AuthError) as e:
        _source(hub, "hf://org/gated").list_files()
    _one_line(e, "org/gated", "gated", "HF_TOKEN")
    with pytest.raises(AccessDeniedError) as e:
        _source(hub, "hf://org/gated", HF_TOKEN=OTHER).list_files()
    _one_line(e, "org/gated", "gated", "not been granted")
    src = _source(hub, "hf://org/gated", HF_TOKEN=TOKEN)
    (f,) = src.list_files()
    assert _read(src, f) == b"weights"


def test_errors_missing_file_rate_limit_and_5xx(hub: HubServer) -> None:
    src = _source(hub, "hf://org/tiny")
    files = {f.path: f for f in src.list_files()}
    ghost = RemoteFile("ghost.bin", 10, files["config.json"].version, meta=(("repo_path", "ghost.bin"),))
    with pytest.raises(NotFoundError) as e:
        src.open_range(ghost, 0, 10)
    _one_line(e, "org/tiny", "'ghost.bin' not found")

    hub.fail(429, retry_after=7, when=lambda r: "/resolve/" in r.path)
    with pytest.raises(RateLimitedError) as rl:
        src.open_range(files["config.json"], 0, 4)
    assert rl.value.retry_after == 7 and rl.value.retryable
    _one_line(rl, "org/tiny", "429")

    # A listing rate-limited for good gives up after a bounded number of tries, naming the repo.
    before = hub.count(contains="/revision/")
    hub.fail(429, retry_after=0, count=100, when=lambda r: "/revision/" in r.path)
    with pytest.raises(RateLimitedError) as rl:
        _source(hub, "hf://org/tiny").list_files()
    assert rl.value.retry_after == 0 and hub.count(contains="/revision/") - before == 5
    _one_line(rl, "org/tiny", "rate-limited")
    hub.clear_injections()

    hub.fail(503, when=lambda r: r.origin == "cdn")
    with pytest.raises(TransientError):
        src.open_range(files["model.safetensors"], 0, 10)
    assert _read(src, files["model.safetensors"], 0, 10) == BIG[:10]  # next attempt succeeds


def test_unreachable_hub_is_transient(hub: HubServer) -> None:
    from tests.helpers import free_port

    with pytest.raises(TransientError) as e:
        open_source("hf://org/tiny", Settings.from_env({"HF_ENDPOINT": f"http://127.0.0.1:{free_port()}"})).list_files()
    assert "cannot reach" in str(e.value)


@pytest.mark.parametrize(
    "sub, name",
    [
        ("config.json", "config.json"),
        ("model.safetensors", "model.safetensors"),
        ("tokenizer/deep/merges.txt", "merges.txt"),
    ],
)
def test_subpath_naming_one_file(hub: HubServer, sub: str, name: str) -> None:
    """hf://owner/model/<file> (our extension; KServe has no sub-paths): that one file, under
    its own name, with its checksum, read at the pinned commit."""
    src = _source(hub, f"hf://org/tiny/{sub}")
    (f,) = src.list_files()
    data = FILES[sub]
    assert (f.path, f.size) == (name, len(data))
    algo = "sha256" if sub.endswith(".safetensors") else "git-blob-sha1"
    want = hashlib.sha256(data).hexdigest() if algo == "sha256" else _git_hash(data)
    assert [(c.algo, c.value) for c in f.checksums] == [(algo, want)]
    assert _read(src, f) == data
    assert src.resolved_uri == f"hf://org/tiny:{hub.repos['org/tiny'].branches['main']}/{sub}"


def _times(hub: HubServer, needle: str) -> list[float]:
    import time

    times: list[float] = []
    hub.on_request(lambda r: times.append(time.monotonic()), when=lambda r: needle in r.path, count=100)
    return times


def test_rate_limited_listing_waits_retry_after(hub: HubServer) -> None:
    """429 on the revision lookup, the tree listing and the access check: each is asked again
    no sooner than Retry-After says, and the listing then succeeds."""
    for needle, method in (("/revision/", "GET"), ("/tree/", "GET"), ("/resolve/", "HEAD")):
        times = _times(hub, needle)
        hub.fail(429, retry_after=1, count=1, when=lambda r, n=needle, m=method: n in r.path and r.method == m)
        src = _source(hub, "hf://org/tiny")
        assert {f.path for f in src.list_files()} == set(FILES), needle
        assert len(times) >= 2 and times[1] - times[0] >= 0.95, (needle, times)
        hub.clear_injections()


def test_retry_after_http_date() -> None:
    from email.utils import formatdate

    from modelcache.sources.ratelimit import retry_after as _retry_after

    assert _retry_after({"Retry-After": "12"}) == 12.0
    got = _retry_after({"Retry-After": formatdate(__import__("time").time() + 30, usegmt=True)})
    assert got is not None and 25 <= got <= 31
    assert _retry_after({"Retry-After": "soon"}) is None and _retry_after({}) is None


@pytest.mark.filterwarnings("ignore::urllib3.exceptions.InsecureRequestWarning")
def test_custom_ca_and_verify_off_beat_requests_ca_bundle(nginx, tls_material, monkeypatch) -> None:  # type: ignore[no-untyped-def]
    """The Hub's reads trust MODELCACHE_CA_BUNDLE (or skip verification) even when the process
    has REQUESTS_CA_BUNDLE set, which requests would otherwise let win over Session.verify."""
    monkeypatch.setenv("REQUESTS_CA_BUNDLE", "/etc/ssl/certs/ca-certificates.crt")
    url = nginx.https_url + "/"

    def get(**env: str) -> int:
        src = open_source("hf://org/tiny", Settings.from_env({"HF_ENDPOINT": nginx.https_url, **env}))
        try:
            return int(src.pool.request("GET", url).status)  # type: ignore[attr-defined]
        finally:
            src.close()

    assert get(MODELCACHE_CA_BUNDLE=str(tls_material.ca_path)) > 0
    assert get(MODELCACHE_HTTP_VERIFY_SSL="false") > 0
    with pytest.raises(urllib3.exceptions.SSLError):
        get()
