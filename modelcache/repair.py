"""In-place repair of a damaged model: only the bad files change, the model folder stays.

Used by the agent (a check found damage) and by ``modelcache verify --repair``.

A running pod mounts ``models/<storageKey>`` through a PVC subPath, which the kubelet resolves
to the folder's inode when the container starts. Replacing the whole folder (what a normal
publish does for an unlisted copy) would leave that pod looking at a deleted directory until it
restarts. So a repair first hashes the model's files against the damaged model's manifest and
pulls exactly the files that are damaged or missing into its own destination folder beside the
store (``.modelcache/repair/<storageKey>``, same file system, resumable like any pull), then
renames each of them into place inside the existing folder (an atomic ``rename(2)`` per file:
a reader sees the old or the new file, never a partial one; open handles keep the old bytes),
and installs the manifest last, so the model counts as present only once every file matches
it. Without a manifest to go by (a crash mid-repair lost it) the whole model is pulled, files
the new listing no longer has are removed, and the same renames follow.

A repair restores the revision that was damaged, never a newer one: files renamed one by one
into a folder that running pods read would otherwise mix two revisions (a pod that restarts or
opens a file lazily meanwhile loads half of each). The damaged manifest is kept as the repair's
pin (``.modelcache/repair/<storageKey>.pinned.json``). Where the source has revisions (an HF
commit, an OCI digest) the repair pulls that pinned revision; otherwise (S3, GCS, HTTP, local)
it pulls the URI and installs nothing unless every file equals the pinned one, size and digest.
"""

from __future__ import annotations

import contextlib
import dataclasses
import logging
import os
import shutil
from collections.abc import Callable, Collection, Iterable
from dataclasses import dataclass
from pathlib import Path

from modelcache.diskio import fsync_dir
from modelcache.errors import SourceChangedError, StoreError
from modelcache.integrity import hash_file
from modelcache.pull import PullPlan, PullResult
from modelcache.store import DestLayout, Manifest, ManifestFile, NodeLayout, NodeStore

log = logging.getLogger("modelcache.repair")

#: ``pull_into(dest, uri, check, only)``: pull ``uri`` (None: the model's own URI) into the
#: folder ``dest``; ``check`` sees the whole listing before a byte is written and may refuse it
#: (raise); ``only`` (None: all) names the files to fetch.
Pull = Callable[[Path, str | None, Callable[[PullPlan], None] | None, Collection[str] | None], PullResult]


@dataclass(frozen=True)
class RepairOutcome:
    result: PullResult
    replaced: list[str]
    removed: list[str]


def repair_dir(layout: NodeLayout, key: str) -> Path:
    return layout.meta / "repair" / key


def pin_path(layout: NodeLayout, key: str) -> Path:
    """The damaged model's manifest, kept until the repair is installed: what it must restore."""
    return layout.meta / "repair" / f"{key}.pinned.json"


def pin_damaged(store: NodeStore, key: str) -> Manifest | None:
    """Take a damaged model's manifest away (it stops being present for every reader of the
    store) and keep it as the repair's pin. The caller holds the model's store lock."""
    layout = store.layout
    assert isinstance(layout, NodeLayout)
    manifest = store.manifest(key)
    final = layout.manifest_path(key)
    if manifest is None:
        final.unlink(missing_ok=True)
        return None
    pin = pin_path(layout, key)
    pin.parent.mkdir(parents=True, exist_ok=True)
    os.replace(final, pin)
    fsync_dir(str(pin.parent))
    return manifest


def pinned_manifest(layout: NodeLayout, key: str) -> Manifest | None:
    """The manifest a repair in progress restores (kept by ``pin_damaged``), or None."""
    try:
        m = Manifest.from_json(pin_path(layout, key).read_text())
    except (OSError, ValueError, TypeError, KeyError):
        return None
    return m if m.storage_key == key else None


def _differences(pinned: Manifest, got: Manifest, only: Collection[str] | None = None) -> list[str]:
    want = {f.path: (f.size, f.xxh3) for f in pinned.files}
    have = {f.path: (f.size, f.xxh3) for f in got.files}
    paths = want.keys() | have.keys() if only is None else set(only)
    return sorted(p for p in paths if want.get(p) != have.get(p))


def damaged_files(store: NodeStore, key: str, manifest: Manifest) -> list[str]:
    """The files of the model folder that do not match ``manifest`` (missing, resized, other
    bytes): what a repair fetches. Hashes every file."""
    target = store.layout.model_dir(key)
    return [f.path for f in manifest.files if not _matches(target / f.path, f)]


def needs_repair(store: NodeStore, key: str, old_files: Iterable[str] = ()) -> bool:
    """A model of ours that a check found damaged (``old_files``: what its manifest listed; its
    pin, kept across a restart), or whose repair a crash interrupted: fix it in place against
    what it was, never swap it.

    A folder that was never ours (KServe's agent filled it) is no repair: the pull adopts it
    (``modelcache.adopt``), keeping every file the source's listing and checksums vouch for.
    """
    layout = store.layout
    assert isinstance(layout, NodeLayout)
    if not layout.model_dir(key).is_dir() or store.is_present(key):
        return False
    return bool(list(old_files)) or pin_path(layout, key).exists() or repair_dir(layout, key).exists()


