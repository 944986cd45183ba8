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
opens a file lazily meanwhile loads half of each). The damaged model keeps its manifest, marked
damaged (``.modelcache/manifests/<storageKey>.damaged.json``): that manifest is the repair's pin.
Where the source has revisions (an HF commit, an OCI digest) the repair pulls that pinned
revision; otherwise (S3, GCS, HTTP, local) it pulls the URI and installs nothing unless every
file equals the pinned one, size and digest. A refused repair leaves no download behind and the
model marked damaged with the files it could not restore: a plain pull then fetches the source's
current revision whole (``modelcache.pull``: every stored file checked against its digest).
"""

from __future__ import annotations

import dataclasses
import logging
from collections.abc import Callable, Collection, Iterable
from dataclasses import dataclass
from pathlib import Path

from modelcache.errors import SourceChangedError, StoreError
from modelcache.pull import PullPlan, PullResult
from modelcache.store import Manifest, NodeStore, file_matches

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


def _differences(pinned: Manifest, got: Manifest, only: Collection[str] | None = None) -> list[str]:
    want = {f.path: (f.size, f.xxh3) for f in pinned.files}
    have = {f.path: (f.size, f.xxh3) for f in got.files}
    paths = want.keys() | have.keys() if only is None else set(only)
    return sorted(p for p in paths if want.get(p) != have.get(p))


def damaged_files(store: NodeStore, key: str, manifest: Manifest) -> list[str]:
    """The files of the model folder that do not match ``manifest`` (missing, resized, other
    bytes): what a repair fetches. Hashes every file."""
    target = store.layout.model_dir(key)
    return [f.path for f in manifest.files if not file_matches(target / f.path, f)]


def needs_repair(store: NodeStore, key: str, old_files: Iterable[str] = ()) -> bool:
    """A model of ours that a check found damaged (``old_files``: what its manifest listed; its
    pin, kept across a restart), or whose repair a crash interrupted: fix it in place against
    what it was, never swap it.

    A folder that was never ours (KServe's agent filled it) is no repair: the pull adopts it
    (``modelcache.adopt``), keeping every file the source's listing and checksums vouch for.
    """
    if not store.layout.model_dir(key).is_dir() or store.is_present(key):
        return False
    return (bool(list(old_files)) or store.pinned_manifest(key) is not None or store.repair_underway(key)
            or store.damage(key) is not None)


def repair(store: NodeStore, key: str, pull_into: Pull, old_files: Iterable[str] = ()) -> RepairOutcome:
    """Pull the model's pinned revision into its repair folder, then fix the model in place."""
    layout = store.layout
    staged = store.repair_download(key)
    pinned = store.pinned_manifest(key)
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
            raise _refused(store, key, pinned, differ, only)
    if only == []:  # every file matches (a crash after they were fixed): only the manifest is missing
        result = PullResult(uri=pinned.uri, storage_key=key, path=layout.model_dir(key),  # type: ignore[union-attr]
                            resolved_uri=pinned.resolved_uri, files=len(pinned.files),  # type: ignore[union-attr]
                            bytes=pinned.total_size, cached=True, elapsed=0.0)  # type: ignore[union-attr]
    else:
        result = pull_into(staged, at_revision, same_listing, only)
    manifest = store.downloaded_manifest(staged, result.storage_key) if only != [] else pinned
    if manifest is None:
        raise StoreError(f"{result.uri}: repair download left no readable manifest in {staged}")
    assert manifest is not None
    fetched = {f.path for f in manifest.files} if only is not None else None
    if pinned is not None:
        differ = _differences(pinned, manifest, fetched)
        if only is not None and fetched is not None:
            differ = sorted({*differ, *(set(only) - fetched)})  # a damaged file the source no longer has
        if differ:  # same names and sizes, other bytes: the download is of no use
            raise _refused(store, key, pinned, differ, only)
        manifest = pinned  # every fetched file is the pinned one: the model is the pinned model again
        old_files = {*old_files, *(f.path for f in pinned.files)}
    manifest = dataclasses.replace(manifest, storage_key=key)
    with store.lock(key):  # the node store's lock: no removal or other pull of the model meanwhile
        replaced, removed = store.install_in_place(key, staged, manifest, old_files, fetched)
        store.end_repair(key)
    log.info("repaired in place", extra={"fields": {"storage_key": key, "replaced": ",".join(replaced[:20]),
                                                    "replaced_count": len(replaced), "removed": len(removed)}})
    out = dataclasses.replace(result, path=layout.model_dir(key), cached=result.cached and not replaced,
                              files=len(manifest.files), bytes=manifest.total_size)
    return RepairOutcome(out, replaced, removed)


def _refused(store: NodeStore, key: str, pinned: Manifest, differ: list[str],
             damaged: Collection[str] | None) -> SourceChangedError:
    """The repair cannot restore the pinned revision: no download stays behind, the model keeps
    its manifest and stays marked damaged, naming its damaged files (what a pull fetches again)."""
    error = SourceChangedError(
        f"{pinned.uri}: the source changed since the model was downloaded ({len(differ)} file(s) differ, "
        f"e.g. '{differ[0]}'), so its damaged copy is not repaired in place: that would mix two revisions "
        "under the pods using it. Restore the source, or remove the model from the node (once no pod "
        "uses it) and add it again to take the new revision"
    )
    with store.lock(key):
        store.drop_repair_download(key)
        store.mark_damaged(key, damaged if damaged is not None else differ, f"repair refused: {error}")
    return error
