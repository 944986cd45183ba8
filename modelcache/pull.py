"""The one path every caller takes: URI -> source listing -> transfer engine -> node store.

The CLI, the initializer and the agent are thin callers of ``pull`` / ``pull_many``. A pull
takes the model's lock (a second pull of the same model waits, then finds it present), returns
at once for a model already present, resumes a staged download whose listing is unchanged,
checks free space before writing a byte, and publishes atomically.
"""

from __future__ import annotations

import contextlib
import dataclasses
import fnmatch
import functools
import logging
import os
import shutil
import threading
import time
from collections.abc import Callable, Collection, Iterator, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING

from modelcache import adopt
from modelcache.archive import ArchiveLimits, single_archive, unpack_archive
from modelcache.clock import rfc3339
from modelcache.credentials import Settings
from modelcache.diskio import fsync_tree
from modelcache.drift import CHANGED, CURRENT, KEPT_AS_FOUND, Drift, compare
from modelcache.errors import (
    CancelledError,
    InsufficientSpaceError,
    IntegrityError,
    ModelcacheError,
    NotFoundError,
)
from modelcache.integrity import hash_file
from modelcache.journal import Journal, JournalState
from modelcache.progress import ProgressTracker, human_bytes, plural
from modelcache.sources.base import RemoteFile, Source, open_source, source_class
from modelcache.store import (
    DestStore,
    Guard,
    Manifest,
    ManifestFile,
    NodeStore,
    StagedPull,
    Store,
    file_matches,
    regular_file_inside,
)
from modelcache.transfer import FetchedFile, FileJob, TransferEngine, TransferOptions
from modelcache.uri import Location, parse_uri

if TYPE_CHECKING:
    from modelcache.peers.network import PeerNetwork

log = logging.getLogger(__name__)

#: Kept free on the store's file system beyond the model itself: the default of the CLI's and the
#: init container's ``--space-margin`` (``MODELCACHE_SPACE_MARGIN``). The agent passes its own
#: ``--space-margin`` (256 MiB by default), which is then the only margin its pulls keep.
SPACE_MARGIN = 64 << 20


@dataclass(frozen=True)
class PullResult:
    uri: str  # redacted
    storage_key: str
    path: Path
    resolved_uri: str
    files: int
    bytes: int
    cached: bool
    elapsed: float
    #: Source checksum algorithms the files were verified with ("sha256", ...), beyond xxh3-128.
    verified: tuple[str, ...] = ()
    #: A refresh: the files fetched again (changed or new at the source) and those it dropped.
    refreshed: tuple[str, ...] = ()
    dropped: tuple[str, ...] = ()
    #: Files (and their bytes) that were already in the model folder and were kept (adoption).
    adopted: int = 0
    adopted_bytes: int = 0
    #: The single archive the model was unpacked from, if it was one.
    unpacked_from: str | None = None
    #: Stored files fetched again because their bytes no longer matched the store's record
    #: (damaged), found when a refresh or a pull of a damaged model checked them.
    refetched: tuple[str, ...] = ()
    #: Files kept on their size alone (adoption, the source gives no checksum): unverified.
    unverified: tuple[str, ...] = ()
    #: Files the listing does not name, moved out of an adopted folder (and where to).
    set_aside: tuple[str, ...] = ()
    set_aside_to: str = ""
    #: Adopted AS_FOUND (modelcache.adopt): listed files kept although they differ from the source,
    #: and listed files absent from the folder and left out; the revision the folder was verified
    #: at when it said which one it holds; what differs from the listing (None: nothing).
    kept_as_found: tuple[str, ...] = ()
    absent: tuple[str, ...] = ()
    pinned_revision: str | None = None
    drift: Drift | None = None
    #: Seconds from the first byte requested to the last written (``elapsed`` adds start-up,
    #: listing and publishing: the benchmarks' fixed cost is the difference).
    transfer_seconds: float = 0.0


@dataclass(frozen=True)
class PullPlan:
    """What a model's download needs, known once it is listed (for admission and reservations)."""

    location: Location
    storage_key: str
    total_bytes: int
    bytes_needed: int
    files: int
    revision: str | None
    #: (path, size) of every listed file: what an in-place repair compares with the damaged copy.
    listing: tuple[tuple[str, int | None], ...] = ()


