"""Per-model facts, and the state derived from them.

One ``ModelRecord`` per storageKey (spec entries sharing a URI share one folder and one
download, as in KServe). A record stores only what the agent *knows*: which spec entries want
the model, the download task running for it, the last failure and its backoff, what a check
found. The state that goes into the status is never stored: :meth:`ModelRecord.state` derives it
every time from (spec entries, whether the manifest is on disk, the running task)::

    a task is running                         -> Downloading  (a cancelled one is still running)
                                                 Downloaded   if carried over (it verifies in place)
    no spec entry wants it                    -> (removing)   deleted once no pod mounts it
    being deleted                             -> Pending      downloaded again once the delete is done
    its manifest is on disk                   -> Downloaded
    carried over                              -> Downloaded   (Verifying / Unverified: ``carried``)
    a failure is recorded (backoff, damage)   -> Error        retried when the backoff is due
    otherwise                                 -> Pending      started at the next tick

*Carried over*: a folder KServe's agent filled and persisted ``ModelDownloaded`` for (the
switch-over). KServe counts such a copy on its word and serves it; so does the node until the
folder is verified in place (``modelcache.adopt``, AS_FOUND), and for as long as the source cannot
be listed to verify it: the status, the cache's copies and the placement label carry over
instead of dropping while every byte is re-hashed, or for ever when the origin is unreachable.

So an entry that leaves the spec and comes back, a download that ends while its entry is away,
or a model deleted by someone else can never leave a state that nothing will change again.
"""

from __future__ import annotations

import threading
import time
from collections.abc import Iterable
from dataclasses import dataclass, field

from modelcache.kube.types import (
    MODEL_DOWNLOAD_ERROR,
    MODEL_DOWNLOAD_PENDING,
    MODEL_DOWNLOADED,
    MODEL_DOWNLOADING,
    LocalModelInfo,
    ModelDetail,
)
from modelcache.runtime.progress import ProgressTracker
from modelcache.sources.uri import redact_uri, storage_key

#: Why a running task was cancelled (None: it was not).
REMOVED, STOPPING = "removed", "stopping"
#: ``ModelDetail.verification`` of a model carried over (ModelRecord.carried).
VERIFYING, UNVERIFIED = "Verifying", "Unverified"
INTERRUPTED = "interrupted: the agent stopped; the download resumes when it runs again"


@dataclass
class Task:
    """One running download: its cancel switch, its progress, and why it was cancelled."""

    cancel: threading.Event = field(default_factory=threading.Event)
    progress: ProgressTracker = field(default_factory=ProgressTracker)
    repairing: bool = False
    why: str | None = None

    def stop(self, why: str) -> None:
        if self.why is None:  # the first reason wins: a removal during shutdown stays a removal
            self.why = why
        self.cancel.set()


@dataclass
class Failure:
    """The last attempt's error, shown until the next attempt starts or succeeds."""

    message: str
    reason: str