def _matches(path: Path, want: ManifestFile) -> bool:
    try:
        st = path.lstat()
    except OSError:
        return False
    if not os.path.isfile(path) or os.path.islink(path) or st.st_size != want.size:
        return False
    return hash_file(path, size=st.st_size).local_hexdigest() == want.xxh3


def install_in_place(store: NodeStore, key: str, staged: Path, manifest: Manifest,
                     old_files: Iterable[str] = (), only: Collection[str] | None = None) -> tuple[list[str], list[str]]:
    """Rename the staged files that differ into ``models/<key>``; return (replaced, removed).
    ``only``: the files that were fetched (the others were found whole and stay untouched).

    The caller holds the model's store lock. The manifest is installed last: until then the
    model is not present, and a crash part-way leaves a folder that the next repair finishes.
    """
    target = store.layout.model_dir(key)
    target.mkdir(parents=True, exist_ok=True)
    replaced: list[str] = []
    touched_dirs: set[Path] = set()
    for f in manifest.files:
        if only is not None and f.path not in only:
            continue
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
    """Pull the model's pinned revision into its repair folder, then fix the model in place."""
    layout = store.layout
    assert isinstance(layout, NodeLayout)
    staged = repair_dir(layout, key)
    staged.mkdir(parents=True, exist_ok=True)
    pinned = pinned_manifest(layout, key)
    # Sources with revisions listed the one they read in the manifest: pull exactly that.
    at_revision = pinned.resolved_uri if pinned and pinned.revision and pinned.resolved_uri != pinned.uri else None

    # With the damaged manifest to go by, only the files that fail it are fetched; the others
    # are the pinned revision's already, whatever the source holds for them now.
    only = damaged_files(store, key, pinned) if pinned is not None else None

    def same_listing(plan: PullPlan) -> None:
        """Without a revision, a file to fetch that is gone or resized at the source is refused
        before any download (one of the same size is held against its digest once fetched)."""
        if pinned is None or at_revision is not None:
            return
        want = {f.path: f.size for f in pinned.files if only is None or f.path in only}
        have = dict(plan.listing)
        differ = sorted(p for p in want if p not in have or have[p] not in (None, want[p]))
        if differ:
            raise _moved(pinned, differ)
    if only == []:  # every file matches (a crash after they were fixed): only the manifest is missing
        result = PullResult(uri=pinned.uri, storage_key=key, path=layout.model_dir(key),  # type: ignore[union-attr]
                            resolved_uri=pinned.resolved_uri, files=len(pinned.files),  # type: ignore[union-attr]
                            bytes=pinned.total_size, cached=True, elapsed=0.0)  # type: ignore[union-attr]
    else:
        result = pull_into(staged, at_revision, same_listing, only)
    manifest_file = DestLayout(staged).manifest_path(result.storage_key)
    try:
        manifest = Manifest.from_json(manifest_file.read_text()) if only != [] else pinned
    except (OSError, ValueError, TypeError, KeyError) as exc:
        raise StoreError(f"{result.uri}: repair download left no manifest in {staged} ({exc})") from None
    assert manifest is not None
    fetched = {f.path for f in manifest.files} if only is not None else None
    if pinned is not None:
        differ = _differences(pinned, manifest, fetched)
        if only is not None and fetched is not None:
            differ = sorted({*differ, *(set(only) - fetched)})  # a damaged file the source no longer has
        if differ:  # same names and sizes, other bytes: the download is of no use
            shutil.rmtree(staged, ignore_errors=True)
            raise _moved(pinned, differ)
        manifest = pinned  # every fetched file is the pinned one: the model is the pinned model again
        old_files = {*old_files, *(f.path for f in pinned.files)}
    manifest = dataclasses.replace(manifest, storage_key=key)
    with store.lock(key):  # the node store's lock: no removal or other pull of the model meanwhile
        replaced, removed = install_in_place(store, key, staged, manifest, old_files, fetched)
        pin_path(layout, key).unlink(missing_ok=True)
    shutil.rmtree(staged, ignore_errors=True)
    log.info("repaired in place", extra={"fields": {"storage_key": key, "replaced": ",".join(replaced[:20]),
                                                    "replaced_count": len(replaced), "removed": len(removed)}})
    out = dataclasses.replace(result, path=layout.model_dir(key), cached=result.cached and not replaced,
                              files=len(manifest.files), bytes=manifest.total_size)
    return RepairOutcome(out, replaced, removed)


def _moved(pinned: Manifest, differ: list[str]) -> SourceChangedError:
    return SourceChangedError(
        f"{pinned.uri}: the source changed since the model was downloaded ({len(differ)} file(s) differ, "
        f"e.g. '{differ[0]}'), so its damaged copy is not repaired in place: that would mix two revisions "
        "under the pods using it. Restore the source, or remove the model from the node (once no pod "
        "uses it) and add it again to take the new revision"
    )
