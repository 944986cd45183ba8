"""The store owns its bookkeeping folder (``.modelcache``): every write under it goes through
modelcache/store/, and no other module builds a path in it, nor in a staging folder."""

from __future__ import annotations

import ast
import threading
from pathlib import Path

import pytest

from modelcache.errors import StoreError
from modelcache.runtime.reserved import META_DIR
from modelcache.store import DestStore, Manifest, NodeLayout, NodeStore, RootLock
from modelcache.store.staging import STAGING_NAMES
from tests.helpers import REPO, wait_until

KEY = "0123456789abcdef"
STORE = REPO / "modelcache" / "store"
OWNERS = {REPO / "modelcache" / "runtime" / "reserved.py"}


def _product_files() -> list[Path]:
    return sorted(p for d in ("modelcache", "agent", "initializer", "coordinator") for p in (REPO / d).rglob("*.py")
                  if p not in OWNERS and STORE not in p.parents)


def _staging_names_spelled(tree: ast.AST) -> list[tuple[int, str]]:
    """Path joins that name an entry of a staging folder: ``x / "journal"``, ``os.path.join(x,
    "plan.json")``, and a staging file's name (``*.json``) anywhere."""
    found = []
    for node in ast.walk(tree):
        parts: list[ast.expr] = []
        if isinstance(node, ast.BinOp) and isinstance(node.op, ast.Div):
            parts = [node.right]
        elif isinstance(node, ast.Call) and isinstance(node.func, ast.Attribute) and node.func.attr in (
                "join", "joinpath", "with_name"):
            parts = list(node.args)
        for part in parts:
            if isinstance(part, ast.Constant) and part.value in STAGING_NAMES:
                found.append((node.lineno, part.value))
        if isinstance(node, ast.Constant) and isinstance(node.value, str) and node.value.endswith(".json") and (
                node.value in STAGING_NAMES or node.value.removesuffix(".tmp") in STAGING_NAMES):
            found.append((node.lineno, node.value))
    return found


def test_no_module_but_the_store_builds_paths_in_its_folder() -> None:
    """Code outside modelcache/store/ neither spells the folder's name nor reads a layout's ``meta``
    (prose in docstrings may name it)."""
    found = []
    for path in _product_files():
        tree = ast.parse(path.read_text(), str(path))
        for node in ast.walk(tree):
            if isinstance(node, ast.Constant) and isinstance(node.value, str) and (
                    node.value == META_DIR or node.value.startswith(META_DIR + "/")):
                found.append(f"{path.relative_to(REPO)}:{node.lineno}: {node.value!r}")
            if isinstance(node, ast.Attribute) and node.attr == "meta" and (
                    (isinstance(node.value, ast.Attribute) and node.value.attr == "layout")
                    or (isinstance(node.value, ast.Name) and node.value.id == "layout")):
                found.append(f"{path.relative_to(REPO)}:{node.lineno}: layout.meta")
    assert found == []


def test_no_module_but_the_store_spells_a_staging_folders_files() -> None:
    """The pull, the peers and the roles reach a staged download through ``Staging`` only."""
    found = [f"{path.relative_to(REPO)}:{line}: {name!r}" for path in _product_files()
             for line, name in _staging_names_spelled(ast.parse(path.read_text(), str(path)))]
    assert found == []


def test_the_staging_rule_catches_a_spelled_name() -> None:
    code = ('staging / "data" / rel\nos.path.join(d, "journal")\nplan = "plan.json"\n'
            'doc["data"]\nfolder / "weights.bin"\n')
    assert sorted(_staging_names_spelled(ast.parse(code))) == [(1, "data"), (2, "journal"), (3, "plan.json")]


def _manifest(key: str = KEY) -> Manifest:
    return Manifest(key, "file:///m", "file:///m", None, [], "2026-01-01T00:00:00Z")