@dataclass
class _Model:
    location: Location
    store: Store
    key: str
    source: Source | None = None
    files: list[RemoteFile] = field(default_factory=list)
    journal: Journal | None = None
    resume: JournalState = field(default_factory=JournalState)
    result: PullResult | None = None
    error: BaseException | None = None
    started: float = field(default_factory=time.monotonic)
    #: (path, size) of every listed file, before ``only`` narrowed ``files`` (PullPlan.listing).
    listed: tuple[tuple[str, int | None], ...] = ()
    #: A refresh of a stored model, or a pull of a folder the store knew (damaged, its manifest
    #: broken, a repair under way): what differs, and the stored files it carries over once
    #: their bytes hash to the store's record (the others are fetched: ``refetched``).
    drift: Drift | None = None
    carry: dict[str, ManifestFile] = field(default_factory=dict)
    refetched: list[str] = field(default_factory=list)
    set_aside: list[str] = field(default_factory=list)
    #: Files already in the model folder (adoption): kept, never fetched; their listing indexes.
    adopted: list[FetchedFile] = field(default_factory=list)
    skip: set[int] = field(default_factory=set)
    #: The model folder exists and stays: fetched files are renamed into it one by one.
    in_place: bool = False
    unpack: bool = False
    unpacked_from: str | None = None
    #: Its files went to the transfer engine (a failure may have staged bytes worth resuming).
    transferred: bool = False
    #: Its staging folder was started afresh by this pull (not a resume of an earlier one).
    fresh: bool = False
    unpacked_links: list[str] = field(default_factory=list)
    #: Adoption (modelcache.adopt): the policy, whether the folder is someone else's, the revision
    #: it holds (when it says) and was listed at, what was kept although it differs, what was left out.
    adoption: str = adopt.COMPLETE
    foreign: bool = False
    pinned: str | None = None
    kept_as_found: set[str] = field(default_factory=set)
    absent: tuple[str, ...] = ()
    adoption_drift: Drift | None = None
    #: AS_FOUND of a model that is one archive: the archive is fetched to verify the folder with,
    #: and its unpacked files are compared with the folder's, never merged into it.
    compare_unpacked: bool = False


def _store_for(location: Location, root: Path | None, dest: Path | None, guard: Guard | None) -> Store:
    if dest is not None and root is None:
        return DestStore.at(dest)
    if root is not None and dest is None:
        return NodeStore.at(root, guard)
    raise ModelcacheError("pull needs exactly one of a store root or a destination folder")


def _matches(path: str, patterns: tuple[str, ...]) -> bool:
    # As huggingface_hub (which KServe hands the patterns to): "dir/" means everything under it.
    return any(fnmatch.fnmatch(path, p + "*" if p.endswith("/") else p) for p in patterns)


def apply_patterns(files: list[RemoteFile], settings: Settings) -> list[RemoteFile]:
    """STORAGE_ALLOW_PATTERNS / STORAGE_IGNORE_PATTERNS, fnmatch on relative paths (KServe)."""
    out = files
    if settings.allow_patterns:
        out = [f for f in out if _matches(f.path, settings.allow_patterns)]
    if settings.ignore_patterns:
        out = [f for f in out if not _matches(f.path, settings.ignore_patterns)]
    return out


def _name_uri(exc: BaseException, display: str) -> BaseException:
    """Engine errors name the file; the user also needs to know which model it belongs to."""
    if isinstance(exc, ModelcacheError) and display not in str(exc):
        exc.args = (f"{display}: {exc}",)
    return exc


def _plan_doc(m: _Model, chunk_size: int) -> dict[str, object]:
    return {
        "storage_key": m.key,
        "uri": m.location.display,  # redacted; for `modelcache ls` while the pull is staged
        "resolved_uri": m.source.resolved_uri if m.source else "",
        "chunk_size": chunk_size,
        "files": [[f.path, f.size, f.version] for f in m.files],
    }


def _prepare_staging(m: _Model, chunk_size: int) -> None:
    """Reuse a staged download only if it was for exactly this listing and chunk plan."""
    staging = m.store.staging(m.key)
    prepared = staging.prepare(_plan_doc(m, chunk_size))
    m.fresh, m.journal, m.resume = prepared.fresh, prepared.journal, prepared.resume
    # A file without a version (an HTTP server with neither ETag nor Last-Modified) may have been
    # replaced by one of the same size since it was staged: nothing can tell, so its staged bytes
    # are not reused (as KServe, which never resumes) rather than mixed into a silently wrong file.
    for i, f in enumerate(m.files):
        if f.version is None:
            m.resume.files.pop(i, None)
            for key in [k for k in m.resume.chunks if k[0] == i]:
                del m.resume.chunks[key]
    # Adopted files stay where they are: a staged copy left by an earlier attempt would be merged
    # over one at publish, under the digest of the file it replaced.
    for i in m.skip:
        staging.drop_file(m.files[i].path)
    m.journal.open(fresh=m.fresh)


def bytes_needed(m: _Model) -> int:
    """Bytes the download still has to allocate (preallocated staged files already hold theirs)."""
    return m.store.staging(m.key).bytes_needed([(f.path, f.size) for f in m.files], m.skip)


def _listing(m: _Model) -> tuple[tuple[str, int | None], ...]:
    return m.listed or tuple((f.path, f.size) for f in m.files)


@dataclass(frozen=True)
class SpacePolicy:
    """What a pull keeps free on the store's file system, and what its refusal advises.

    ``advice``: the fix to name when the model does not fit (the agent's: its root holds what
    its spec lists, so a gc there would only evict models it downloads again). None: the CLI's,
    a gc when evicting models made here can make the room, else what can."""

    margin: int = SPACE_MARGIN
    advice: str | None = None


def _check_space(m: _Model, policy: SpacePolicy) -> None:
    need = bytes_needed(m)
    usage = shutil.disk_usage(m.store.staging(m.key).data)
    free, margin = usage.free, policy.margin
    if need + margin <= free:
        return
    where = m.store.layout.base
    fix = policy.advice if policy.advice is not None else \
        m.store.no_room_advice(m.key, need + margin, need + margin - free, usage.total, margin)
    raise InsufficientSpaceError(
        f"{m.location.display}: insufficient space at {where}: need {human_bytes(need)} plus a "
        f"{human_bytes(margin)} margin kept free, {human_bytes(free)} free; {fix}"
    )


