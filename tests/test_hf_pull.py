"""End to end: `modelcache pull hf://... --root DIR` as a process of its own (tests/forked.py) against the test Hub."""

from __future__ import annotations

import os
import subprocess
import time
from collections.abc import Callable
from pathlib import Path

import pytest

from modelcache.sources.uri import storage_key
from tests.contract import NetworkContract, NetworkTarget, first_match, nth_match
from tests.hfhub import HubServer, Request
from tests.pull_helpers import error_line, manifest_of, model_files, run_pull

TOKEN = "hf_alice_token"
BIG = os.urandom(600 * 1024 + 17)  # LFS; ~10 chunks at --chunk-size 64K
FILES: dict[str, bytes] = {
    "config.json": b'{"model_type": "tiny"}\n',
    "model.safetensors": BIG,
    "tokenizer/vocab.txt": b"a\nb\nc\n" * 50,
    "tokenizer/deep/merges.txt": b"x y\n",
}


@pytest.fixture
def hub(hf_hub: HubServer) -> HubServer:
    hf_hub.tokens.add(TOKEN)
    hf_hub.create_repo("org/tiny").commit(FILES, message="init")
    return hf_hub


def _env(hub: HubServer, tmp_path: Path, **extra: str) -> dict[str, str]:
    env = {k: v for k, v in os.environ.items() if not k.startswith(("HF_", "STORAGE_"))}
    env.update(HF_ENDPOINT=hub.url, HF_HOME=str(tmp_path / "hf-home"), HF_HUB_DISABLE_TELEMETRY="1", **extra)
    return env




def _pull(hub: HubServer, tmp_path: Path, uri: str, *args: str, **env: str) -> subprocess.CompletedProcess[str]:
    return run_pull(uri, tmp_path / "root", "--chunk-size", "64K", *args, env=_env(hub, tmp_path, **env))


def _model(tmp_path: Path, uri: str) -> dict[str, bytes]:
    return model_files(tmp_path / "root", uri)


def _manifest(tmp_path: Path, uri: str) -> dict[str, object]:
    return manifest_of(tmp_path / "root", uri)


def _error_line(proc: subprocess.CompletedProcess[str], *needles: str) -> str:
    return error_line(proc, *needles, secrets=(TOKEN,))


def test_pull_nested_multichunk_and_manifest(hub: HubServer, tmp_path: Path) -> None:
    uri = "hf://org/tiny"
    proc = _pull(hub, tmp_path, uri)
    assert proc.returncode == 0, proc.stderr
    assert _model(tmp_path, uri) == FILES
    commit = hub.repos["org/tiny"].branches["main"]
    man = _manifest(tmp_path, uri)
    assert man["revision"] == commit and man["resolved_uri"] == f"hf://org/tiny:{commit}"
    checks = {f["path"]: f["checksums"] for f in man["files"]}  # type: ignore[union-attr]
    assert set(checks["model.safetensors"]) == {"sha256"} and set(checks["config.json"]) == {"git-blob-sha1"}
    # The LFS file moved as ranged reads (several requests; the engine may merge tiny chunks).
    assert hub.count(origin="cdn", method="GET") >= 2
    # A second pull is served from the store: no file bytes move.
    before = hub.count(origin="cdn")
    again = _pull(hub, tmp_path, uri)
    assert again.returncode == 0, again.stderr
    assert hub.count(origin="cdn") == before


def test_pull_subfolder_and_patterns(hub: HubServer, tmp_path: Path) -> None:
    proc = _pull(hub, tmp_path, "hf://org/tiny/tokenizer")
    assert proc.returncode == 0, proc.stderr
    assert _model(tmp_path, "hf://org/tiny/tokenizer") == {
        "vocab.txt": FILES["tokenizer/vocab.txt"],
        "deep/merges.txt": FILES["tokenizer/deep/merges.txt"],
    }
    uri = "hf://org/tiny:main"
    proc = _pull(
        hub, tmp_path, uri, STORAGE_ALLOW_PATTERNS='["*.json","tokenizer/*"]', STORAGE_IGNORE_PATTERNS="*/deep/*"
    )
    assert proc.returncode == 0, proc.stderr
    assert set(_model(tmp_path, uri)) == {"config.json", "tokenizer/vocab.txt"}