def _seed(root: Path) -> NodeStore:
    """A model of each on-disk kind: published, staged, under repair, only a repair pin; and a
    folder this store did not make."""
    store = NodeStore.at(root)
    layout = NodeLayout(root)
    layout.model_dir(KEY).mkdir(parents=True)
    layout.manifest_path(KEY).parent.mkdir(parents=True, exist_ok=True)
    layout.manifest_path(KEY).write_text(_manifest(KEY).to_json())
    (layout.model_dir("kserve-copy") / "w.bin").parent.mkdir(parents=True)
    (layout.model_dir("kserve-copy") / "w.bin").write_bytes(b"x" * 1000)
    layout.staging_dir("1111111111111111").mkdir(parents=True)
    store.repair_download("2222222222222222")
    layout.model_dir("3333333333333333").mkdir(parents=True)
    layout.manifest_path("3333333333333333").parent.mkdir(parents=True, exist_ok=True)
    layout.manifest_path("3333333333333333").write_text(_manifest("3333333333333333").to_json())
    with store.lock("3333333333333333"):
        assert store.pin_damaged("3333333333333333") is not None
    return store


def test_disk_keys_and_has_see_staged_and_repairing_models(tmp_path: Path) -> None:
    store = _seed(tmp_path / "root")
    assert store.disk_keys() == {KEY, "1111111111111111", "2222222222222222", "3333333333333333"}
    assert all(store.has(k) for k in store.disk_keys()) and not store.has("4444444444444444")
    # A folder nothing of ours records is someone else's: not a key the agent would collect.
    assert store.foreign() == ["kserve-copy"] and store.has("kserve-copy") and not store.made("kserve-copy")
    assert store.pinned_manifest("3333333333333333") == _manifest("3333333333333333")


def test_remove_takes_an_unfinished_repair_with_the_model(tmp_path: Path) -> None:
    store = _seed(tmp_path / "root")
    for key in ("2222222222222222", "3333333333333333"):
        assert store.remove(key)
        assert not store.has(key) and store.pinned_manifest(key) is None
    assert store.disk_keys() == {KEY, "1111111111111111"}


def test_records_are_kept_per_key_whole(tmp_path: Path) -> None:
    dest = tmp_path / "dest"
    store = DestStore.at(dest)
    store.write_record("unpacked", KEY, '{"a": 1}')
    store.write_record("unpacked", "1111111111111111", '{"b": 2}')
    store.write_record("unpacked", KEY, '{"a": 3}')
    assert store.read_record("unpacked", KEY) == '{"a": 3}'
    assert store.read_record("unpacked", "1111111111111111") == '{"b": 2}'
    assert store.read_record("unpacked", "2222222222222222") is None
    assert not list((dest / META_DIR).rglob("*.tmp"))  # renamed into place, nothing half-written left


def test_a_finished_dest_keeps_only_the_model(tmp_path: Path) -> None:
    dest = tmp_path / "dest"
    store = DestStore.at(dest)
    store.write_record("unpacked", KEY, "{}")
    (dest / "model.bin").write_bytes(b"x")
    assert store.foreign_names(KEY) == ["model.bin"]  # the bookkeeping is not the model's
    store.clear_bookkeeping()
    assert sorted(p.name for p in dest.iterdir()) == ["model.bin"]
    with pytest.raises(StoreError):
        NodeStore.at(tmp_path / "root").clear_bookkeeping()  # a node root keeps its bookkeeping


def test_one_agent_per_root_the_second_waits_then_takes_over(tmp_path: Path) -> None:
    first, second = RootLock(tmp_path), RootLock(tmp_path)
    assert first.acquire(threading.Event())
    got: list[bool] = []
    stop = threading.Event()
    waiter = threading.Thread(target=lambda: got.append(second.acquire(stop, poll=0.05)))
    waiter.start()
    try:
        wait_until(lambda: second.holder().isdigit(), timeout=10, what="the holder's pid in the lock file")
        assert got == []  # still waiting while the first holds the root
        first.release()
        waiter.join(10)
        assert got == [True]
    finally:
        stop.set()
        waiter.join(10)
        second.release()
    # A stop request ends a wait at once.
    third = RootLock(tmp_path)
    assert third.acquire(threading.Event())
    stopped = threading.Event()
    stopped.set()
    assert not RootLock(tmp_path).acquire(stopped)
    third.release()