def _manifest(m: _Model, fetched: list[FetchedFile]) -> Manifest:
    by_path = {f.path: f for f in m.files} if m.unpacked_from is None else {}
    files = []
    for ff in sorted(fetched, key=lambda f: f.path):
        remote = by_path.get(ff.path)
        checks = {c.algo: c.value for c in (remote.checksums if remote else ()) if c.algo in ff.verified}
        version = KEPT_AS_FOUND if ff.path in m.kept_as_found else (remote.version if remote else None)
        files.append(ManifestFile(path=ff.path, size=ff.size, xxh3=ff.xxh3, checksums=checks, version=version))
    assert m.source is not None
    return Manifest(
        storage_key=m.key,
        uri=m.location.display,
        resolved_uri=m.source.resolved_uri if m.source.resolved_revision else m.location.display,
        revision=m.source.resolved_revision,
        files=files,
        created_at=rfc3339(),
        # Kept on their size alone (adopted, no checksum): never compared with the source's bytes.
        # (A file kept as found is not: it is known to differ, and reported as changed.)
        unverified=sorted(f.path for f in m.adopted if not f.verified and f.path in {ff.path for ff in fetched}
                          and f.path not in m.kept_as_found),
    )


def list_source(source: Source, settings: Settings) -> list[RemoteFile]:
    """The files a pull of ``source`` fetches: its listing, filtered as KServe filters it."""
    location = source.location
    files = source.list_files()
    if source.applies_patterns:
        files = apply_patterns(files, settings)
    if not files:
        raise NotFoundError(f"{location.display}: no files to download (empty, or all filtered out by "
                            "STORAGE_ALLOW_PATTERNS / STORAGE_IGNORE_PATTERNS)")
    seen: set[str] = set()
    for f in files:
        if f.path in seen:
            raise ModelcacheError(f"{location.display}: the listing names '{f.path}' twice; rename one at the source")
        seen.add(f.path)
    return files


def _list(m: _Model, settings: Settings) -> None:
    if m.foreign:
        # A folder someone else filled that says which revision it holds is listed at that
        # revision: adopted as it is, never moved to the source's current one (adopt, AS_FOUND).
        revision = source_class(m.location.kind).revision_in(m.store.layout.model_dir(m.key))
        pinned = m.location.at_revision(revision) if revision else None
        if pinned is not None:
            try:
                m.source = open_source(pinned, settings)
                m.files = list_source(m.source, settings)
                m.pinned = revision
                return
            except NotFoundError as exc:
                log.info("%s: the revision in the folder (%s) is not at the source any more (%s); listing its "
                         "current one", m.location.display, revision, exc)
                if m.source is not None:
                    m.source.close()
    m.source = open_source(m.location, settings)
    m.files = list_source(m.source, settings)


def check_drift(uri: str, manifest: Manifest, settings: Settings | None = None) -> Drift:
    """List ``uri`` (no download) and compare the listing with the stored ``manifest``."""
    settings = settings if settings is not None else Settings.from_env()
    with open_source(parse_uri(uri), settings) as source:
        return compare(manifest, list_source(source, settings), source.resolved_revision)


def _carry_over(m: _Model, progress: ProgressTracker) -> None:
    """Files that still match the source are linked from the stored model into the staged
    download (same file system: no copy) and journaled as done, so the engine fetches only what
    changed and the new model is published whole, atomically, like any pull.

    A file is carried only once its bytes hash to the store's record of it (the linked inode is
    hashed, so what is checked is what is published): a stored file damaged since (same size,
    other bytes) is fetched again instead of being published under a manifest that vouches for it.
    """
    assert m.journal is not None
    data = m.store.staging(m.key).data
    model = m.store.layout.model_dir(m.key)
    carried = [(i, f, m.carry[f.path]) for i, f in enumerate(m.files) if f.path in m.carry]
    if carried:
        progress.set_waiting(f"{m.location.display}: checking {len(carried)} stored file(s) "
                             f"({human_bytes(sum(k.size for _, _, k in carried))}) against their digests")
    try:
        for i, f, kept in carried:
            dst = data / f.path
            dst.parent.mkdir(parents=True, exist_ok=True)
            dst.unlink(missing_ok=True)
            if regular_file_inside(model, f.path) is not None:
                try:
                    os.link(model / f.path, dst, follow_symlinks=False)
                except OSError:
                    shutil.copyfile(model / f.path, dst, follow_symlinks=False)
            if not file_matches(dst, kept):
                dst.unlink(missing_ok=True)
                m.resume.files.pop(i, None)
                for c in [c for c in m.resume.chunks if c[0] == i]:
                    del m.resume.chunks[c]
                m.refetched.append(f.path)
                continue
            verified = tuple(sorted(kept.checksums))
            m.resume.files[i] = (kept.xxh3, verified)
            m.journal.file_done(i, kept.xxh3, verified)
    finally:
        progress.set_waiting("")
    if m.refetched:
        log.warning("stored files no longer match their digests: fetching them again", extra={"fields": {
            "uri": m.location.display, "files": ",".join(m.refetched[:20]), "count": len(m.refetched)}})