@dataclass
class ModelRecord:
    key: str
    uri: str
    #: The spec entries that want this model (empty: it left the spec).
    entries: list[LocalModelInfo]
    #: The entries it had when it left the spec (for the "removed; kept while mounted" detail).
    former: list[LocalModelInfo] = field(default_factory=list)
    task: Task | None = None
    failure: Failure | None = None
    #: Shown with a state that is not an error: "interrupted ...", "repaired ...".
    note: str = ""
    failures: int = 0  # consecutive, for the backoff
    next_attempt: float = 0.0
    attempts: int = 0
    #: Its files are being deleted right now (the spec said "remove" when the delete began).
    deleting: bool = False
    mounted_by: list[str] = field(default_factory=list)
    #: What a check found, until the repair has finished.
    damage: str = ""
    #: Files the damaged model's manifest listed (a repair deletes those the source no longer has).
    old_files: list[str] = field(default_factory=list)
    revision: str | None = None
    bytes_total: int | None = None
    files_total: int | None = None
    started_at: str | None = None
    finished_at: str | None = None
    #: What changed at the source since the download (a periodic drift check), or "".
    drift: str = ""
    #: Carried over (module docstring): why the node counts the model before any manifest of ours
    #: ("" once verified, or when nothing vouches for the folder).
    carried: str = ""
    last_drift_check: float = field(default_factory=time.monotonic)
    last_size_check: float = field(default_factory=time.monotonic)
    last_verify: float = field(default_factory=time.monotonic)
    last_progress_log: float = 0.0

    @property
    def primary(self) -> LocalModelInfo:
        """The first entry with this URI: its credentials download the model (KServe dedupes so)."""
        return self.entries[0]

    @property
    def wanted(self) -> bool:
        return bool(self.entries)

    @property
    def running(self) -> bool:
        return self.task is not None

    @property
    def hopeless(self) -> bool:
        """An invalid URI: retrying (even after an edit of the entry's other fields) cannot help."""
        return self.failure is not None and self.failure.reason == "InvalidURI"

    def state(self, present: bool) -> str:
        """The reported state, from the facts and ``present`` (the manifest is on disk)."""
        if self.task is not None:
            return MODEL_DOWNLOADED if self.carried and not self.task.repairing else MODEL_DOWNLOADING
        if self.deleting:
            return MODEL_DOWNLOAD_PENDING
        if present or self.carried:
            return MODEL_DOWNLOADED
        if self.failure is not None:
            return MODEL_DOWNLOAD_ERROR
        return MODEL_DOWNLOAD_PENDING

    def due(self, present: bool, now: float) -> bool:
        """Wanted, idle and not on disk, and its backoff (if any) has passed: start it."""
        return (self.wanted and self.task is None and not self.deleting and not present
                and now >= self.next_attempt)

    @property
    def verification(self) -> str | None:
        """``Verifying`` / ``Unverified`` while carried over (the detail's ``verification``)."""
        if not self.carried:
            return None
        return UNVERIFIED if self.failure is not None and self.task is None else VERIFYING

    def message(self, state: str) -> str:
        if self.carried and state == MODEL_DOWNLOADED:
            if self.verification == UNVERIFIED and self.failure is not None:
                return (f"unverified: {self.failure.message}; served as {self.carried} until the source can be "
                        "listed to verify it")
            return f"verifying in place; counted as downloaded meanwhile ({self.carried})"
        if state == MODEL_DOWNLOADING:
            if self.damage:
                return f"repairing ({self.damage})"
            return f"attempt {self.attempts}" if self.attempts > 1 else ""
        if state == MODEL_DOWNLOAD_ERROR and self.failure is not None:
            return self.failure.message
        if state == MODEL_DOWNLOAD_PENDING and self.deleting:
            return "back in the spec while its files were being deleted; downloading again next"
        return self.note

    def reason(self, state: str) -> str:
        return self.failure.reason if state == MODEL_DOWNLOAD_ERROR and self.failure is not None else ""

    def detail(self, state: str) -> ModelDetail:
        d = ModelDetail(
            state=state,
            storage_key=self.key,
            source_model_uri=redact_uri(self.uri),
            resolved_revision=self.revision,
            bytes_total=self.bytes_total,
            files_total=self.files_total,
            attempts=self.attempts or None,
            message=self.message(state) or None,
            started_at=self.started_at,
            finished_at=self.finished_at if state != MODEL_DOWNLOADING else None,
            drift=self.drift or None,
            verification=self.verification,
        )
        if self.task is not None:
            snap = self.task.progress.snapshot()
            d.bytes_done, d.files_done, d.rate = snap.bytes_done, snap.files_done, int(snap.rate)
            if snap.bytes_total:
                d.bytes_total, d.files_total = snap.bytes_total, snap.files_total
        elif state == MODEL_DOWNLOADED:
            d.bytes_done, d.files_done, d.rate = self.bytes_total, self.files_total, 0
        if self.task is not None and state == MODEL_DOWNLOADED:
            d.bytes_done = d.files_done = d.rate = None  # verifying: a download's progress does not apply
        return d


def group_entries(entries: Iterable[LocalModelInfo]) -> dict[str, tuple[str, list[LocalModelInfo]]]:
    """storageKey -> (uri, entries), in spec order; the first entry of a key leads (KServe's dedup),
    a cluster cache's before any namespace cache's: its credentials are a cluster admin's choice,
    and a tenant's entry is served that folder only if it names the same (agent/credentials.py)."""
    out: dict[str, tuple[str, list[LocalModelInfo]]] = {}
    for info in entries:
        key = storage_key(info.source_model_uri)
        out.setdefault(key, (info.source_model_uri, []))[1].append(info)
    for _uri, infos in out.values():
        infos.sort(key=lambda i: bool(i.namespace))  # stable: spec order otherwise
    return out


def owners(entries: list[LocalModelInfo]) -> frozenset[str]:
    """The namespaces whose share of a node group a model counts against: those of the namespace
    caches that want it, none when a cluster cache wants it too (a cluster admin's choice)."""
    if any(not e.namespace for e in entries):
        return frozenset()
    return frozenset(str(e.namespace) for e in entries)
