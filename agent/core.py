"""The agent's engine, independent of where its spec comes from (a LocalModelNode or a file).

``set_spec`` states what should be on this node; a supervisor thread makes it so, one small
step per tick: start due downloads (at most ``max_concurrent_models``), delete models that left
the spec once no pod mounts them, run the periodic checks. Downloads run in-process on the
core (``modelcache.pull``), each with its own credentials, progress tracker, cancel event and
disk reservation. ``status()`` renders the LocalModelNode status from the records.
"""

from __future__ import annotations

import logging
import re
import shutil
import threading
import time
from collections.abc import Callable, Iterable
from concurrent.futures import ThreadPoolExecutor
from typing import Any

from agent.capacity import Capacity
from agent.checks import Checker
from agent.config import AgentConfig
from agent.credentials import Credentials
from agent.inuse import MountChecker
from agent.logs import fields
from agent.metrics import AgentMetrics
from agent.repair import needs_repair, pin_damaged, pin_path, repair, repair_dir
from agent.state import ModelRecord
from modelcache.errors import ModelcacheError
from modelcache.kube.types import (
    MODEL_DOWNLOAD_ERROR,
    MODEL_DOWNLOAD_PENDING,
    MODEL_DOWNLOADED,
    MODEL_DOWNLOADING,
    LocalModelInfo,
    ModelCounts,
    NodeCapacity,
)
from modelcache.progress import ProgressTracker, format_line
from modelcache.pull import PullPlan, pull
from modelcache.redact import scrub_urls
from modelcache.store import NodeLayout, NodeStore, now_iso
from modelcache.transfer import TransferOptions
from modelcache.uri import parse_uri, redact_uri, storage_key

log = logging.getLogger("agent")

STORAGE_KEY = re.compile(r"^[0-9a-f]{16}$")
#: Free space in the status changes only in steps of this size (the metric is exact).
FREE_REPORT_STEP = 1 << 30


def group_entries(entries: Iterable[LocalModelInfo]) -> dict[str, tuple[str, list[LocalModelInfo]]]:
    """storageKey -> (uri, entries), in spec order; the first entry of a key leads (KServe's dedup)."""
    out: dict[str, tuple[str, list[LocalModelInfo]]] = {}
    for info in entries:
        key = storage_key(info.source_model_uri)
        out.setdefault(key, (info.source_model_uri, []))[1].append(info)
    return out


