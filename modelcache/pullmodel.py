"""One model of a pull: its state (``ModelPull``) and the work on its files that is not the
engine's: carrying stored files over, adopting a folder someone else filled, extracting a layout
that extracts itself, unpacking a model that is one archive, and publishing (``finish``).

``modelcache.pull`` runs these as steps of its pipeline; the staging folder is reached only
through ``modelcache.store.Staging``.
"""

from __future__ import annotations

import contextlib
import logging
import os
import shutil
import threading
import time
from dataclasses import dataclass, field
from pathlib import Path

from modelcache import adopt
from modelcache.drift import CHANGED, KEPT_AS_FOUND, Drift, compare
from modelcache.engine.transfer import FetchedFile
from modelcache.errors import CancelledError, IntegrityError, ModelcacheError
from modelcache.runtime.clock import rfc3339
from modelcache.runtime.progress import ProgressTracker, human_bytes, plural
from modelcache.sources.archive import ArchiveLimits, single_archive, unpack_archive
from modelcache.sources.base import RemoteFile, Source
from modelcache.sources.integrity import hash_file
from modelcache.sources.uri import Location
from modelcache.store import Manifest, ManifestFile, Store, file_matches, regular_file_inside
from modelcache.store.diskio import fsync_tree
from modelcache.store.journal import Journal, JournalState

#: The pull's log lines keep the pull's name, wherever in it they are written.
log = logging.getLogger("modelcache.pull")


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



@dataclass
class ModelPull:
    location: Location
    store: Store
    key: str
    source: Source | None = None
    files: list[RemoteFile] = field(default_factory=list)
    journal: Journal | None = None
    resume: JournalState = field(default_factory=JournalState)
    result: PullResult | None = None
    error: Exception | None = None
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
    #: What the pipeline learnt on the way (modelcache.pull): the model was present when its lock
    #: was taken; it is stored as the archive itself; the caller's ``admit`` has seen it.
    present: bool = False
    archive: bool = False
    admitted: bool = False



def _manifest(m: ModelPull, fetched: list[FetchedFile]) -> Manifest:
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



def carry_over(m: ModelPull, progress: ProgressTracker) -> None:
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


def finish(m: ModelPull, fetched: list[FetchedFile], cached: bool) -> PullResult:
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


def _unpack_single_archive(m: ModelPull, fetched: list[FetchedFile]) -> list[FetchedFile]:
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


def _compare_unpacked(m: ModelPull, unpacked: list[FetchedFile]) -> list[FetchedFile]:
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


def still_archive(m: ModelPull) -> bool:
    """A present model whose manifest lists one archive, where models are stored unpacked."""
    if not m.unpack:
        return False
    manifest = m.store.manifest(m.key)
    return manifest is not None and single_archive([f.path for f in manifest.files]) is not None


#: Seconds between the "verifying" progress lines of a long adoption (hashing a big folder).
ADOPT_PROGRESS_EVERY = 10.0


def adopt_folder(m: ModelPull) -> None:
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


def extract(m: ModelPull, progress: ProgressTracker, cancel: threading.Event | None = None) -> list[FetchedFile] | None:
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
        check_cancel(cancel, m)
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


def settle_failure(m: ModelPull) -> None:
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


def check_cancel(cancel: threading.Event | None, m: ModelPull) -> None:
    if cancel is not None and cancel.is_set():
        raise CancelledError(f"{m.location.display}: download cancelled (staged data kept for a resume)")