def _finish(m: _Model, fetched: list[FetchedFile], cached: bool) -> PullResult:
    path = m.store.layout.model_dir(m.key)
    fetched = [*m.adopted, *fetched] if not cached else fetched
    complete = {f.path for f in fetched} == {f.path for f in m.files}
    if not cached and m.files and not complete and m.source is not None and not m.source.extracts_itself:
        missing = sorted({f.path for f in m.files} - {f.path for f in fetched})
        raise ModelcacheError(f"{m.location.display}: incomplete download, missing {missing[:3]}; pull again")
    if not cached and m.unpack:
        fetched = _unpack_single_archive(m, fetched)
    if not cached:
        assert m.source is not None
        staging = m.store.staging(m.key)
        m.source.before_publish(staging.dir)
        staging.data.mkdir(parents=True, exist_ok=True)  # all adopted: empty
        new = _manifest(m, fetched)
        if m.in_place:  # an adopted folder holds the model and nothing else (what the rest is, is kept)
            keep = {f.path for f in new.files} | set(m.unpacked_links)
            if m.unpacked_from:
                keep.add(m.unpacked_from)  # deleted below
            m.set_aside = m.store.set_aside_unlisted(m.key, keep)
        path = m.store.publish(m.key, new, in_place=m.in_place)
        if m.unpacked_from and m.unpacked_from not in {f.path for f in fetched}:
            # An archive kept from the folder, now unpacked: it is not part of the model.
            with contextlib.suppress(FileNotFoundError):
                (path / m.unpacked_from).unlink()
    manifest = m.store.manifest(m.key)
    total = manifest.total_size if manifest else sum(f.size for f in fetched)
    return PullResult(
        uri=m.location.display,
        storage_key=m.key,
        path=path,
        resolved_uri=manifest.resolved_uri if manifest else m.location.display,
        files=len(manifest.files) if manifest else len(fetched),
        bytes=total,
        cached=cached,
        # When this model was ready, not when the whole batch was (one pull of several URIs).
        elapsed=(max((f.finished for f in fetched), default=time.monotonic()) if fetched else time.monotonic())
        - m.started,
        verified=tuple(sorted({a for f in (manifest.files if manifest else []) for a in f.checksums})),
        refreshed=tuple(sorted({*m.drift.changed, *m.drift.added, *m.drift.unknown})) if m.drift and not cached else (),
        dropped=m.drift.removed if m.drift and not cached else (),
        adopted=len(m.adopted) if not cached else 0,
        adopted_bytes=sum(f.size for f in m.adopted) if not cached else 0,
        unpacked_from=m.unpacked_from,
        refetched=tuple(sorted(set(m.refetched))) if not cached else (),
        unverified=tuple(manifest.unverified) if manifest else (),
        set_aside=tuple(m.set_aside) if not cached else (),
        set_aside_to=str(m.store.unlisted_dir(m.key)) if m.set_aside and not cached else "",
        kept_as_found=tuple(sorted(m.kept_as_found)) if not cached else (),
        absent=m.absent if not cached else (),
        pinned_revision=m.pinned if not cached else None,
        drift=m.adoption_drift if not cached else None,
    )


def _unpack_single_archive(m: _Model, fetched: list[FetchedFile]) -> list[FetchedFile]:
    """KServe's rule for a model that is one archive (``.tar*``, ``.tgz``, ``.zip``): the model is
    its unpacked contents. Unpacked beside the staged download, which it then replaces; the
    manifest lists the unpacked files (what pods read, what checks and repairs compare)."""
    name = single_archive([f.path for f in fetched])
    if name is None:
        return fetched
    staging = m.store.staging(m.key)
    archive = staging.data / name
    if not archive.is_file():  # kept from the model folder (adopted): unpacked from there
        archive = m.store.layout.model_dir(m.key) / name
    out = staging.unpack_dir()
    limits = ArchiveLimits.from_env(m.source.settings.env if m.source is not None else {})
    result = unpack_archive(archive, out, limits, remove_archive=False)
    # From here the staged archive is gone: without its plan, a crash restarts the download
    # rather than resuming an archive that is no longer there.
    data = staging.replace_data(out, resumable=False)
    # The unpacker streams files without fsync: durable before the manifest that vouches for them.
    fsync_tree(data, result.paths)
    m.unpacked_from = name
    m.adopted, m.skip = [], set()  # the archive is not part of the model any more
    files = []
    for rel in sorted(result.paths):
        p = data / rel
        if p.is_symlink():
            m.unpacked_links.append(rel)  # links stay in the folder, but a manifest lists files
            continue
        if not p.is_file():
            continue
        size = p.stat().st_size
        files.append(FetchedFile(rel, size, hash_file(p, size=size).local_hexdigest(), ()))
    log.info("%s: unpacked %s (%s)", m.location.display, name, plural(len(files), "file"))
    return _compare_unpacked(m, files) if m.compare_unpacked else files