def test_pull_pins_one_commit_while_main_moves(hub: HubServer, tmp_path: Path) -> None:
    repo = hub.repos["org/tiny"]
    first = repo.branches["main"]
    moved: list[str] = []

    def move_main(_: Request) -> None:
        moved.append(repo.commit({"config.json": b'{"v": 2}\n', "model.safetensors": os.urandom(100_000)}))

    hub.on_request(move_main, when=lambda r: r.method == "GET" and r.origin == "hub" and "/resolve/" in r.path)
    uri = "hf://org/tiny"
    proc = _pull(hub, tmp_path, uri)
    assert proc.returncode == 0, proc.stderr
    assert moved and repo.branches["main"] == moved[0] != first
    assert _model(tmp_path, uri) == FILES
    assert _manifest(tmp_path, uri)["revision"] == first


@pytest.mark.parametrize("path", ["model.safetensors", "config.json"])
def test_corrupted_byte_fails_verification(hub: HubServer, tmp_path: Path, path: str) -> None:
    hub.repos["org/tiny"].file("main", path).corrupt_at.add(len(FILES[path]) // 2)
    uri = "hf://org/tiny"
    proc = _pull(hub, tmp_path, uri)
    line = _error_line(proc, path)
    assert "sha256" in line if path.endswith("safetensors") else "git-blob-sha1" in line
    assert not (tmp_path / "root" / "models" / storage_key(uri)).exists()


def test_error_messages(hub: HubServer, tmp_path: Path) -> None:
    hub.create_repo("org/private", private=True).commit({"a.txt": b"x"})
    hub.create_repo("org/gated", gated=True).commit({"a.txt": b"x"})
    _error_line(_pull(hub, tmp_path, "hf://org/missing"), "org/missing", "not found")
    _error_line(_pull(hub, tmp_path, "hf://org/private"), "org/private", "HF_TOKEN")
    _error_line(_pull(hub, tmp_path, "hf://org/gated"), "org/gated", "gated", "HF_TOKEN")
    _error_line(_pull(hub, tmp_path, "hf://org/gated", HF_TOKEN=TOKEN), "org/gated", "not been granted")
    _error_line(_pull(hub, tmp_path, "hf://org/tiny", HF_TOKEN="hf_bad"), "HF_TOKEN was rejected")
    _error_line(_pull(hub, tmp_path, "hf://org/tiny:v9"), "org/tiny", "revision 'v9' not found")
    _error_line(_pull(hub, tmp_path, "hf://org/tiny/nope"), "hf://org/tiny/nope", "no folder or file 'nope'")
    hub.fail(404, error_code="EntryNotFound", count=100, when=lambda r: r.method == "GET" and "vocab" in r.path)
    _error_line(_pull(hub, tmp_path, "hf://org/tiny"), "org/tiny", "tokenizer/vocab.txt", "not found")
    hub.fail(429, retry_after=0, count=1000, when=lambda r: "/revision/" in r.path)
    _error_line(_pull(hub, tmp_path, "hf://org/tiny", "--max-attempts", "2"), "org/tiny", "rate-limited")
    hub.clear_injections()


def test_pull_single_file_subpath(hub: HubServer, tmp_path: Path) -> None:
    """hf://owner/model/<file>: just that file, under its own name, verified, pinned."""
    uri = "hf://org/tiny/model.safetensors"
    proc = _pull(hub, tmp_path, uri)
    assert proc.returncode == 0, proc.stderr
    assert _model(tmp_path, uri) == {"model.safetensors": BIG}
    man = _manifest(tmp_path, uri)
    commit = hub.repos["org/tiny"].branches["main"]
    assert man["resolved_uri"] == f"hf://org/tiny:{commit}/model.safetensors"
    assert [set(f["checksums"]) for f in man["files"]] == [{"sha256"}]  # type: ignore[union-attr]


def test_rate_limited_listing_is_waited_out(hub: HubServer, tmp_path: Path) -> None:
    """429 with Retry-After on the revision lookup: the pull waits that long, then succeeds."""
    times: list[float] = []
    hub.on_request(lambda r: times.append(time.monotonic()), when=lambda r: "/revision/" in r.path, count=10)
    hub.fail(429, retry_after=1, count=2, when=lambda r: "/revision/" in r.path)
    uri = "hf://org/tiny"
    proc = _pull(hub, tmp_path, uri)
    assert proc.returncode == 0, proc.stderr
    assert _model(tmp_path, uri) == FILES
    assert len(times) == 3 and times[1] - times[0] >= 0.95 and times[2] - times[1] >= 0.95, times


def test_rate_limited_chunks_are_retried_after_retry_after(hub: HubServer, tmp_path: Path) -> None:
    hub.fail(429, retry_after=0, count=3, when=lambda r: r.method == "GET" and "/resolve/" in r.path)
    uri = "hf://org/tiny"
    proc = _pull(hub, tmp_path, uri)
    assert proc.returncode == 0, proc.stderr
    assert _model(tmp_path, uri) == FILES
    # Retry-After is honoured: the rate-limited chunk is asked for again no sooner than told.
    times: list[float] = []
    hub.on_request(lambda r: times.append(time.monotonic()), when=lambda r: "config.json" in r.path, count=10)
    hub.fail(429, retry_after=2, count=1, when=lambda r: r.method == "GET" and "config.json" in r.path)
    proc = _pull(hub, tmp_path, "hf://org/tiny:main")
    assert proc.returncode == 0, proc.stderr
    gets = [r for r in hub.requests if r.method == "GET" and "config.json" in r.path]
    assert len(gets) >= 2 and times[-1] - times[-2] >= 1.9


def test_storage_initializer_hf_into_dest(hub: HubServer, tmp_path: Path) -> None:
    """KServe's init container contract: `storage-initializer hf://owner/model:rev DEST` with HF_TOKEN."""
    from tests.initializer_util import run_initializer

    repo = hub.repos["org/tiny"]
    repo.private = True
    repo.allowed_tokens.add(TOKEN)
    repo.set_tag("v1", repo.branches["main"])
    dest = tmp_path / "mnt" / "models"
    run = run_initializer(
        "hf://org/tiny:v1",
        dest,
        env={"HF_ENDPOINT": hub.url, "HF_TOKEN": TOKEN, "HF_HOME": str(tmp_path / "hf-home")},
    )
    assert run.code == 0, run.output
    got = {p.relative_to(dest).as_posix(): p.read_bytes() for p in dest.rglob("*") if p.is_file()}
    assert {k: v for k, v in got.items() if not k.startswith(".")} == FILES
    assert TOKEN not in run.output


# ---- the backend contract (tests/contract.py; its resume after kill -9 replaced this module's) ----


class _HubTarget(NetworkTarget):
    """The test Hub: one repository per model; a new commit is a new version of a file (the pull
    is pinned to the commit it listed). Faults are the Hub's own (reads go to two listeners)."""

    def __init__(self, hub: HubServer) -> None:
        self.hub = hub
        self.n = 0

    def model(self, files: dict[str, bytes]) -> str:
        self.n += 1
        self.hub.create_repo(f"org/m{self.n}").commit(files, message="init")
        return f"hf://org/m{self.n}"

    def missing(self) -> str:
        return "hf://org/nothing-here"

    def env(self) -> dict[str, str]:
        return {"HF_ENDPOINT": self.hub.url, "HF_HUB_DISABLE_TELEMETRY": "1"}

    def replace(self, uri: str, path: str, data: bytes) -> None:
        self.hub.repos[uri.removeprefix("hf://")].commit({path: data}, message="replace")

    def _reads(self, uri: str, path: str) -> Callable[[Request], bool]:
        sha = self.hub.repos[uri.removeprefix("hf://")].file("main", path).sha256
        return lambda r: r.method == "GET" and (r.path.endswith(f"/{path}") or r.path == f"/lfs/{sha}")

    def on_read(self, uri: str, path: str, nth: int, action: Callable[[], None]) -> None:
        self.hub.on_request(lambda r: action(), when=nth_match(self._reads(uri, path), nth))

    def fail_read(self, uri: str, path: str, status: int, retry_after: int) -> Callable[[], int]:
        when, hits = first_match(self._reads(uri, path))
        self.hub.fail(status, retry_after=retry_after, when=when)
        return hits

    def flip_read(self, uri: str, path: str) -> Callable[[], int]:
        sha = self.hub.repos[uri.removeprefix("hf://")].file("main", path).sha256
        self.hub.flip_next[sha] = 1
        return lambda: self.hub.flipped

    def throttle(self, bytes_per_s: int | None) -> None:
        self.hub.throttle_bps = bytes_per_s

    def sent(self) -> int:
        return self.hub.body_bytes_sent


class TestHubContract(NetworkContract):
    @pytest.fixture
    def target(self, hf_hub: HubServer) -> _HubTarget:
        return _HubTarget(hf_hub)


def _kserve_snapshot(root: Path, uri: str, files: dict[str, bytes], commit: str) -> Path:
    """What KServe's download Job leaves for hf://: snapshot_download(local_dir=) writes the files
    and, per file, .cache/huggingface/download/<path>.metadata whose first line is the commit."""
    folder = root / "models" / storage_key(uri)
    for rel, data in files.items():
        (folder / rel).parent.mkdir(parents=True, exist_ok=True)
        (folder / rel).write_bytes(data)
        meta = folder / ".cache" / "huggingface" / "download" / f"{rel}.metadata"
        meta.parent.mkdir(parents=True, exist_ok=True)
        meta.write_text(f"{commit}\n\"etag-of-{rel}\"\n1700000000.0\n")
    return folder


@pytest.mark.parametrize("policy", ["complete", "as-found"])
def test_a_kserve_folder_of_a_moved_branch_is_adopted_at_its_own_commit(hub: HubServer, tmp_path: Path,
                                                                       policy: str) -> None:
    """M3 of the v0.20 audit: `hf://org/tiny` (main) was downloaded by KServe at commit A; main
    moved to B since. The folder says it holds A (huggingface_hub's records), so it is listed and
    verified at A: 0 file GETs, nothing rewritten, the manifest pinned to A; the drift check then
    reports the moved branch, and a refresh is what moves it."""
    from modelcache.drift import CHANGED
    from modelcache.pull import check_drift, pull
    from modelcache.sources.credentials import Settings
    from modelcache.store import NodeStore

    repo = hub.repos["org/tiny"]
    first = repo.branches["main"]
    uri = "hf://org/tiny"
    root = tmp_path / "root"
    folder = _kserve_snapshot(root, uri, FILES, first)
    second = repo.commit({"config.json": b'{"model_type": "tiny", "v": 2}\n'}, message="v2")
    settings = Settings.from_env({"HF_ENDPOINT": hub.url, "HF_TOKEN": TOKEN})
    before = hub.count(origin="cdn", method="GET") + hub.count(origin="hub", method="GET", contains="/resolve/")

    result = pull(uri, root=root, settings=settings, adoption=policy)

    file_gets = hub.count(origin="cdn", method="GET") + hub.count(origin="hub", method="GET",
                                                                  contains="/resolve/") - before
    assert file_gets == 0 and result.adopted == len(FILES) and result.pinned_revision == first
    assert (folder / "config.json").read_bytes() == FILES["config.json"]
    store = NodeStore.at(root)
    manifest = store.manifest(storage_key(uri))
    assert manifest.revision == first and store.verify(storage_key(uri)) == []
    assert all(f.checksums for f in manifest.files)  # sha256 / git sha1 of commit A
    drift = check_drift(uri, manifest, settings)
    assert drift.state == CHANGED and drift.source_revision == second and drift.changed == ("config.json",)
    assert f"revision {first} -> {second}" in drift.message
