"""Adoption: take over a model folder someone else filled, in place, without downloading it again.

A KServe node agent leaves ``models/<storageKey>/`` with the model and no manifest of ours; an
init container that finished leaves DEST with the model and no bookkeeping (it removes its own).
Such a folder is not fetched again: each listed file already there is checked against the
listing (its size, and its bytes against every checksum the source vouches for: the file on
disk is hashed, nothing is read from the origin and no second copy is written). The manifest
goes last.

What happens to a listed file that is missing or differs depends on what is known of the folder:

* ``COMPLETE`` (nothing known: a folder that may be a partial download, as KServe's own agent
  assumes of a folder whose status is not ``ModelDownloaded``): it is downloaded and renamed
  into the folder (a pod that mounts it sees the old or the new file, never a partial one).
* ``AS_FOUND`` (the folder was reported complete: KServe's persisted ``ModelDownloaded``): it is
  what KServe downloaded of an earlier revision of a mutable source (a moved ``hf://`` branch,
  a rewritten S3 object, a replaced HTTP file), and pods are reading it. Nothing is rewritten
  under them: a differing file is kept as found (in the manifest, marked ``KEPT_AS_FOUND``, so
  a drift check reports it), a missing one is left out (the drift check reports it added), and
  updating stays an explicit refresh (``modelcache pull --refresh``). Where the folder says
  which revision it holds (``Source.revision_in``: huggingface_hub's own records of the commit
  it downloaded), the listing is that revision's, so what is on disk is verified as it is, and
  a file that differs from *that* revision is damage and is fetched (same revision) as above.

A file is kept on its size alone when the source has no checksum we can compute (a plain
HTTP server, an S3 multipart upload without its part size): that is what KServe itself knows
of a file. The manifest lists such files as ``unverified`` (``ls`` and the pull say so; a
``pull --refresh`` fetches them again), and a file with a hole (never written whole: a
preallocated or partial copy) is fetched instead.

Only a folder the store has no record of is adopted: one it knew (a manifest, damaged or not,
a damage mark, a repair) is checked against that record by the pull instead (``NodeStore.knew``).
Nothing is followed out of the folder: a file reached through a linked sub-folder, or a link
itself, is fetched; and files and links the listing does not name are moved out of a node
store's model folder (``NodeStore.set_aside_unlisted``): pods see the model and nothing else.
"""

from __future__ import annotations

import logging
import os
import stat
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path

from modelcache.engine.transfer import FetchedFile
from modelcache.errors import StoreError
from modelcache.runtime.clock import rfc3339
from modelcache.runtime.filecheck import has_holes
from modelcache.sources.base import RemoteFile
from modelcache.sources.integrity import hash_file
from modelcache.store import Manifest, ManifestFile, Store, regular_file_inside

log = logging.getLogger(__name__)


#: Policies (module docstring).
COMPLETE = "complete"
AS_FOUND = "as-found"


@dataclass
class Adoption:
    """What a folder already holds of a listing."""

    kept: list[FetchedFile] = field(default_factory=list)
    #: Indexes (into the listing) of the files to download.
    fetch: list[int] = field(default_factory=list)
    #: With ``keep_differing``: listed files that are there but differ (size or checksum), kept as
    #: found, each with its listing index (its digest is of the bytes on disk, verified by nothing).
    differ: list[tuple[int, FetchedFile]] = field(default_factory=list)
    #: Bytes hashed on disk, and files kept on their size alone (no checksum to compare).
    hashed_bytes: int = 0
    size_only: int = 0

    @property
    def kept_bytes(self) -> int:
        return sum(f.size for f in self.kept)


def applies(store: Store, key: str) -> bool:
    """A real folder (not a link) with content that the store has no record of (checked under
    the model's lock)."""
    if store.knew(key):
        return False
    folder = store.layout.model_dir(key)
    try:
        if stat.S_ISLNK(os.lstat(folder).st_mode):
            return False  # a link to a folder elsewhere: replaced by the pull, never merged into
        names = store.foreign_names(key)
    except OSError:
        return False
    return bool(names)


def check_file(folder: Path, want: RemoteFile) -> FetchedFile | None:
    """The file ``want`` in ``folder`` as a fetched file, if it is the listed one; None if it must
    be fetched (missing, another size or checksum, a link or under one, a hole where nothing else
    can tell)."""
    st = regular_file_inside(folder, want.path)
    if st is None or want.size is None or st.st_size != want.size:
        return None
    path = folder / want.path
    hashed = hash_file(path, want.checksums, size=st.st_size)
    if hashed.mismatches():
        return None
    if not hashed.expected and has_holes(path):
        return None  # sizes alone would keep a preallocated or partial copy
    return FetchedFile(want.path, st.st_size, hashed.local_hexdigest(),
                       tuple(sorted({c.algo for c in hashed.expected})))


def as_found(folder: Path, rel: str) -> FetchedFile | None:
    """The regular file ``rel`` in ``folder`` as it is (hashed; verified by nothing), for
    ``AS_FOUND``; None for a missing file, a link, or a file under one (nothing is followed out)."""
    st = regular_file_inside(folder, rel)
    if st is None:
        return None
    return FetchedFile(rel, st.st_size, hash_file(folder / rel, size=st.st_size).local_hexdigest(), ())


def check(folder: Path, files: list[RemoteFile], on_file: Callable[[str, int], None] | None = None,
          keep_differing: bool = False) -> Adoption:
    """Compare ``folder`` with the listing ``files``; hashes every file whose size matches (and,
    ``keep_differing``, every other file there, to keep it as found)."""
    out = Adoption()
    for i, want in enumerate(files):
        got = check_file(folder, want)
        if got is None:
            found = as_found(folder, want.path) if keep_differing else None
            if found is not None:
                out.differ.append((i, found))
                out.hashed_bytes += found.size
                if on_file is not None:
                    on_file(want.path, found.size)
            else:
                out.fetch.append(i)
            continue
        out.kept.append(got)
        out.hashed_bytes += got.size
        if not got.verified:
            out.size_only += 1
        if on_file is not None:
            on_file(want.path, got.size)
    return out


def record_folder(store: Store, key: str, uri: str) -> Manifest:
    """A manifest of what a folder holds, hashed on disk, for a model that something else wrote
    there (a custom download container): from then on it is checked and repaired like any other.
    No source checksum vouches for these files; the manifest says so (empty ``checksums``)."""
    folder = store.layout.model_dir(key)
    files = []
    for path in sorted(p for p in folder.rglob("*") if p.is_file() and not p.is_symlink()):
        size = path.stat().st_size
        files.append(ManifestFile(path.relative_to(folder).as_posix(), size,
                                  hash_file(path, size=size).local_hexdigest()))
    if not files:
        raise StoreError(f"{uri}: the download left no file in {folder}")
    manifest = Manifest(storage_key=key, uri=uri, resolved_uri=uri, revision=None, files=files, created_at=rfc3339())
    with store.lock(key):
        store.install_manifest(key, manifest)
    return manifest