def _compare_unpacked(m: _Model, unpacked: list[FetchedFile]) -> list[FetchedFile]:
    """AS_FOUND of a folder another tool unpacked from the archive: each of its files is held
    against the archive's (hashed on disk). The same bytes are kept as verified by the archive;
    others are kept as found and reported as drift, as are the archive's files the folder lacks.
    The staged tree is dropped: nothing is merged into the folder pods read."""
    folder = m.store.layout.model_dir(m.key)
    kept: list[FetchedFile] = []
    absent: list[str] = []
    for f in unpacked:
        have = adopt.as_found(folder, f.path)
        if have is None:
            absent.append(f.path)
            continue
        if (have.size, have.xxh3) != (f.size, f.xxh3):
            m.kept_as_found.add(f.path)
        kept.append(have)
    m.store.staging(m.key).empty_data()
    if not kept:
        raise ModelcacheError(f"{m.location.display}: the folder {folder} holds none of the {len(unpacked)} files of "
                              f"{m.unpacked_from}; it is not this model's")
    m.absent = tuple(sorted(absent))
    if m.kept_as_found or m.absent:
        changed = tuple(sorted(m.kept_as_found))
        parts = [f"{len(changed)} differ from {m.unpacked_from} ({', '.join(changed[:3])})" if changed else "",
                 f"{len(absent)} of {m.unpacked_from} missing ({', '.join(m.absent[:3])})" if absent else ""]
        m.adoption_drift = Drift(storage_key=m.key, uri=m.location.display, state=CHANGED, changed=changed,
                                 added=m.absent, message="kept as found: " + "; ".join(p for p in parts if p))
    return kept


def _still_archive(m: _Model) -> bool:
    """A present model whose manifest lists one archive, where models are stored unpacked."""
    if not m.unpack:
        return False
    manifest = m.store.manifest(m.key)
    return manifest is not None and single_archive([f.path for f in manifest.files]) is not None


#: Seconds between the "verifying" progress lines of a long adoption (hashing a big folder).
ADOPT_PROGRESS_EVERY = 10.0


def _adopt(m: _Model) -> None:
    """A folder already there without our manifest (a KServe node agent's, a finished init
    container's): keep what matches the listing, and for the rest follow ``m.adoption``
    (modelcache.adopt: fetch it, or keep it as found and report the drift); install in place."""
    if not m.foreign:
        return
    m.in_place = True
    if m.source is not None and m.source.extracts_itself:
        return  # layers, not files: extracted again and merged into the folder
    folder = m.store.layout.model_dir(m.key)
    as_found = m.adoption == adopt.AS_FOUND and m.pinned is None
    listed = list(m.files)
    total = sum(f.size or 0 for f in listed)
    state = {"done": 0, "last": time.monotonic()}

    def on_file(path: str, size: int) -> None:
        state["done"] += size
        now = time.monotonic()
        if now - state["last"] >= ADOPT_PROGRESS_EVERY:
            state["last"] = now
            log.info("%s: verifying the folder in place: %s of %s hashed", m.location.display,
                     human_bytes(state["done"]), human_bytes(total))

    if as_found and m.unpack and single_archive([f.path for f in listed]) is not None:
        # The other tool unpacked the archive and deleted it (KServe does): only the archive can
        # tell whether the files are its own, so it is fetched (its checksum verified), unpacked
        # beside the folder and compared with it file by file (_compare_unpacked); nothing is merged.
        as_found, m.compare_unpacked = False, True
    found = adopt.check(folder, m.files, on_file, keep_differing=as_found)
    kept = [*found.kept, *(f for _i, f in found.differ)]
    fetch = [m.files[i] for i in found.fetch]
    if as_found:
        # Reported complete: what is missing was added at the source since (or never part of what
        # the other tool fetched); only empty files are created, nothing else is fetched.
        m.absent = tuple(f.path for f in fetch if (f.size or 0) > 0)
        m.kept_as_found = {f.path for _i, f in found.differ}
        if not kept:
            raise ModelcacheError(f"{m.location.display}: the folder {folder} holds none of the {len(listed)} "
                                  "files the source lists; it is not this model's")
        absent = set(m.absent)
        m.files = [f for f in m.files if f.path not in absent]
        fetch = [f for f in fetch if f.path not in absent]
        if m.absent or m.kept_as_found:
            assert m.source is not None
            stored = Manifest(storage_key=m.key, uri=m.location.display, resolved_uri=m.location.display,
                              revision=None, created_at="", files=[
                                  ManifestFile(f.path, f.size, f.xxh3, version=KEPT_AS_FOUND
                                               if f.path in m.kept_as_found else None) for f in kept])
            fetched = {f.path for f in fetch}  # (empty files: fetched now, so current)
            m.adoption_drift = compare(stored, [f for f in listed if f.path not in fetched],
                                       m.source.resolved_revision)
    kept_paths = {f.path for f in kept}
    m.adopted = kept
    m.skip = {i for i, f in enumerate(m.files) if f.path in kept_paths}
    if found.size_only:
        log.warning("adopted files kept on their size alone: the source gives no checksum", extra={"fields": {
            "uri": m.location.display, "files": found.size_only}})
    log.info("adopting a model folder that has no manifest", extra={"fields": {
        "uri": m.location.display, "folder": str(folder), "files": len(listed), "kept": len(found.kept),
        "kept_bytes": found.kept_bytes, "size_only": found.size_only, "fetch": len(fetch),
        "fetch_files": ",".join(f.path for f in fetch[:20]), "policy": m.adoption, "revision": m.pinned or "",
        "kept_as_found": ",".join(sorted(m.kept_as_found)[:20]), "absent": ",".join(m.absent[:20])}})


