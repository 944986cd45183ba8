"""In-place repair of a damaged model: only the bad files change, the model folder stays.

A running pod mounts ``models/<storageKey>`` through a PVC subPath, which the kubelet resolves
to the folder's inode when the container starts. Replacing the whole folder (what a normal
publish does for an unlisted copy) would leave that pod looking at a deleted directory until it
restarts. So a repair pulls the model again into its own destination folder beside the store
(``.modelcache/repair/<storageKey>``, same file system, resumable like any pull), then renames
each file that differs into place inside the existing folder (an atomic ``rename(2)`` per file:
a reader sees the old or the new file, never a partial one; open handles keep the old bytes),
removes files the new listing no longer has, and installs the new manifest last, so the model
counts as present only once every file matches it.
"""

from __future__ import annotations

import contextlib
import dataclasses
import logging
import os
import shutil
from collections.abc import Callable, Iterable
from dataclasses import dataclass
from pathlib import Path

from agent.logs import fields
from modelcache.diskio import fsync_dir
from modelcache.errors import StoreError
from modelcache.integrity import hash_file
from modelcache.pull import PullResult
from modelcache.store import Manifest, ManifestFile, NodeLayout, NodeStore

log = logging.getLogger("agent.repair")

Pull = Callable[[Path], PullResult]


@dataclass(frozen=True)
class RepairOutcome:
    result: PullResult
    replaced: list[str]
    removed: list[str]


def repair_dir(layout: NodeLayout, key: str) -> Path:
    return layout.meta / "repair" / key


def needs_repair(store: NodeStore, key: str) -> bool:
    """A model folder is there but is not a complete, listed model: fix it in place, never swap it."""
    return store.layout.model_dir(key).is_dir() and not store.is_present(key)


def _matches(path: Path, want: ManifestFile) -> bool:
    try:
        st = path.lstat()
    except OSError:
        return False
    if not os.path.isfile(path) or os.path.islink(path) or st.st_size != want.size:
        return False
    return hash_file(path, size=st.st_size).local_hexdigest() == want.xxh3


def install_in_place(store: NodeStore, key: str, staged: Path, manifest: Manifest,
                     old_files: Iterable[str] = ()) -> tuple[list[str], list[str]]:
    """Rename the staged files that differ into ``models/<key>``; return (replaced, removed).

    The caller holds the model's store lock. The manifest is installed last: until then the
    model is not present, and a crash part-way leaves a folder that the next repair finishes.
    """
    target = store.layout.model_dir(key)
    target.mkdir(parents=True, exist_ok=True)
    replaced: list[str] = []
    touched_dirs: set[Path] = set()
    for f in manifest.files:
        dst = target / f.path
        if _matches(dst, f):
            continue
        src = staged / f.path
        dst.parent.mkdir(parents=True, exist_ok=True)
        if dst.is_dir() and not dst.is_symlink():
            shutil.rmtree(dst)  # a folder where a file belongs: never a rename target
        os.replace(src, dst)
        replaced.append(f.path)
        touched_dirs.add(dst.parent)
    wanted = {f.path for f in manifest.files}
    removed: list[str] = []
    for rel in sorted(set(old_files) - wanted):  # only files we published before: never a stranger's
        with contextlib.suppress(FileNotFoundError):
            (target / rel).unlink()
            removed.append(rel)
            touched_dirs.add((target / rel).parent)
    for d in sorted(touched_dirs):
        with contextlib.suppress(OSError):
            fsync_dir(str(d))
    final = store.layout.manifest_path(key)
    final.parent.mkdir(parents=True, exist_ok=True)
    tmp = final.with_name(f".{final.name}.repair")
    with open(tmp, "w") as out:
        out.write(manifest.to_json())
        out.flush()
        os.fsync(out.fileno())
    os.replace(tmp, final)
    fsync_dir(str(final.parent))
    # A publish that crashed before its manifest left one pending in staging: it describes the
    # folder as it was then, not as repaired, and ``recover`` must never find it later.
    shutil.rmtree(store.layout.staging_dir(key), ignore_errors=True)
    return replaced, removed


def repair(store: NodeStore, key: str, pull_into: Pull, old_files: Iterable[str] = ()) -> RepairOutcome:
    """Pull the model into its repair folder (``pull_into(dest)``), then fix the model in place."""
    layout = store.layout
    assert isinstance(layout, NodeLayout)
    staged = repair_dir(layout, key)
    staged.mkdir(parents=True, exist_ok=True)
    result = pull_into(staged)
    manifest_file = staged / ".modelcache" / "manifest.json"
    try:
        manifest = Manifest.from_json(manifest_file.read_text())
    except (OSError, ValueError, TypeError, KeyError) as exc:
        raise StoreError(f"{result.uri}: repair download left no manifest in {staged} ({exc})") from None
    manifest = dataclasses.replace(manifest, storage_key=key)
    with store.lock(key):  # the node store's lock: no removal or other pull of the model meanwhile
        replaced, removed = install_in_place(store, key, staged, manifest, old_files)
    shutil.rmtree(staged, ignore_errors=True)
    log.info("repaired in place", extra=fields(storage_key=key, replaced=",".join(replaced[:20]),
                                               replaced_count=len(replaced), removed=len(removed)))
    out = dataclasses.replace(result, path=layout.model_dir(key), cached=result.cached and not replaced)
    return RepairOutcome(out, replaced, removed)
