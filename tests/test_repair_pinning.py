"""An in-place repair restores the damaged revision, never a newer one (issue 20, point 6).

The agent's repair pulled the URI as it is now and renamed each differing file into the folder
running pods read: a moved revision (an ``hf://`` branch that advanced, an overwritten object)
was installed file by file, so a pod that restarted or opened a file lazily meanwhile loaded
half of each, and the folder ended as the new revision under pods started on the old one.
These tests drive ``modelcache.repair.repair`` with a real pull, as the agent's ``_download`` does.
"""

from __future__ import annotations

import os
import signal
import subprocess
from collections.abc import Callable, Collection
from pathlib import Path

import pytest

from modelcache.engine.transfer import TransferOptions
from modelcache.errors import SourceChangedError
from modelcache.pull import PullPlan, PullResult, pull
from modelcache.repair import repair
from modelcache.sources.credentials import Settings
from modelcache.sources.uri import storage_key
from modelcache.store import NodeLayout, NodeStore
from tests.fixtures.http import random_bytes
from tests.helpers import REPO, wait_until
from tests.hfhub import HubServer
from tests.test_agent_standalone import agent_cmd, run_agent, status_of, write_node

OPTS = TransferOptions(workers=2, chunk_size=64 * 1024)


def _puller(uri: str, settings: Settings, listings: list[PullPlan]) -> Callable[..., PullResult]:
    """The agent's ``pull_into``: the model's URI unless the repair names its pinned revision."""

    def pull_into(dest: Path, at: str | None = None, check: Callable[[PullPlan], None] | None = None,
                  only: Collection[str] | None = None) -> PullResult:
        def admit(plan: PullPlan) -> None:
            listings.append(plan)
            if check is not None:
                check(plan)

        return pull(at or uri, dest=dest, settings=settings, options=OPTS, admit=admit, only=only)

    return pull_into


