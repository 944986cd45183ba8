"""The store's own integrity rules: what the journal trusts, what recover installs, which roots
it locks, and that extracted layouts are durable before their manifests.

Each test failed before the fix beside it (issue 20, points 5, 7, 8 and 12).
"""

from __future__ import annotations

import builtins
import errno
import os
import shutil
from pathlib import Path
from typing import Any

import pytest

from modelcache import journal as journal_mod
from modelcache.credentials import Settings
from modelcache.journal import Journal
from modelcache.pull import pull
from modelcache.store import NodeStore
from modelcache.transfer import TransferOptions
from tests.fixtures.http import random_bytes

OPTS = TransferOptions(workers=2, chunk_size=64 * 1024)


def _no_boot_id(monkeypatch: pytest.MonkeyPatch) -> None:
    """/proc/sys/kernel/random/boot_id unreadable (a restricted /proc, some sandboxes)."""
    real_open = builtins.open

    def fake_open(file: Any, *args: Any, **kwargs: Any) -> Any:
        if str(file).endswith("kernel/random/boot_id"):
            raise PermissionError(errno.EACCES, "Permission denied", str(file))
        return real_open(file, *args, **kwargs)

    monkeypatch.setattr(journal_mod, "open", fake_open, raising=False)


def test_unreadable_boot_id_never_makes_unsynced_lines_trusted(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """Point 5: the fallback id "unknown" equalled itself after a reboot, so every unsynced line of
    the last boot was trusted and zeros that never reached the disk were resumed as data."""
    _no_boot_id(monkeypatch)
    j = Journal(str(tmp_path / "journal"))
    j.open(fresh=True)
    j.chunk(0, 0, 4096)
    j.synced()  # covers the first line only
    j.chunk(0, 1, 8192)
    j.file_done(1, "abc", ("sha256",))
    j.close()
    # The next run (after a reboot or not: nothing can tell) trusts what the sync mark covers.
    state = Journal(str(tmp_path / "journal")).load()
    assert state.chunks == {(0, 0): 4096}
    assert state.files == {}


def test_journal_of_an_older_version_with_boot_unknown_is_not_trusted_past_its_marks(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    _no_boot_id(monkeypatch)
    p = tmp_path / "journal"
    p.write_text(journal_mod.seal("\nboot unknown\nc 0 0 4096\nS 1\nc 0 1 100\n"))
    assert Journal(str(p)).load().chunks == {(0, 0): 4096}


# ---- recover() (point 8) ---------------------------------------------------------------------


def _pulled(tmp_path: Path) -> tuple[NodeStore, str, Path]:
    src = tmp_path / "src"
    (src / "cfg").mkdir(parents=True)
    (src / "w.bin").write_bytes(random_bytes(300_000, seed=1))
    (src / "cfg" / "config.json").write_bytes(b'{"v": 1}')
    root = tmp_path / "root"
    res = pull(str(src), root=root, options=OPTS, settings=Settings.from_env({}))
    return NodeStore.at(root), res.storage_key, src


def test_recover_never_installs_a_pending_manifest_that_does_not_describe_the_folder(tmp_path: Path) -> None:
    """A publish crashed before its manifest (pending manifest A in staging); then an in-place
    repair moved the folder to revision B with files of the same sizes, and B's manifest was lost
    too. ``recover`` installed A over B's files: "present", with wrong digests and revision."""
    store, key, _ = _pulled(tmp_path)
    staging = store.layout.staging_dir(key)
    staging.mkdir(parents=True)
    os.rename(store.layout.manifest_path(key), staging / "manifest.json")  # manifest A, pending
    folder = store.layout.model_dir(key)
    (folder / "w.bin").write_bytes(random_bytes(300_000, seed=2))  # revision B, same size
    assert not store.is_present(key)
    store.recover(key)
    assert store.manifest(key) is None and not store.is_present(key)
    assert not staging.exists(), "the stale pending manifest is dropped, not left for the next recover"


def test_recover_still_finishes_the_publish_it_is_for(tmp_path: Path) -> None:
    store, key, _ = _pulled(tmp_path)
    staging = store.layout.staging_dir(key)
    staging.mkdir(parents=True)
    os.rename(store.layout.manifest_path(key), staging / "manifest.json")
    store.recover(key)
    assert store.is_present(key) and store.verify(key) == [] and not staging.exists()


def test_in_place_repair_drops_a_pending_manifest_left_in_staging(tmp_path: Path) -> None:
    """The agent's repair never touched ``staging/<key>``, so the stale pending manifest stayed for
    a later ``recover`` (a CLI pull on the agent's root) to install."""
    from agent.repair import install_in_place

    store, key, _ = _pulled(tmp_path)
    manifest = store.manifest(key)
    assert manifest is not None
    staging = store.layout.staging_dir(key)
    staging.mkdir(parents=True)
    (staging / "manifest.json").write_text(manifest.to_json())  # left by a crashed publish
    store.layout.manifest_path(key).unlink()  # damaged: the agent took the manifest away
    staged = tmp_path / "staged"
    shutil.copytree(store.layout.model_dir(key), staged)
    install_in_place(store, key, staged, manifest, [f.path for f in manifest.files])
    assert store.is_present(key)
    assert not staging.exists()