def _extract(m: _Model, progress: ProgressTracker, cancel: threading.Event | None = None) -> list[FetchedFile] | None:
    """Sources whose layout is not file-per-object (OCI modelcar) write the tree themselves;
    ``cancel`` stops them at their next block read (the engine's own watcher does not see them)."""
    assert m.source is not None
    if not m.source.extracts_itself:
        return None

    staging = m.store.staging(m.key)
    # Extract beside the staged files: a source may decline (None, e.g. an OCI artifact rather
    # than a modelcar image), and then a resumable staged download must survive.
    fresh = staging.extract_dir()
    fresh.mkdir(parents=True)
    counted = False

    def on_bytes(n: int) -> None:
        nonlocal counted
        _check_cancel(cancel, m)
        if not counted:  # totals only once the source really extracts (else the engine counts)
            counted = True
            progress.add_total(sum(f.size or 0 for f in m.files), len(m.files))
        progress.advance("", n)

    try:
        paths = m.source.extract_into(str(fresh), on_bytes)
    except BaseException:
        shutil.rmtree(fresh, ignore_errors=True)  # no resume for extracted layouts: no leftovers
        raise
    if paths is None:
        shutil.rmtree(fresh)
        return None
    data = staging.replace_data(fresh)
    fsync_tree(data, paths)  # durable before the manifest that says the model is present
    out = []
    for rel in paths:
        p = data / rel
        size = p.stat().st_size
        out.append(FetchedFile(rel, size, hash_file(p, size=size).local_hexdigest(), ()))
    return out


def _settle_failure(m: _Model) -> None:
    """A failed model keeps what it staged, with the reason beside it; a cancelled one keeps it
    for a resume. A staged download that holds nothing a resume could use goes (caller holds the
    lock)."""
    if m.journal is None or not m.store.staging(m.key).exists():
        return
    if isinstance(m.error, CancelledError):
        # Interrupted with nothing a resume can use: every file from a server that ignores Range
        # (read again from byte 0) and none finished. Keeping it only made `ls` promise a resume
        # that never came ("interrupted 0%", the rerun at 1.9%).
        state = m.journal.load()
        if m.transferred and m.files and not any(f.ranged for f in m.files) and not state.files:
            m.journal.close()
            m.store.drop_staging(m.key)
        return
    # Staged afresh and refused before its transfer began (no space, the admission), or its bytes
    # refused by their checksum (a wrong #sha256= pin, a corrupt object): nothing worth resuming
    # from is staged. (What an earlier, interrupted pull staged stays for the next one.)
    if (m.fresh and not m.transferred) or isinstance(m.error, IntegrityError):
        m.journal.close()
        m.store.drop_staging(m.key)
        return
    reason = getattr(m.error, "reason", None) or type(m.error).__name__
    m.store.record_failure(m.key, reason, " ".join(str(m.error).split()).removeprefix(f"{m.location.display}: "))


def _check_cancel(cancel: threading.Event | None, m: _Model) -> None:
    if cancel is not None and cancel.is_set():
        raise CancelledError(f"{m.location.display}: download cancelled (staged data kept for a resume)")


@contextlib.contextmanager
def _locked(models: Sequence[_Model], progress: ProgressTracker, cancel: threading.Event | None = None
            ) -> Iterator[None]:
    with contextlib.ExitStack() as stack:
        for m in sorted(models, key=lambda m: str(m.store.layout.lock_path(m.key))):  # one order: no deadlock
            # A pull that waits says for whom (an empty progress line looks like a hang).
            stack.enter_context(m.store.lock(m.key, cancel=cancel,
                                             on_wait=functools.partial(_waiting, progress, m)))
        progress.set_waiting("")
        yield


def _waiting(progress: ProgressTracker, m: _Model, why: str) -> None:
    progress.set_waiting(f"{m.location.display}: {why}")
    log.info("%s: %s", m.location.display, why)


def staged_pulls(store: NodeStore) -> list[StagedPull]:
    """Every staged download of a node store, with the bytes its journal says are on disk."""
    return store.staged()