def _damage(store: NodeStore, key: str, rel: str) -> list[str]:
    """What the agent does when a check finds a file damaged: flip a byte, take the manifest away."""
    p = store.layout.model_dir(key) / rel
    data = bytearray(p.read_bytes())
    data[len(data) // 2] ^= 0xFF
    p.write_bytes(bytes(data))
    with store.lock(key):
        manifest = store.pin_damaged(key)
    assert manifest is not None and not store.is_present(key)
    return [f.path for f in manifest.files]


def _folder(store: NodeStore, key: str) -> dict[str, bytes]:
    base = store.layout.model_dir(key)
    return {p.relative_to(base).as_posix(): p.read_bytes() for p in sorted(base.rglob("*")) if p.is_file()}


@pytest.mark.parametrize("move", ["same-size-content", "new-size", "gone"])
def test_source_without_revisions_that_moved_is_not_installed_into_the_folder(tmp_path: Path, move: str) -> None:
    src = tmp_path / "src"
    src.mkdir()
    v1 = {"a.bin": random_bytes(200_000, seed=1), "b.bin": random_bytes(150_000, seed=2)}
    for name, data in v1.items():
        (src / name).write_bytes(data)
    root = tmp_path / "root"
    settings = Settings.from_env({})
    key = pull(str(src), root=root, settings=settings, options=OPTS).storage_key
    store = NodeStore.at(root)
    old_files = _damage(store, key, "a.bin")
    before = _folder(store, key)
    # The source moves on where the repair needs it: the damaged a.bin is rewritten, grows or goes.
    if move == "same-size-content":
        (src / "a.bin").write_bytes(random_bytes(200_000, seed=3))
    elif move == "new-size":
        (src / "a.bin").write_bytes(random_bytes(200_001, seed=3))
    else:
        (src / "a.bin").unlink()
    listings: list[PullPlan] = []
    with pytest.raises(SourceChangedError, match=r"source changed since the model was downloaded.*'a.bin'"):
        repair(store, key, _puller(str(src), settings, listings), old_files)
    assert _folder(store, key) == before, "files of the new revision went into the folder pods read"
    # Issue 27: a refused repair keeps the model's manifest, marked damaged (not present), and
    # leaves no download behind (none is of any use: the next repair or pull starts over).
    damage = store.damage(key)
    assert store.manifest(key) is not None and not store.is_present(key)
    assert damage is not None and damage.files == ("a.bin",) and "repair refused" in damage.reason
    assert store.pinned_manifest(key) == store.manifest(key)
    assert not NodeLayout(root).repair_dir(key).exists()
    # The source is restored: the repair goes through and only the damaged file is replaced.
    (src / "a.bin").write_bytes(v1["a.bin"])
    out = repair(store, key, _puller(str(src), settings, listings), old_files)
    assert out.replaced == ["a.bin"] and out.removed == []
    assert _folder(store, key) == v1 and store.is_present(key) and store.verify(key) == []
    assert not store.pinned_manifest(key) is not None


@pytest.mark.parametrize("move", ["same-size-content", "new-size", "new-file"])
def test_a_repair_fetches_only_the_damaged_file_whatever_the_rest_of_the_source_did(
        tmp_path: Path, move: str) -> None:
    # Only the damaged file is fetched, held against the pinned digest, and renamed in: the folder
    # is the pinned revision again, whatever the source did to the files that were whole.
    src = tmp_path / "src"
    src.mkdir()
    v1 = {"a.bin": random_bytes(200_000, seed=1), "b.bin": random_bytes(150_000, seed=2)}
    for name, data in v1.items():
        (src / name).write_bytes(data)
    root = tmp_path / "root"
    settings = Settings.from_env({})
    key = pull(str(src), root=root, settings=settings, options=OPTS).storage_key
    store = NodeStore.at(root)
    old_files = _damage(store, key, "a.bin")
    if move == "same-size-content":
        (src / "b.bin").write_bytes(random_bytes(150_000, seed=3))
    elif move == "new-size":
        (src / "b.bin").write_bytes(random_bytes(150_001, seed=3))
    else:
        (src / "c.bin").write_bytes(b"new")
    listings: list[PullPlan] = []
    out = repair(store, key, _puller(str(src), settings, listings), old_files)
    assert out.replaced == ["a.bin"] and out.removed == []
    assert _folder(store, key) == v1 and store.is_present(key) and store.verify(key) == []
    assert listings[-1].total_bytes == 200_000  # the plan fetched a.bin alone


def test_hf_repair_pulls_the_damaged_commit_not_the_branch_head(hf_hub: HubServer, tmp_path: Path) -> None:
    repo = hf_hub.create_repo("org/tiny")
    v1 = {"config.json": b'{"v": 1}\n', "model.safetensors": os.urandom(300_000)}
    first = repo.commit(v1, message="v1")
    env = {"HF_ENDPOINT": hf_hub.url, "HF_HOME": str(tmp_path / "hf-home"), "HF_HUB_DISABLE_TELEMETRY": "1"}
    settings = Settings.from_env(env)
    root = tmp_path / "root"
    uri = "hf://org/tiny"
    res = pull(uri, root=root, settings=settings, options=OPTS)
    store = NodeStore.at(root)
    key = res.storage_key
    old_files = _damage(store, key, "model.safetensors")
    # main moves on to v2 (new weights, a new file) while the damaged copy waits for its repair.
    repo.commit({"model.safetensors": os.urandom(300_000), "extra.txt": b"v2"}, message="v2")
    listings: list[PullPlan] = []
    out = repair(store, key, _puller(uri, settings, listings), old_files)
    assert out.replaced == ["model.safetensors"] and out.removed == []
    assert _folder(store, key) == v1
    manifest = store.manifest(key)
    assert manifest is not None and manifest.revision == first and manifest.uri == uri
    assert [p.revision for p in listings] == [first]


@pytest.mark.timeout(120)
def test_agent_refuses_to_repair_from_a_moved_source_then_repairs_once_it_is_restored(tmp_path: Path) -> None:
    """The agent end to end (standalone): the damage is found by its verify, the source has moved,
    the error names the cause and the folder keeps the damaged revision's files."""
    src = tmp_path / "src"
    src.mkdir()
    v1 = {"a.bin": random_bytes(200_000, seed=4), "b.bin": random_bytes(150_000, seed=5)}
    for name, data in v1.items():
        (src / name).write_bytes(data)
    uri = f"file://{src}"
    key = storage_key(uri)
    root = tmp_path / "root"
    spec = write_node(tmp_path / "node.yaml", [{"modelName": "m", "sourceModelUri": uri}])
    assert run_agent(spec, root).returncode == 0
    folder = root / "models" / key
    with open(folder / "a.bin", "r+b") as f:  # same size, one byte off: only the full verify sees it
        f.seek(1000)
        f.write(bytes([v1["a.bin"][1000] ^ 0xFF]))
    damaged = (folder / "a.bin").read_bytes()
    (src / "a.bin").write_bytes(random_bytes(200_000, seed=6))  # the source moved on meanwhile
    agent = subprocess.Popen(agent_cmd(spec, root, "--watch", "--verify-interval", "1"), cwd=REPO,
                             stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True)
    try:
        wait_until(lambda: "source changed since the model was downloaded"
                   in (status_of(spec)["modelDetails"]["m"].get("message") or ""), timeout=60, what="refusal")
    finally:
        agent.send_signal(signal.SIGTERM)
        agent.communicate(timeout=20)
    assert status_of(spec)["modelStatus"] == {"m": "ModelDownloadError"}
    assert (folder / "b.bin").read_bytes() == v1["b.bin"] and (folder / "a.bin").read_bytes() == damaged
    # Restored, the source repairs the copy on the next start (no manifest: in place, pinned).
    (src / "a.bin").write_bytes(v1["a.bin"])
    proc = run_agent(spec, root)
    assert proc.returncode == 0, proc.stderr[-2000:]
    assert "replaced=a.bin" in proc.stderr and "replaced_count=1" in proc.stderr
    assert (folder / "a.bin").read_bytes() == v1["a.bin"] and NodeStore.at(root).verify(key) == []
