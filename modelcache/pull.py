"""The one path every caller takes: URI -> source listing -> transfer engine -> node store.

The CLI, the initializer and the agent are thin callers of ``pull`` / ``pull_many``. A pull
takes the model's lock (a second pull of the same model waits, then finds it present), returns
at once for a model already present, resumes a staged download whose listing is unchanged,
checks free space before writing a byte, and publishes atomically.

``pull_many`` is a pipeline: one ``PullRequest`` (where, how, the caller's hooks), and for each
model (``modelcache.pullmodel.ModelPull``) the steps of ``STEPS`` in order, each of which may
answer the model (a result) and end its pipeline; the files of every model that got through go
to one transfer engine, then each is published. A model's error is its own (``Exception``);
``KeyboardInterrupt`` and ``SystemExit`` end the whole pull at once, its staged data kept.
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
from collections.abc import Callable, Collection, Iterator, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any

from modelcache import adopt
from modelcache.drift import CURRENT, Drift, compare
from modelcache.engine.transfer import FileJob, TransferEngine, TransferOptions
from modelcache.errors import InsufficientSpaceError, ModelcacheError, NotFoundError
from modelcache.pullmodel import (
    ModelPull,
    PullResult,
    adopt_folder,
    carry_over,
    check_cancel,
    extract,
    finish,
    settle_failure,
    still_archive,
)
from modelcache.runtime.progress import ProgressTracker, human_bytes
from modelcache.sources.archive import single_archive
from modelcache.sources.base import RemoteFile, Source, open_source, source_class
from modelcache.sources.credentials import Settings
from modelcache.sources.uri import Location, parse_uri
from modelcache.store import DestStore, Guard, Manifest, NodeStore, StagedPull, Store

if TYPE_CHECKING:
    from modelcache.peers.network import PeerNetwork

__all__ = ["SPACE_MARGIN", "PullPlan", "PullRequest", "PullResult", "SpacePolicy", "apply_patterns", "bytes_needed",
           "check_drift", "list_source", "pull", "pull_many", "staged_pulls"]

log = logging.getLogger(__name__)

#: Kept free on the store's file system beyond the model itself: the default of the CLI's and the
#: init container's ``--space-margin`` (``MODELCACHE_SPACE_MARGIN``). The agent passes its own
#: ``--space-margin`` (256 MiB by default), which is then the only margin its pulls keep.
SPACE_MARGIN = 64 << 20

#: (The model state's old name, for code that still says it.)
_Model = ModelPull


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


@dataclass(frozen=True)
class SpacePolicy:
    """What a pull keeps free on the store's file system, and what its refusal advises.

    ``advice``: the fix to name when the model does not fit (the agent's: its root holds what
    its spec lists, so a gc there would only evict models it downloads again). None: the CLI's,
    a gc when evicting models made here can make the room, else what can."""

    margin: int = SPACE_MARGIN
    advice: str | None = None


def _check_space(m: ModelPull, policy: SpacePolicy) -> None:
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


@dataclass(frozen=True)
class PullRequest:
    """Everything a pull is asked besides its URIs, given once (``pull_many(uris, request)``).

    Where: ``root`` (a node store) or ``dest`` (a destination folder), exactly one.

    How: ``settings`` (from the environment by default), ``options`` (the engine's); ``refresh``:
    a stored model is listed again and, if its source changed, brought up to date (only the
    files that differ are fetched, the rest carried over, the new model replaces the old one
    whole); ``only``: fetch just these files of the listing (an in-place repair's damaged
    files; ``admit`` still sees the whole listing); ``unpack`` (default: in a store root, not in
    a destination folder, where the initializer does it) stores a model that is one archive as
    its unpacked contents, as KServe's download Job does; ``adoption``: what happens to the
    files of a folder someone else filled that differ from the listing (``adopt.COMPLETE``:
    fetched; ``adopt.AS_FOUND``, for a folder reported complete: kept and reported as drift);
    ``space``: the margin kept free and what a refusal advises (``SpacePolicy``); ``peers``
    (the agent's): other nodes' agents serve pieces and this node serves what it fetched
    (``modelcache.peers``), files verified exactly as without; not for a model adopted in place
    or unpacked from one archive, whose pieces would not be the bytes published.

    Hooks: ``progress``; ``admit``, called once per model after its listing and before any byte
    is written, with what the download needs (it may raise, e.g. InsufficientSpaceError from the
    agent's reservations, to refuse that model); ``cancel``, which stops the pull wherever it is
    (waiting for another process's lock, between steps, transferring, extracting an image) with
    CancelledError, staged data kept for a resume; ``guard``, which may refuse to replace a
    model folder that is there but not complete (the CLI's mount check).
    """

    root: str | os.PathLike[str] | None = None
    dest: str | os.PathLike[str] | None = None
    settings: Settings | None = None
    options: TransferOptions | None = None
    refresh: bool = False
    only: Collection[str] | None = None
    unpack: bool | None = None
    adoption: str = adopt.COMPLETE
    space: SpacePolicy | None = None
    peers: PeerNetwork | None = None
    progress: ProgressTracker | None = None
    admit: Callable[[PullPlan], None] | None = None
    cancel: threading.Event | None = None
    guard: Guard | None = None


def _request(request: PullRequest | None, fields: dict[str, Any]) -> PullRequest:
    """The request, with any field given by name (callers that name them: the CLI, tests)."""
    request = request if request is not None else PullRequest()
    return dataclasses.replace(request, **fields) if fields else request


@dataclass
class _Run:
    """One ``pull_many``: the request with its defaults filled in, and its models by storage key."""

    request: PullRequest
    settings: Settings
    options: TransferOptions
    progress: ProgressTracker
    space: SpacePolicy
    models: dict[str, ModelPull]


def _store_for(root: Path | None, dest: Path | None, guard: Guard | None) -> Store:
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


def _name_uri(exc: Exception, display: str) -> Exception:
    """Engine errors name the file; the user also needs to know which model it belongs to."""
    if isinstance(exc, ModelcacheError) and display not in str(exc):
        exc.args = (f"{display}: {exc}",)
    return exc


def _plan_doc(m: ModelPull, chunk_size: int) -> dict[str, object]:
    return {
        "storage_key": m.key,
        "uri": m.location.display,  # redacted; for `modelcache ls` while the pull is staged
        "resolved_uri": m.source.resolved_uri if m.source else "",
        "chunk_size": chunk_size,
        "files": [[f.path, f.size, f.version] for f in m.files],
    }


def _prepare_staging(m: ModelPull, chunk_size: int) -> None:
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


def bytes_needed(m: ModelPull) -> int:
    """Bytes the download still has to allocate (preallocated staged files already hold theirs)."""
    return m.store.staging(m.key).bytes_needed([(f.path, f.size) for f in m.files], m.skip)


def _listing(m: ModelPull) -> tuple[tuple[str, int | None], ...]:
    return m.listed or tuple((f.path, f.size) for f in m.files)


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


def _list(m: ModelPull, settings: Settings) -> None:
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


@contextlib.contextmanager
def _locked(models: Sequence[ModelPull], progress: ProgressTracker, cancel: threading.Event | None = None
            ) -> Iterator[None]:
    with contextlib.ExitStack() as stack:
        for m in sorted(models, key=lambda m: str(m.store.layout.lock_path(m.key))):  # one order: no deadlock
            # A pull that waits says for whom (an empty progress line looks like a hang).
            stack.enter_context(m.store.lock(m.key, cancel=cancel,
                                             on_wait=functools.partial(_waiting, progress, m)))
        progress.set_waiting("")
        yield


def _waiting(progress: ProgressTracker, m: ModelPull, why: str) -> None:
    progress.set_waiting(f"{m.location.display}: {why}")
    log.info("%s: %s", m.location.display, why)


def staged_pulls(store: NodeStore) -> list[StagedPull]:
    """Every staged download of a node store, with the bytes its journal says are on disk."""
    return store.staged()


# ---- the steps of one model's pipeline (in ``STEPS`` order; the model's lock is held) ----------


def _recover(run: _Run, m: ModelPull) -> None:
    """Finish or undo a publish a crash interrupted; answer a model present by now."""
    m.store.recover(m.key)
    m.present = m.store.is_present(m.key)
    # Stored as the archive itself (before archives were unpacked): its bytes are carried over
    # like a refresh's (checked against the manifest) and unpacked.
    m.archive = m.present and still_archive(m)
    if m.present and not run.request.refresh and not m.archive:
        _answer_cached(m)


def _list_model(run: _Run, m: ModelPull) -> None:
    """List the source (a folder someone else filled: at the revision it holds), then ``only``."""
    check_cancel(run.request.cancel, m)
    # A folder someone else filled (adopt.applies: the store has no record of it).
    m.foreign = not m.present and adopt.applies(m.store, m.key)
    _list(m, run.settings)
    assert m.source is not None
    only = run.request.only
    if only is not None and not m.source.extracts_itself:
        m.listed = _listing(m)
        m.files = [f for f in m.files if f.path in only]


def _compare_with_stored(run: _Run, m: ModelPull) -> None:
    """A refresh, or a folder the store knew that is not present (damaged, its manifest broken, a
    publish or repair interrupted): never adopted like a folder someone else filled. Files the
    source still lists as they were are kept once they hash to the store's record; every other
    one, and every one known damaged, is fetched; the folder is then replaced whole. Anything
    else there is a folder someone else filled: adopted (``adopt_folder``)."""
    assert m.source is not None
    if not (m.present or (m.store.knew(m.key) and os.path.lexists(m.store.layout.model_dir(m.key)))):
        adopt_folder(m)
        return
    stored = m.store.manifest(m.key) if m.present else m.store.record(m.key)
    if stored is None:
        return
    m.drift = compare(stored, m.files, m.source.resolved_revision)
    if m.present and not m.archive and m.drift.state == CURRENT:
        _answer_cached(m)
        return
    damage = m.store.damage(m.key)
    bad = set(damage.files) if damage else set()
    by_path = {f.path: f for f in stored.files}
    m.carry = {p: by_path[p] for p in m.drift.keep if p not in bad}
    m.refetched = sorted(bad & {f.path for f in m.files})


def _guard(run: _Run, m: ModelPull) -> None:
    """The guard may refuse to replace the folder: asked before the download, not after it.
    (Adoption keeps the folder: it only adds files to it.)"""
    if not m.in_place:
        m.store.check_replaceable(m.key)


def _admit_extracted(run: _Run, m: ModelPull) -> None:
    """Extracted layouts write before the engine path would ask: their whole size is admitted
    first (they do not resume, so all of it is needed)."""
    assert m.source is not None
    if run.request.admit is not None and m.source.extracts_itself:
        total = sum(f.size or 0 for f in m.files)
        run.request.admit(PullPlan(m.location, m.key, total, total, len(m.files), m.source.resolved_revision,
                                   _listing(m)))
        m.admitted = True


def _extract(run: _Run, m: ModelPull) -> None:
    """A layout that extracts itself (OCI modelcar) is written, and published, here."""
    check_cancel(run.request.cancel, m)
    extracted = extract(m, run.progress, run.request.cancel)
    if extracted is not None:
        m.result = finish(m, extracted, cached=False)


def _stage(run: _Run, m: ModelPull) -> None:
    """Stage the download (resumed where the plan is the same), carry stored files over; a model
    whose every file was adopted is published at once."""
    _prepare_staging(m, run.options.chunk_size)
    if m.carry:
        carry_over(m, run.progress)
    if not any(i not in m.skip for i in range(len(m.files))):
        m.result = finish(m, [], cached=False)  # every file adopted: nothing to fetch


def _admit(run: _Run, m: ModelPull) -> None:
    assert m.source is not None
    if run.request.admit is not None and not m.admitted:
        run.request.admit(PullPlan(m.location, m.key, sum(f.size or 0 for f in m.files), bytes_needed(m),
                                   len(m.files), m.source.resolved_revision, _listing(m)))


def _space(run: _Run, m: ModelPull) -> None:
    _check_space(m, run.space)


def _attach_peers(run: _Run, m: ModelPull) -> None:
    """With peers, the model's source reads pieces other nodes hold (not for a model adopted in
    place or unpacked from one archive: their pieces would not be the bytes published)."""
    peers = run.request.peers
    assert m.source is not None and m.journal is not None
    if peers is None or m.in_place or (m.unpack and single_archive([f.path for f in m.files]) is not None):
        return
    assert isinstance(m.store, NodeStore)  # (the agent's pulls: into its node root)
    options = run.options
    m.source = peers.attach(m.key, m.source, m.files, m.store.staging(m.key), m.journal, options.chunk_size,
                            m.resume, options.max_workers or options.workers, options.stall_timeout)


#: One model's pipeline, in order; a step that answers the model (``m.result``) ends it.
STEPS: tuple[Callable[[_Run, ModelPull], None], ...] = (
    _recover, _list_model, _compare_with_stored, _guard, _admit_extracted, _extract, _stage, _admit, _space,
    _attach_peers,
)


def _answer_cached(m: ModelPull) -> None:
    m.store.touch(m.key)
    m.result = finish(m, [], cached=True)


def _jobs(m: ModelPull) -> list[FileJob]:
    """The model's files for the engine (adopted ones are not fetched)."""
    assert m.source is not None and m.journal is not None
    m.transferred = True
    data = m.store.staging(m.key).data
    return [FileJob(m.source, f, str(data / f.path), m.journal, i, m.key, m.resume)
            for i, f in enumerate(m.files) if i not in m.skip]


def _through_steps(run: _Run, m: ModelPull) -> list[FileJob]:
    """Run the model's pipeline; its files for the engine, if it got through. Its error (an
    ``Exception``) is its own; anything else ends the pull."""
    try:
        for step in STEPS:
            step(run, m)
            if m.result is not None:
                return []
        return _jobs(m)
    except Exception as exc:
        m.error = _name_uri(exc, m.location.display)  # every error names its model
        return []


def _transfer(run: _Run, jobs: list[FileJob]) -> None:
    """One engine for every model's files; each model that got all of its files is published."""
    engine = TransferEngine(run.options, run.progress)
    watcher = _cancel_watcher(run.request.cancel, engine)
    try:
        results, errors = engine.run(jobs)
    finally:
        if watcher is not None:
            watcher.set()
    for key, failed in errors.items():
        if not isinstance(failed, Exception):
            raise failed  # (a worker's KeyboardInterrupt or SystemExit is the whole pull's)
        run.models[key].error = _name_uri(failed, run.models[key].location.display)
    for key, fetched in results.items():
        m = run.models[key]
        if m.error is None:
            try:
                m.result = dataclasses.replace(finish(m, fetched, cached=False),
                                               transfer_seconds=engine.transfer_seconds(key))
            except Exception as exc:  # e.g. no space for the manifest: name the URI
                m.error = _name_uri(exc, m.location.display)


def _parse(uris: Sequence[str], request: PullRequest) -> tuple[dict[str, ModelPull], list[str | Exception]]:
    """Every URI is parsed before the environment's credentials are read or a connection made:
    an invalid one is refused at once, never after a wait on an endpoint."""
    root = Path(request.root) if request.root is not None else None
    dest = Path(request.dest) if request.dest is not None else None
    models: dict[str, ModelPull] = {}
    order: list[str | Exception] = []
    for uri in uris:
        try:
            loc = parse_uri(uri)
            store = _store_for(root, dest, request.guard)
        except ModelcacheError as exc:
            order.append(exc)
            continue
        models.setdefault(loc.storage_key, ModelPull(loc, store, loc.storage_key, adoption=request.adoption,
                                                     unpack=request.unpack if request.unpack is not None
                                                     else root is not None))
        order.append(loc.storage_key)
    if dest is not None and len(models) > 1:
        raise ModelcacheError("a destination folder holds one model: pull several URIs into a store root")
    return models, order


def _start(request: PullRequest, models: dict[str, ModelPull]) -> _Run:
    options = (request.options or TransferOptions()).normalized()
    if request.peers is not None:
        # With peers the engine's chunks are pieces: each worker waits on (or reads) one piece,
        # so a piece another node reads from the origin never holds up the next one of a chunk.
        from modelcache.peers.pieces import piece_size_for

        options = dataclasses.replace(options, chunk_size=piece_size_for(options.chunk_size)).normalized()
    settings = request.settings if request.settings is not None else Settings.from_env()
    if request.peers is not None and not settings.forgery_proof:
        # Pieces from other nodes are settled by each file's checksum: one no peer can forge.
        settings = dataclasses.replace(settings, forgery_proof=True)
    return _Run(request, settings, options, request.progress or ProgressTracker(), request.space or SpacePolicy(),
                models)


def pull_many(uris: Sequence[str], request: PullRequest | None = None, **fields: Any) -> list[PullResult | Exception]:
    """Pull several models with one worker pool; one result or error per URI, in order.

    ``request`` says where and how (``PullRequest``); its fields may also be given by name
    (``pull_many(uris, root=...)``), an unknown name being a TypeError. A model folder that is
    there without our manifest (KServe's node agent filled it) is adopted (``adopt``). A model
    that fails keeps what it staged, with the failure recorded beside it (``ls`` shows it failed,
    with the reason); one that failed before staging a byte leaves nothing behind.
    ``KeyboardInterrupt`` and ``SystemExit`` are never a model's error: they end the pull, what
    was staged kept for a resume.
    """
    req = _request(request, fields)
    models, order = _parse(uris, req)
    if not models:
        return [item for item in order if isinstance(item, Exception)]
    run = _start(req, models)
    # Present models are answered without the lock: publish installs the manifest last, so a
    # present model is complete, and a read-only store (a pod's mount) can still be asked.
    for m in models.values():
        if m.store.is_present(m.key) and not req.refresh and not still_archive(m):
            _answer_cached(m)
    try:
        with _locked([m for m in models.values() if m.result is None], run.progress, req.cancel):
            jobs = [job for m in models.values() if m.result is None for job in _through_steps(run, m)]
            if jobs:
                _transfer(run, jobs)
            for m in models.values():
                if m.error is not None and m.result is None:
                    settle_failure(m)
    finally:
        for m in models.values():
            if m.journal is not None:
                m.journal.close()
            if m.source is not None:
                m.source.close()
    out: list[PullResult | Exception] = []
    for item in order:
        if isinstance(item, Exception):
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


def pull(uri: str, request: PullRequest | None = None, **fields: Any) -> PullResult:
    """Pull one model (``pull_many``'s request, or its fields by name); raises its error."""
    (result,) = pull_many([uri], request, **fields)
    if isinstance(result, Exception):
        raise result
    return result
