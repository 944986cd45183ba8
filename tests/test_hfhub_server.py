"""The test Hub server, checked with huggingface_hub itself so it cannot drift from the real client."""

from __future__ import annotations

import hashlib
import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest
import requests
from huggingface_hub import HfApi, get_hf_file_metadata, hf_hub_download, hf_hub_url, snapshot_download
from huggingface_hub.errors import (
    GatedRepoError,
    HfHubHTTPError,
    RemoteEntryNotFoundError,
    RepositoryNotFoundError,
    RevisionNotFoundError,
)

from tests.helpers import REPO, stop_process
from tests.hfhub import HubServer

TOKEN = "hf_testtoken_alice"
BIG = os.urandom(300 * 1024)  # above the 64 KiB LFS threshold
FILES = {
    "config.json": b'{"model_type": "tiny"}\n',
    "model.safetensors": BIG,
    "tokenizer/vocab.txt": b"a\nb\nc\n",
    "tokenizer/deep/merges.txt": b"x y\n",
}


def _git_hash(data: bytes) -> str:
    """The git blob sha1 as git itself computes it (independent of the server's code)."""
    git = shutil.which("git")
    if git is None:
        return hashlib.sha1(b"blob %d\x00" % len(data) + data).hexdigest()
    return (
        subprocess.run([git, "hash-object", "--stdin"], input=data, capture_output=True, check=True)
        .stdout.decode()
        .strip()
    )


@pytest.fixture
def hub(hf_hub: HubServer) -> HubServer:
    hf_hub.tokens.add(TOKEN)
    hf_hub.tokens.add("hf_bob")
    hf_hub.create_repo("org/tiny").commit(FILES, message="init")
    return hf_hub


def _tree(root: Path) -> dict[str, bytes]:
    return {p.relative_to(root).as_posix(): p.read_bytes() for p in root.rglob("*") if p.is_file()}


def test_snapshot_download_nested_lfs_and_pagination(hub: HubServer, tmp_path: Path) -> None:
    hub.tree_page_size = 2  # 4 files + 2 directories -> 3 pages
    path = snapshot_download("org/tiny", endpoint=hub.url, cache_dir=tmp_path / "cache", token=TOKEN)
    assert _tree(Path(path)) == FILES
    assert hub.count(origin="hub", method="GET", contains="/tree/") == 3
    # The LFS file came from the CDN origin, which must never see the Hub token.
    cdn = [r for r in hub.requests if r.origin == "cdn"]
    assert cdn and not any(r.authorized for r in cdn)


def test_snapshot_download_to_local_dir_with_patterns(hub: HubServer, tmp_path: Path) -> None:
    out = tmp_path / "out"
    snapshot_download(
        "org/tiny",
        endpoint=hub.url,
        cache_dir=tmp_path / "c",
        local_dir=out,
        allow_patterns=["tokenizer/*"],
        token=False,
    )
    got = {p for p in _tree(out) if not p.startswith(".cache/")}
    assert got == {"tokenizer/vocab.txt", "tokenizer/deep/merges.txt"}


def test_file_metadata_etags_sizes_and_redirect(hub: HubServer) -> None:
    commit = HfApi(endpoint=hub.url, token=False).model_info("org/tiny", revision="main").sha
    meta = get_hf_file_metadata(hf_hub_url("org/tiny", "model.safetensors", endpoint=hub.url), token=TOKEN)
    assert meta.etag == hashlib.sha256(BIG).hexdigest()
    assert meta.size == len(BIG)
    assert meta.commit_hash == commit
    assert meta.location.startswith(hub.cdn_url)
    small = get_hf_file_metadata(hf_hub_url("org/tiny", "config.json", endpoint=hub.url), token=False)
    assert small.etag == _git_hash(FILES["config.json"])
    assert small.size == len(FILES["config.json"])