def pull_many(
    uris: Sequence[str],
    *,
    root: str | os.PathLike[str] | None = None,
    dest: str | os.PathLike[str] | None = None,
    settings: Settings | None = None,
    options: TransferOptions | None = None,
    progress: ProgressTracker | None = None,
    admit: Callable[[PullPlan], None] | None = None,
    cancel: threading.Event | None = None,
    guard: Guard | None = None,
    refresh: bool = False,
    only: Collection[str] | None = None,
    unpack: bool | None = None,
    peers: PeerNetwork | None = None,
    space: SpacePolicy | None = None,
    adoption: str = adopt.COMPLETE,
) -> list[PullResult | ModelcacheError | BaseException]:
    """Pull several models with one worker pool; one result or error per URI, in order.

    ``only``: fetch just these files of the listing (an in-place repair's damaged files; ``admit``
    still sees the whole listing). ``refresh``: a stored model is listed again and, if its source
    changed, brought up to date:
    only the files that differ are fetched, the rest carried over, and the new model replaces
    the old one whole (staged, verified, then published like any pull).

    ``admit`` is called once per model after its listing and before any byte is written, with
    what the download needs; it may raise (e.g. InsufficientSpaceError from the agent's
    reservations against a node group's storage limit) to refuse that model. Setting
    ``cancel`` stops the pull wherever it is (waiting for another process's lock, between
    steps, transferring, extracting an image) with CancelledError; staged data is kept for a
    later resume. ``guard`` may refuse to replace a model folder that is there but not complete
    (the CLI's mount check). ``unpack`` (default: in a store root, not in a destination
    folder, where the initializer does it) stores a model that is one archive as its unpacked
    contents, as KServe's download Job does.

    A model folder that is there without our manifest (KServe's node agent filled it) is
    adopted: files that match the listing are kept; ``adoption`` says what happens to the others
    (``adopt.COMPLETE``: fetched; ``adopt.AS_FOUND``, for a folder reported complete: kept as they
    are and reported as drift), and a folder that says which revision it holds is listed at it.
    ``peers`` (the agent's) lets other nodes' agents serve pieces of the models and this node
    serve what it fetched (``modelcache.peers``); files are verified exactly as without. Not for
    a model adopted in place or unpacked from one archive: their pieces would not be the bytes
    published. ``space``: the margin kept free and what a refusal advises (``SpacePolicy``).

    A model that fails keeps what it staged, with the failure recorded beside it (``ls`` shows
    it failed, with the reason); one that failed before staging a byte leaves nothing behind.
    """
    space = space or SpacePolicy()
    options = (options or TransferOptions()).normalized()
    if peers is not None:
        # With peers the engine's chunks are pieces: each worker waits on (or reads) one piece,
        # so a piece another node reads from the origin never holds up the next one of a chunk.
        from modelcache.peers.pieces import piece_size_for

        options = dataclasses.replace(options, chunk_size=piece_size_for(options.chunk_size)).normalized()
    progress = progress or ProgressTracker()
    rootp = Path(root) if root is not None else None
    destp = Path(dest) if dest is not None else None
    models: dict[str, _Model] = {}
    order: list[str | BaseException] = []
    # Every URI is parsed before the environment's credentials are read or a connection made:
    # an invalid one is refused at once, never after a wait on an endpoint.
    for uri in uris:
        try:
            loc = parse_uri(uri)
            store = _store_for(loc, rootp, destp, guard)
        except ModelcacheError as exc:
            order.append(exc)
            continue
        models.setdefault(loc.storage_key, _Model(loc, store, loc.storage_key,
                                                  unpack=unpack if unpack is not None else rootp is not None,
                                                  adoption=adoption))
        order.append(loc.storage_key)
    if destp is not None and len(models) > 1:
        raise ModelcacheError("a destination folder holds one model: pull several URIs into a store root")
    if not models:
        return [item for item in order if isinstance(item, BaseException)]
    settings = settings if settings is not None else Settings.from_env()
    if peers is not None and not settings.forgery_proof:
        # Pieces from other nodes are settled by each file's checksum: one no peer can forge.
        settings = dataclasses.replace(settings, forgery_proof=True)

    # Present models are answered without the lock: publish installs the manifest last, so a
    # present model is complete, and a read-only store (a pod's mount) can still be asked.
    for m in models.values():
        if m.store.is_present(m.key) and not refresh and not _still_archive(m):
            m.store.touch(m.key)
            m.result = _finish(m, [], cached=True)
    try:
        with _locked([m for m in models.values() if m.result is None], progress, cancel):
            jobs: list[FileJob] = []
            for m in models.values():
                if m.result is not None:
                    continue
                try:
                    m.store.recover(m.key)
                    present = m.store.is_present(m.key)
                    # Stored as the archive itself (before archives were unpacked): its bytes are
                    # carried over like a refresh's (checked against the manifest) and unpacked.
                    archive = present and _still_archive(m)
                    if present and not refresh and not archive:
                        m.store.touch(m.key)
                        m.result = _finish(m, [], cached=True)
                        continue
                    _check_cancel(cancel, m)
                    # A folder someone else filled (adopt.applies: the store has no record of it).
                    m.foreign = not present and adopt.applies(m.store, m.key)
                    _list(m, settings)
                    assert m.source is not None
                    if only is not None and not m.source.extracts_itself:
                        m.listed = _listing(m)
                        m.files = [f for f in m.files if f.path in only]
                    if present or (m.store.knew(m.key) and os.path.lexists(m.store.layout.model_dir(m.key))):
                        # A refresh, or a folder the store knew that is not present (damaged, its
                        # manifest broken, a publish or repair interrupted): never adopted like a
                        # folder someone else filled. Files the source still lists as they were
                        # are kept once they hash to the store's record; every other one, and every
                        # one known damaged, is fetched; the folder is then replaced whole.
                        stored = m.store.manifest(m.key) if present else m.store.record(m.key)
                        if stored is not None:
                            m.drift = compare(stored, m.files, m.source.resolved_revision)
                            if present and not archive and m.drift.state == CURRENT:
                                m.store.touch(m.key)
                                m.result = _finish(m, [], cached=True)
                                continue
                            damage = m.store.damage(m.key)
                            bad = set(damage.files) if damage else set()
                            by_path = {f.path: f for f in stored.files}
                            m.carry = {p: by_path[p] for p in m.drift.keep if p not in bad}
                            m.refetched = sorted(bad & {f.path for f in m.files})
                    else:
                        _adopt(m)
                    if not m.in_place:  # (adoption keeps the folder: it only adds files to it)
                        m.store.check_replaceable(m.key)  # before the download, not after it
                    if admit is not None and m.source.extracts_itself:
                        # Extracted layouts write before the engine path would ask: admit their
                        # whole size first (they do not resume, so all of it is needed).
                        total = sum(f.size or 0 for f in m.files)
                        admit(PullPlan(m.location, m.key, total, total, len(m.files), m.source.resolved_revision,
                                       _listing(m)))
                        admitted = True
                    else:
                        admitted = False
                    _check_cancel(cancel, m)
                    extracted = _extract(m, progress, cancel)
                    if extracted is not None:
                        m.result = _finish(m, extracted, cached=False)
                        continue
                    _prepare_staging(m, options.chunk_size)
                    if m.carry:
                        _carry_over(m, progress)
                    if not any(i not in m.skip for i in range(len(m.files))):
                        m.result = _finish(m, [], cached=False)  # every file adopted: nothing to fetch
                        continue
                    if admit is not None and not admitted:
                        admit(PullPlan(m.location, m.key, sum(f.size or 0 for f in m.files), bytes_needed(m),
                                       len(m.files), m.source.resolved_revision, _listing(m)))
                    _check_space(m, space)
                    data = m.store.staging(m.key).data
                    assert m.journal is not None
                    if peers is not None and not m.in_place and not (
                            m.unpack and single_archive([f.path for f in m.files]) is not None):
                        assert isinstance(m.store, NodeStore)  # (the agent's pulls: into its node root)
                        m.source = peers.attach(m.key, m.source, m.files, m.store.staging(m.key), m.journal,
                                                options.chunk_size,
                                                m.resume, options.max_workers or options.workers,
                                                options.stall_timeout)
                    m.transferred = True
                    for i, f in enumerate(m.files):
                        if i in m.skip:
                            continue
                        jobs.append(FileJob(m.source, f, str(data / f.path), m.journal, i, m.key, m.resume))
                except BaseException as exc:
                    m.error = _name_uri(exc, m.location.display)  # every error names its model
            if jobs:
                engine = TransferEngine(options, progress)
                watcher = _cancel_watcher(cancel, engine)
                try:
                    results, errors = engine.run(jobs)
                finally:
                    if watcher is not None:
                        watcher.set()
                for key, failed in errors.items():
                    models[key].error = _name_uri(failed, models[key].location.display)
                for key, fetched in results.items():
                    m = models[key]
                    if m.error is None:
                        try:
                            m.result = dataclasses.replace(_finish(m, fetched, cached=False),
                                                           transfer_seconds=engine.transfer_seconds(key))
                        except BaseException as exc:  # e.g. no space for the manifest: name the URI
                            m.error = _name_uri(exc, m.location.display)
            for m in models.values():
                if m.error is not None and m.result is None:
                    _settle_failure(m)
    finally:
        for m in models.values():
            if m.journal is not None:
                m.journal.close()
            if m.source is not None:
                m.source.close()

    out: list[PullResult | ModelcacheError | BaseException] = []
    for item in order:
        if isinstance(item, BaseException):
            out.append(item)
            continue
        m = models[item]
        out.append(m.result if m.result is not None else (m.error or ModelcacheError(f"{m.location.display}: failed")))
    return out