class Agent:
    def __init__(self, cfg: AgentConfig, credentials: Credentials, mounts: MountChecker,
                 metrics: AgentMetrics | None = None, group_limits: dict[str, int] | None = None) -> None:
        self.cfg = cfg
        self.store = NodeStore(NodeLayout(cfg.root))
        self.credentials = credentials
        self.mounts = mounts
        self.metrics = metrics or AgentMetrics()
        #: nodeGroup name -> storageLimit bytes (kept current by the runner).
        self.group_limits: dict[str, int] = dict(group_limits or {})
        self.records: dict[str, ModelRecord] = {}
        self.lock = threading.RLock()
        self.changed = threading.Event()  # a state changed: write the status now
        self.wake = threading.Event()
        self.spec_seen = threading.Event()
        self.generation: int | None = None
        self.capacity = Capacity(cfg.root, cfg.space_margin, self._used_bytes)
        self.pool = ThreadPoolExecutor(max_workers=max(1, cfg.max_concurrent_models), thread_name_prefix="download")
        self.checker = Checker(self)
        self._stop = threading.Event()
        self._thread: threading.Thread | None = None
        self._last_removal_check = 0.0
        self._last_free: int | None = None
        #: Optional sink for notable transitions (cluster mode: Kubernetes Events on the LocalModelNode):
        #: on_event(type "Normal"|"Warning", reason, message). Called without the lock held.
        self.on_event: Callable[[str, str, str], None] | None = None
        #: Peer transfer (agent/peering.py), cluster mode only; None: every byte from the origin.
        self.peering: Any = None
        (cfg.root / "models").mkdir(parents=True, exist_ok=True)

    # ---- desired state --------------------------------------------------------------------

    def set_spec(self, entries: list[LocalModelInfo], generation: int | None = None) -> None:
        desired = group_entries(entries)
        with self.lock:
            for key, (uri, infos) in desired.items():
                rec = self.records.get(key)
                if rec is None:
                    self.records[key] = self._new_record(key, uri, infos)
                    continue
                if rec.entries != infos and rec.state == MODEL_DOWNLOAD_ERROR:
                    rec.next_attempt, rec.failures = 0.0, 0  # the entry was edited (say, its credentials): retry now
                rec.entries, rec.uri = infos, uri
                if rec.removing:
                    rec.removing, rec.mounted_by = False, []
                    log.info("model back in the spec", extra=fields(storage_key=key))
            for key, rec in self.records.items():
                if key not in desired and not rec.removing:
                    self._mark_removing(rec)
            if not self.spec_seen.is_set():
                # Folders left from models that left the spec while the agent was not running.
                for key in self.store.keys():  # noqa: SIM118 (NodeStore is not a dict)
                    if key not in self.records and STORAGE_KEY.match(key):
                        rec = ModelRecord(key=key, uri=(self.store.manifest(key) or _NoUri).uri, entries=[])
                        self.records[key] = rec
                        self._mark_removing(rec)
            self.generation = generation
        self.spec_seen.set()
        self.changed.set()
        self.wake.set()

    def _new_record(self, key: str, uri: str, infos: list[LocalModelInfo]) -> ModelRecord:
        rec = ModelRecord(key=key, uri=uri, entries=infos)
        try:
            parse_uri(uri)
        except ModelcacheError as exc:
            rec.to(MODEL_DOWNLOAD_ERROR, f"{exc.reason}: {exc}", exc.reason)
            rec.next_attempt = float("inf")  # a bad URI does not get better by retrying
            return rec
        if self.store.is_present(key):  # restart: stats against the manifest, no re-hash
            manifest = self.store.manifest(key)
            rec.to(MODEL_DOWNLOADED)
            if manifest is not None:
                rec.revision = manifest.revision or (
                    manifest.resolved_uri if manifest.resolved_uri != manifest.uri else None)
                rec.bytes_total, rec.files_total = manifest.total_size, len(manifest.files)
                rec.finished_at = manifest.created_at
            log.info("model present", extra=fields(storage_key=key, uri=redact_uri(uri),
                                                   bytes=rec.bytes_total))
        return rec

    def _mark_removing(self, rec: ModelRecord) -> None:
        rec.removing = True
        if rec.running and rec.cancel is not None:
            rec.cancel.set()
        log.info("model left the spec: removing", extra=fields(storage_key=rec.key, uri=redact_uri(rec.uri)))

    # ---- supervisor -----------------------------------------------------------------------

    def start(self) -> Agent:
        self._thread = threading.Thread(target=self._run, name="agent-supervisor", daemon=True)
        self._thread.start()
        return self

    def alive(self) -> bool:
        return self._thread is not None and self._thread.is_alive()

    def stop(self) -> None:
        self._stop.set()
        self.wake.set()
        with self.lock:
            for rec in self.records.values():
                if rec.cancel is not None:
                    rec.cancel.set()
        if self._thread is not None:
            self._thread.join(10)
        self.pool.shutdown(wait=True, cancel_futures=True)
        self.checker.stop()

    def _run(self) -> None:
        while not self._stop.is_set():
            try:
                self.tick()
            except Exception:
                log.exception("supervisor tick failed")
            self.wake.wait(0.5)
            self.wake.clear()

    def tick(self) -> None:
        if not self.spec_seen.is_set():
            return
        now = time.monotonic()
        with self.lock:
            running = sum(1 for r in self.records.values() if r.running)
            for rec in list(self.records.values()):
                if rec.removing or rec.running:
                    continue
                due = rec.state in (MODEL_DOWNLOAD_PENDING, MODEL_DOWNLOAD_ERROR) and now >= rec.next_attempt
                if due and running < self.cfg.max_concurrent_models:
                    self._start(rec)
                    running += 1
                elif rec.state == MODEL_DOWNLOADED:
                    self.checker.maybe_check(rec, now)
        self._removals(now)
        self._log_progress(now)
        self._update_gauges()

    # ---- downloads ------------------------------------------------------------------------

    def _start(self, rec: ModelRecord) -> None:
        rec.running, rec.cancel, rec.progress = True, threading.Event(), ProgressTracker()
        rec.attempts += 1
        rec.to(MODEL_DOWNLOADING, f"repairing ({rec.damage})" if rec.damage else
               (f"attempt {rec.attempts}" if rec.attempts > 1 else ""))
        log.info("download started", extra=fields(storage_key=rec.key, uri=redact_uri(rec.uri), attempt=rec.attempts))
        self.changed.set()
        self.pool.submit(self._download, rec)

    def _admit(self, rec: ModelRecord, plan: PullPlan) -> None:
        rec.bytes_total, rec.files_total = plan.total_bytes, plan.files
        if plan.revision:
            rec.revision = plan.revision
        limit = self.group_limits.get(rec.primary.node_group or "") if rec.entries else None
        self.capacity.reserve(rec.key, plan.bytes_needed, plan.total_bytes, limit, plan.location.display)
        log.info("download admitted", extra=fields(storage_key=rec.key, bytes_total=plan.total_bytes,
                                                   bytes_needed=plan.bytes_needed, files=plan.files,
                                                   revision=plan.revision or ""))
        self.changed.set()

    def _options(self) -> TransferOptions:
        return TransferOptions(workers=self.cfg.workers, chunk_size=self.cfg.chunk_size,
                               max_attempts=self.cfg.transfer_attempts,
                               backoff_max=min(10.0, max(0.5, self.cfg.backoff_max)))

    def _download(self, rec: ModelRecord) -> None:
        t0 = time.monotonic()
        scheme = _scheme(rec.uri)
        error: BaseException | None = None
        result = None
        assert rec.progress is not None and rec.cancel is not None
        try:
            with self.credentials.settings_for(rec.primary) as settings:
                def pull_into(dest: Any = None, uri: str | None = None, check: Any = None) -> Any:
                    where: dict[str, Any] = {"dest": dest} if dest is not None else {"root": self.cfg.root}

                    def admit(plan: PullPlan) -> None:
                        if check is not None:
                            check(plan)  # a repair refuses a listing that is not its pinned revision
                        self._admit(rec, plan)

                    peers = self.peering.network if self.peering is not None and dest is None else None
                    return pull(uri or rec.uri, settings=settings, options=self._options(), progress=rec.progress,
                                admit=admit, cancel=rec.cancel, peers=peers, **where)

                if needs_repair(self.store, rec.key):
                    # Damaged, or left half-repaired by a crash: fix the files inside the folder that
                    # serving pods mount; a publish would swap the folder out from under them.
                    result = repair(self.store, rec.key, pull_into, rec.old_files).result
                else:
                    result = pull_into()
        except BaseException as exc:
            error = exc
        finally:
            self.capacity.release(rec.key)
        elapsed = time.monotonic() - t0
        snap = rec.progress.snapshot()
        if result is None or not result.cached:
            self.metrics.bytes.labels(scheme=scheme).inc(max(0, snap.bytes_done))
        origin_peers = self._count_sources(rec.key) if result is None or not result.cached else {}
        with self.lock:
            rec.running = False
            if rec.removing:
                log.info("download stopped: model left the spec", extra=fields(storage_key=rec.key))
            elif error is None and result is not None:
                manifest = self.store.manifest(rec.key)
                resolved = result.resolved_uri if result.resolved_uri != redact_uri(rec.uri) else None
                rec.revision = (manifest.revision if manifest else None) or resolved
                rec.bytes_total, rec.files_total = result.bytes, result.files
                rec.failures, rec.next_attempt = 0, 0.0
                # A repair stays visible in the status until the next change, not only in the logs.
                rec.to(MODEL_DOWNLOADED, f"repaired {now_iso()}: {rec.damage}"
                       if rec.damage else "")
                rec.damage, rec.old_files = "", []
                rec.last_size_check = rec.last_verify = time.monotonic()
                self.metrics.duration.labels(scheme=scheme, outcome="ok").observe(elapsed)
                log.info("download finished", extra=fields(
                    storage_key=rec.key, uri=redact_uri(rec.uri), bytes=result.bytes, files=result.files,
                    seconds=round(elapsed, 2), cached=result.cached, revision=rec.revision or "", **origin_peers))
            else:
                self._failed(rec, error, elapsed, scheme)
            event = None if rec.removing else (
                ("Normal", "Downloaded", f"{_names(rec)}: downloaded {rec.bytes_total or 0} bytes")
                if rec.state == MODEL_DOWNLOADED else
                ("Warning", "DownloadFailed", f"{_names(rec)}: {rec.reason}: {_one_line(error)}"))
        self.changed.set()
        self.wake.set()
        self._emit(event)

    def _count_sources(self, key: str) -> dict[str, int]:
        """Where the attempt's bytes came from (peer transfer on): metrics, and the log line's fields."""
        stats = self.peering.network.stats(key) if self.peering is not None else None
        if stats is None:
            return {}
        self.metrics.model_bytes.labels(storage_key=key, source="origin").inc(stats.from_origin)
        self.metrics.model_bytes.labels(storage_key=key, source="peer").inc(stats.from_peers)
        self.metrics.peer_dropped.inc(len(stats.dropped))
        return {"bytes_from_origin": stats.from_origin, "bytes_from_peers": stats.from_peers}

    def _emit(self, event: tuple[str, str, str] | None) -> None:
        if event is not None and self.on_event is not None:
            try:
                self.on_event(*event)
            except Exception as exc:
                log.warning("could not report an event", extra=fields(error=_one_line(exc)))

    def _failed(self, rec: ModelRecord, error: BaseException | None, elapsed: float, scheme: str) -> None:
        reason = getattr(error, "reason", None) or type(error).__name__
        message = _one_line(error)
        rec.failures += 1
        delay = min(self.cfg.backoff_max, self.cfg.backoff_initial * 2 ** (rec.failures - 1))
        rec.next_attempt = time.monotonic() + delay
        rec.to(MODEL_DOWNLOAD_ERROR, f"{reason}: {message} (retry {rec.failures} in {delay:.0f}s)", reason)
        self.metrics.errors.labels(reason=reason).inc()
        self.metrics.duration.labels(scheme=scheme, outcome="error").observe(elapsed)
        log.warning("download failed", extra=fields(storage_key=rec.key, uri=redact_uri(rec.uri), reason=reason,
                                                    error=message, retry_in=round(delay, 2)))

    def damaged(self, rec: ModelRecord, problem: str) -> None:
        """A check found the model damaged: report it and download it again (repair)."""
        with self.lock:
            if rec.removing or rec.running or rec.state != MODEL_DOWNLOADED:
                return
            try:
                with self.store.lock(rec.key, blocking=False):
                    # Not present any more (for every reader of the store) until the repair installs
                    # a new manifest; kept as the repair's pin, it says which revision to restore
                    # and which files were ours.
                    manifest = pin_damaged(self.store, rec.key)
                    rec.old_files = [f.path for f in manifest.files] if manifest else []
            except ModelcacheError:
                return  # someone else holds the model right now: check again later
            rec.to(MODEL_DOWNLOAD_ERROR, f"damaged: {problem}; repairing", "Damaged")
            rec.damage = f"was damaged: {problem}"
            rec.next_attempt = 0.0
            self.metrics.errors.labels(reason="Damaged").inc()
            log.warning("model damaged: repairing", extra=fields(storage_key=rec.key, problem=problem))
        self.changed.set()
        self.wake.set()
        self._emit(("Warning", "ModelDamaged", f"{_names(rec)}: {problem}; repairing"))

    # ---- removals -------------------------------------------------------------------------

    def _removals(self, now: float) -> None:
        with self.lock:
            waiting = [r for r in self.records.values() if r.removing and not r.running]
        if not waiting:
            self.metrics.removals_waiting.set(0)
            return
        fresh = [r for r in waiting if not r.mounted_by]
        if not fresh and now - self._last_removal_check < self.cfg.removal_recheck:
            return
        self._last_removal_check = now
        try:
            users = self.mounts.users([r.key for r in waiting])
        except Exception as exc:
            log.warning("cannot tell which pods mount the models; keeping them", extra=fields(error=_one_line(exc)))
            return
        for rec in waiting:
            pods = users.get(rec.key, [])
            if pods:
                if pods != rec.mounted_by:
                    rec.mounted_by = pods
                    log.info("removal waits: model mounted by a running pod",
                             extra=fields(storage_key=rec.key, pods=",".join(pods)))
                    self.changed.set()
                continue
            try:
                self.store.remove(rec.key)
            except ModelcacheError as exc:
                log.info("removal deferred", extra=fields(storage_key=rec.key, error=_one_line(exc)))
                continue
            shutil.rmtree(repair_dir(self.store.layout, rec.key), ignore_errors=True)  # an unfinished repair
            pin_path(self.store.layout, rec.key).unlink(missing_ok=True)
            with self.lock:
                if rec.removing and self.records.get(rec.key) is rec:
                    del self.records[rec.key]
            log.info("model deleted", extra=fields(storage_key=rec.key, uri=redact_uri(rec.uri)))
            self.changed.set()
        self.metrics.removals_waiting.set(sum(1 for r in waiting if r.mounted_by and r.removing))

    # ---- reporting ------------------------------------------------------------------------

    def _used_bytes(self) -> int:
        with self.lock:
            return sum(r.bytes_total or 0 for r in self.records.values() if r.state == MODEL_DOWNLOADED)

    def _log_progress(self, now: float) -> None:
        """One progress line per download every few seconds, the first as soon as its size is known."""
        every = max(2.0, self.cfg.status_interval)
        with self.lock:
            active = [r for r in self.records.values() if r.running and r.progress is not None
                      and now - r.last_progress_log >= every]
        for rec in active:
            snap = rec.progress.snapshot()  # type: ignore[union-attr]
            if not snap.bytes_total:
                continue  # still listing
            rec.last_progress_log = now
            log.info("progress " + format_line(snap), extra=fields(
                storage_key=rec.key, bytes_done=snap.bytes_done, bytes_total=snap.bytes_total,
                rate=int(snap.rate)))

    def _update_gauges(self) -> None:
        status = self.status()
        counts: dict[str, int] = {}
        for state in status["modelStatus"].values():
            counts[state] = counts.get(state, 0) + 1
        self.metrics.set_states(counts)
        _total, free = self.capacity.disk()
        self.metrics.free.set(free)
        self.metrics.reserved.set(self.capacity.reserved_bytes)

    def _reported_free(self) -> tuple[int, int]:
        """Free bytes for the status, held until they move by ``FREE_REPORT_STEP`` (or 1% of the
        disk, if less): other writers on the file system must not turn every tick into a PATCH."""
        total, free = self.capacity.disk()
        last = self._last_free
        if last is None or abs(free - last) >= min(FREE_REPORT_STEP, max(1, total // 100)):
            self._last_free = last = free
        return total, last

    def status(self) -> dict[str, Any]:
        """Our part of ``LocalModelNode.status`` (without ``lastUpdated``)."""
        model_status: dict[str, str] = {}
        details: dict[str, Any] = {}
        removing: dict[str, Any] = {}
        with self.lock:
            keys = sorted({r.key for r in self.records.values() if not r.removing})
            for rec in self.records.values():
                for info in rec.entries:
                    if rec.removing:
                        d = rec.detail()
                        d.message = ("removed from the spec; kept while mounted by " + ", ".join(rec.mounted_by)
                                     if rec.mounted_by else "removed from the spec; deleting")
                        removing[info.status_key] = d.to_dict()
                    else:
                        model_status[info.status_key] = rec.state
                        details[info.status_key] = {**rec.detail().to_dict(), **self._peer_fields(rec.key)}
        for k, v in removing.items():
            details.setdefault(k, v)
        total, free = self._reported_free()
        cap = NodeCapacity(total_bytes=total, free_bytes=free, reserved_bytes=self.capacity.reserved_bytes,
                           free=_quantity(free))
        out: dict[str, Any] = {
            "modelStatus": model_status,
            "modelDetails": details,
            "capacity": cap.to_dict(),
            "modelCounts": ModelCounts.of(model_status).to_dict(),
        }
        if self.generation is not None:
            out["observedGeneration"] = self.generation
        if self.peering is not None:
            out["peer"] = self.peering.status(keys)
        return out

    def _peer_fields(self, key: str) -> dict[str, Any]:
        return self.peering.model_fields(key) if self.peering is not None else {}

    def settled(self) -> bool:
        """Every model in the spec Downloaded or Error, and nothing running (standalone's exit test)."""
        with self.lock:
            recs = [r for r in self.records.values() if not r.removing]
            return self.spec_seen.is_set() and not any(r.running for r in self.records.values()) and all(
                r.state in (MODEL_DOWNLOADED, MODEL_DOWNLOAD_ERROR) for r in recs) and not any(
                r.removing and not r.mounted_by for r in self.records.values())


class _NoUri:
    uri = ""


def _names(rec: ModelRecord) -> str:
    return ", ".join(i.status_key for i in rec.entries) or rec.key


def _scheme(uri: str) -> str:
    try:
        return parse_uri(uri).kind
    except ModelcacheError:
        return "invalid"


def _one_line(exc: BaseException | None) -> str:
    """What status, events and logs say about an error: one line, every URL in it redacted (an
    SDK's own exception may quote a signed URL)."""
    text = str(exc) if exc is not None else "failed"
    return scrub_urls(" ".join(text.split()))[:500] or type(exc).__name__


def _quantity(n: int) -> str:
    """Bytes as a Kubernetes-style quantity for ``kubectl get`` (``12Gi``)."""
    for suffix, size in (("Ti", 1 << 40), ("Gi", 1 << 30), ("Mi", 1 << 20), ("Ki", 1 << 10)):
        if n >= size:
            return f"{n // size}{suffix}"
    return str(n)