def test_tree_listing_matches_git_and_lfs(hub: HubServer) -> None:
    api = HfApi(endpoint=hub.url, token=False)
    entries = {e.path: e for e in api.list_repo_tree("org/tiny", recursive=True, expand=True)}
    assert set(entries) == {*FILES, "tokenizer", "tokenizer/deep"}
    lfs = entries["model.safetensors"]
    assert lfs.lfs is not None and lfs.lfs.sha256 == hashlib.sha256(BIG).hexdigest() and lfs.size == len(BIG)
    assert entries["config.json"].blob_id == _git_hash(FILES["config.json"]) and entries["config.json"].lfs is None
    assert entries["config.json"].last_commit is not None
    sub = [e.path for e in api.list_repo_tree("org/tiny", path_in_repo="tokenizer")]
    assert sub == ["tokenizer/deep", "tokenizer/vocab.txt"]
    with pytest.raises(RemoteEntryNotFoundError):
        list(api.list_repo_tree("org/tiny", path_in_repo="nope"))
    # A file's path: its tree is empty, and paths-info describes it (what hf://o/m/<file> uses).
    assert list(api.list_repo_tree("org/tiny", path_in_repo="tokenizer/vocab.txt")) == []
    from huggingface_hub.hf_api import RepoFile, RepoFolder

    infos = api.get_paths_info("org/tiny", ["model.safetensors", "tokenizer", "missing.bin"], revision="main")
    by_path = {i.path: i for i in infos}
    assert set(by_path) == {"model.safetensors", "tokenizer"}
    got = by_path["model.safetensors"]
    assert isinstance(got, RepoFile) and got.size == len(BIG) and got.lfs is not None
    assert got.lfs.sha256 == hashlib.sha256(BIG).hexdigest()
    assert isinstance(by_path["tokenizer"], RepoFolder)
    with pytest.raises(RevisionNotFoundError):
        api.get_paths_info("org/tiny", ["config.json"], revision="v9")


def test_ranges_on_hub_and_cdn(hub: HubServer) -> None:
    small = requests.get(f"{hub.url}/org/tiny/resolve/main/config.json", headers={"Range": "bytes=2-5"})
    assert small.status_code == 206 and small.content == FILES["config.json"][2:6]
    assert small.headers["Content-Range"] == f"bytes 2-5/{len(FILES['config.json'])}"
    r = requests.get(f"{hub.url}/org/tiny/resolve/main/model.safetensors", headers={"Range": "bytes=-10"})
    assert r.status_code == 206 and r.content == BIG[-10:] and r.history[0].status_code == 302
    r = requests.get(f"{hub.url}/org/tiny/resolve/main/model.safetensors", headers={"Range": f"bytes={len(BIG)}-"})
    assert r.status_code == 416 and r.headers["Content-Range"] == f"bytes */{len(BIG)}"
    forged = requests.get(f"{hub.cdn_url}/lfs/{hashlib.sha256(BIG).hexdigest()}?X-Sig=bad")
    assert forged.status_code == 403


def test_private_repo_and_tokens(hub: HubServer, tmp_path: Path) -> None:
    repo = hub.create_repo("org/private", private=True)
    repo.commit({"a.txt": b"secret"})
    repo.allowed_tokens.add(TOKEN)
    got = hf_hub_download("org/private", "a.txt", endpoint=hub.url, cache_dir=tmp_path, token=TOKEN)
    assert Path(got).read_bytes() == b"secret"
    with pytest.raises(RepositoryNotFoundError):
        hf_hub_download("org/private", "a.txt", endpoint=hub.url, cache_dir=tmp_path / "x", token=False)
    with pytest.raises(RepositoryNotFoundError):
        HfApi(endpoint=hub.url, token="hf_bob").model_info("org/private", revision="main")
    with pytest.raises(HfHubHTTPError) as bad:
        HfApi(endpoint=hub.url, token="hf_wrong").model_info("org/tiny", revision="main")
    assert bad.value.response.status_code == 401 and not isinstance(bad.value, RepositoryNotFoundError)


def test_gated_repo(hub: HubServer, tmp_path: Path) -> None:
    repo = hub.create_repo("org/gated", gated=True)
    repo.commit({"w.bin": b"gated weights"})
    repo.allowed_tokens.add(TOKEN)
    assert HfApi(endpoint=hub.url, token=False).model_info("org/gated", revision="main").gated == "manual"
    for token in (False, "hf_bob"):
        with pytest.raises(GatedRepoError):
            hf_hub_download("org/gated", "w.bin", endpoint=hub.url, cache_dir=tmp_path / "x", token=token)
    got = hf_hub_download("org/gated", "w.bin", endpoint=hub.url, cache_dir=tmp_path, token=TOKEN)
    assert Path(got).read_bytes() == b"gated weights"


