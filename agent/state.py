"""Per-model state machine and the status it renders.

One ``ModelRecord`` per storageKey (spec entries sharing a URI share one folder and one
download, as in KServe). Transitions::

    Pending --start--> Downloading --ok--> Downloaded --damaged--> Error(repairing) --start--> ...
                             \\--fail--> Error --backoff due--> Downloading
    any --left the spec--> Removing (waits while a pod mounts it) --> gone

Every transition goes through :meth:`ModelRecord.to` so the time stamps, the attempt count and
the "status changed" signal are kept in one place.
"""

from __future__ import annotations

import threading
import time
from dataclasses import dataclass, field

from modelcache.kube.types import (
    MODEL_DOWNLOAD_ERROR,
    MODEL_DOWNLOAD_PENDING,
    MODEL_DOWNLOADED,
    MODEL_DOWNLOADING,
    LocalModelInfo,
    ModelDetail,
)
from modelcache.progress import ProgressTracker
from modelcache.store import now_iso
from modelcache.uri import redact_uri

TRANSITIONS: dict[str, tuple[str, ...]] = {
    MODEL_DOWNLOAD_PENDING: (MODEL_DOWNLOADING, MODEL_DOWNLOADED, MODEL_DOWNLOAD_ERROR),
    MODEL_DOWNLOADING: (MODEL_DOWNLOADED, MODEL_DOWNLOAD_ERROR, MODEL_DOWNLOAD_PENDING),
    MODEL_DOWNLOADED: (MODEL_DOWNLOAD_ERROR, MODEL_DOWNLOADING, MODEL_DOWNLOAD_PENDING),
    MODEL_DOWNLOAD_ERROR: (MODEL_DOWNLOADING, MODEL_DOWNLOADED, MODEL_DOWNLOAD_PENDING),
}


class BadTransition(Exception):
    pass


@dataclass
class ModelRecord:
    key: str
    uri: str
    entries: list[LocalModelInfo]
    state: str = MODEL_DOWNLOAD_PENDING
    message: str = ""
    reason: str = ""
    attempts: int = 0
    failures: int = 0  # consecutive, for the backoff
    next_attempt: float = 0.0
    revision: str | None = None
    bytes_total: int | None = None
    files_total: int | None = None
    started_at: str | None = None
    finished_at: str | None = None
    #: Set while a download runs.
    progress: ProgressTracker | None = None
    cancel: threading.Event | None = None
    running: bool = False
    #: Out of the spec; files deleted once no pod mounts them.
    removing: bool = False
    mounted_by: list[str] = field(default_factory=list)
    #: What a check found, until the repair has finished.
    damage: str = ""
    #: Files the damaged model's manifest listed (a repair deletes those the source no longer has).
    old_files: list[str] = field(default_factory=list)
    last_size_check: float = field(default_factory=time.monotonic)
    last_verify: float = field(default_factory=time.monotonic)
    last_progress_log: float = 0.0

    @property
    def primary(self) -> LocalModelInfo:
        """The first entry with this URI: its credentials download the model (KServe dedupes so)."""
        return self.entries[0]

    def to(self, state: str, message: str = "", reason: str = "") -> None:
        if state != self.state and state not in TRANSITIONS.get(self.state, ()):
            raise BadTransition(f"{self.key}: {self.state} -> {state}")
        if state == MODEL_DOWNLOADING and self.state != MODEL_DOWNLOADING:
            self.started_at, self.finished_at = now_iso(), None
        if state in (MODEL_DOWNLOADED, MODEL_DOWNLOAD_ERROR):
            self.finished_at = now_iso()
        self.state, self.message, self.reason = state, message, reason

    def detail(self) -> ModelDetail:
        d = ModelDetail(
            state=self.state,
            storage_key=self.key,
            source_model_uri=redact_uri(self.uri),
            resolved_revision=self.revision,
            bytes_total=self.bytes_total,
            files_total=self.files_total,
            attempts=self.attempts or None,
            message=self.message or None,
            started_at=self.started_at,
            finished_at=self.finished_at,
        )
        if self.progress is not None and self.running:
            snap = self.progress.snapshot()
            d.bytes_done, d.files_done, d.rate = snap.bytes_done, snap.files_done, int(snap.rate)
            if snap.bytes_total:
                d.bytes_total, d.files_total = snap.bytes_total, snap.files_total
        elif self.state == MODEL_DOWNLOADED:
            d.bytes_done, d.files_done, d.rate = self.bytes_total, self.files_total, 0
        return d