def _cancel_watcher(cancel: threading.Event | None, engine: TransferEngine) -> threading.Event | None:
    if cancel is None:
        return None
    done = threading.Event()
    if cancel.is_set():
        engine.cancel()
        return done

    def watch() -> None:
        while not done.wait(0.2):
            if cancel.is_set():
                engine.cancel()
                return

    threading.Thread(target=watch, name="modelcache-cancel", daemon=True).start()
    return done


def pull(
    uri: str,
    *,
    root: str | os.PathLike[str] | None = None,
    dest: str | os.PathLike[str] | None = None,
    settings: Settings | None = None,
    options: TransferOptions | None = None,
    progress: ProgressTracker | None = None,
    admit: Callable[[PullPlan], None] | None = None,
    cancel: threading.Event | None = None,
    guard: Guard | None = None,
    refresh: bool = False,
    only: Collection[str] | None = None,
    unpack: bool | None = None,
    peers: PeerNetwork | None = None,
    space: SpacePolicy | None = None,
    adoption: str = adopt.COMPLETE,
) -> PullResult:
    """Pull one model; raises its error."""
    (result,) = pull_many([uri], root=root, dest=dest, settings=settings, options=options, progress=progress,
                          admit=admit, cancel=cancel, guard=guard, refresh=refresh, only=only, unpack=unpack,
                          peers=peers, space=space, adoption=adoption)
    if isinstance(result, BaseException):
        raise result
    return result