def test_not_found_errors(hub: HubServer, tmp_path: Path) -> None:
    api = HfApi(endpoint=hub.url, token=False)
    with pytest.raises(RepositoryNotFoundError):
        api.model_info("org/missing", revision="main")
    with pytest.raises(RevisionNotFoundError):
        api.model_info("org/tiny", revision="v9")
    with pytest.raises(RevisionNotFoundError):
        hf_hub_download("org/tiny", "config.json", revision="v9", endpoint=hub.url, cache_dir=tmp_path, token=False)
    with pytest.raises(RemoteEntryNotFoundError):
        hf_hub_download("org/tiny", "nope.bin", endpoint=hub.url, cache_dir=tmp_path, token=False)


def test_moving_branches_and_tags(hub: HubServer, tmp_path: Path) -> None:
    repo = hub.repos["org/tiny"]
    api = HfApi(endpoint=hub.url, token=False)
    first = api.model_info("org/tiny", revision="main").sha
    repo.set_tag("v1", first)
    second = repo.commit({"config.json": b'{"v": 2}', "tokenizer/vocab.txt": None}, message="v2")
    assert api.model_info("org/tiny", revision="main").sha == second != first
    assert api.model_info("org/tiny", revision="v1").sha == first
    refs = api.list_repo_refs("org/tiny")
    assert [b.target_commit for b in refs.branches] == [second] and [t.name for t in refs.tags] == ["v1"]
    old = snapshot_download("org/tiny", revision="v1", endpoint=hub.url, cache_dir=tmp_path, token=False)
    assert _tree(Path(old)) == FILES
    new = snapshot_download("org/tiny", revision=second, endpoint=hub.url, cache_dir=tmp_path, token=False)
    assert "tokenizer/vocab.txt" not in _tree(Path(new)) and _tree(Path(new))["config.json"] == b'{"v": 2}'


def test_rate_limit_is_retried_after_retry_after(hub: HubServer, tmp_path: Path) -> None:
    hub.fail(429, retry_after=0, when=lambda r: "/tree/" in r.path)
    path = snapshot_download("org/tiny", endpoint=hub.url, cache_dir=tmp_path, token=False)
    assert _tree(Path(path)) == FILES
    assert hub.count(contains="/tree/") == 2
    hub.fail(429, retry_after=7, when=lambda r: "/revision/" in r.path)
    with pytest.raises(HfHubHTTPError) as err:
        HfApi(endpoint=hub.url, token=False).model_info("org/tiny", revision="main")
    assert err.value.response.status_code == 429 and err.value.response.headers["Retry-After"] == "7"


def test_307_redirect_and_standalone_cli(hub: HubServer, tmp_path: Path) -> None:
    hub.redirect_status = 307
    got = hf_hub_download("org/tiny", "model.safetensors", endpoint=hub.url, cache_dir=tmp_path, token=TOKEN)
    assert Path(got).read_bytes() == BIG
    # The same server as a process, serving a folder: what `python -m tests.hfhub` prints is usable.
    (tmp_path / "m" / "sub").mkdir(parents=True)
    (tmp_path / "m" / "sub" / "w.bin").write_bytes(b"w" * 70_000)
    proc = subprocess.Popen(
        [sys.executable, "-m", "tests.hfhub", "--repo", f"org/cli={tmp_path / 'm'}"],
        cwd=REPO,
        stdout=subprocess.PIPE,
        text=True,
    )
    try:
        assert proc.stdout is not None
        endpoint = proc.stdout.readline().strip().partition("=")[2]
        path = snapshot_download("org/cli", endpoint=endpoint, cache_dir=tmp_path / "c2", token=False)
        assert (Path(path) / "sub" / "w.bin").read_bytes() == b"w" * 70_000
    finally:
        stop_process(proc)
        if proc.stdout is not None:
            proc.stdout.close()
