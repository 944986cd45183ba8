"""The agent's engine, independent of where its spec comes from (a LocalModelNode or a file).

``set_spec`` states what should be on this node; a supervisor thread makes it so, one small
step per tick: start due downloads (at most ``max_concurrent_models``), delete models that left
the spec once no pod mounts them, run the periodic checks, and collect files of models no entry
wants (left by a crash or while the agent was down). Downloads run in-process on the core
(``modelcache.pull``), each with its own credentials, progress tracker, cancel event and disk
reservation. ``status()`` derives each model's state from its record, its manifest on disk
and its running task every time it is called (agent/state.py): nothing stored can go stale.
"""

from __future__ import annotations

import logging
import re
import threading
import time
from collections.abc import Mapping
from concurrent.futures import ThreadPoolExecutor
from typing import Any

from agent.capacity import Capacity, folder_size
from agent.checks import Checker
from agent.config import AgentConfig
from agent.credentials import Credentials
from agent.entries import ENTRY_CHECK, Entry, Pair, judge_entries, namespace_entries, pair
from agent.inuse import MountChecker
from agent.logs import fields
from agent.metrics import AgentMetrics
from agent.ports import Ports
from agent.report import Report, names, one_line, seconds, unverified_note
from agent.state import INTERRUPTED, REMOVED, STOPPING, Failure, ModelRecord, Task, group_entries, owners
from modelcache import adopt
from modelcache.errors import ModelcacheError
from modelcache.kube.types import (
    MODEL_DOWNLOAD_ERROR,
    MODEL_DOWNLOADED,
    LocalModelInfo,
)
from modelcache.pull import PullPlan, SpacePolicy, pull, staged_pulls
from modelcache.repair import needs_repair, repair
from modelcache.runtime.clock import rfc3339
from modelcache.runtime.loop import Loop
from modelcache.sources.uri import parse_uri, redact_uri
from modelcache.store import NodeLayout, NodeStore

log = logging.getLogger("agent")

STORAGE_KEY = re.compile(r"^[0-9a-f]{16}$")


class Agent:
    def __init__(self, cfg: AgentConfig, credentials: Credentials, mounts: MountChecker,
                 metrics: AgentMetrics | None = None, group_limits: dict[str, int] | None = None, *,
                 ports: Ports | None = None, changed: threading.Event | None = None) -> None:
        """``ports``: the optional parts cluster mode fills (agent/ports.py). ``changed``: set when the
        status should be written now; given when a port changes the status too (peering)."""
        self.cfg = cfg
        self.layout = NodeLayout(cfg.root)  # read-only here: every write goes through the store
        self.store = NodeStore(self.layout)
        self.credentials = credentials
        self.mounts = mounts
        self.metrics = metrics or AgentMetrics()
        self.ports = ports or Ports()
        #: nodeGroup name -> storageLimit bytes (kept current by the runner: set_group_limit).
        self.group_limits: dict[str, int] = dict(group_limits or {})
        self.records: dict[str, ModelRecord] = {}
        self.lock = threading.RLock()
        self.changed = changed or threading.Event()
        self.wake = threading.Event()
        self.spec_seen = threading.Event()
        self.generation: int | None = None
        self.capacity = Capacity(cfg.root, cfg.space_margin, self.used_bytes, namespace_used=self._namespace_used,
                                 cluster_pending=self._cluster_pending, counted=self._counted,
                                 namespaces_held=self._namespaces_held)
        self.pool = ThreadPoolExecutor(max_workers=max(1, cfg.max_concurrent_models), thread_name_prefix="download")
        self.checker = Checker(self.store, cfg, credentials, self.damaged, self.changed.set)
        #: (status key, record key) of each namespace cache's entry -> why it is not served its
        #: record's model ("": it is). Judged before a spec brings it, again every ENTRY_CHECK
        #: seconds (agent/entries.py); one without a verdict is not reported Downloaded.
        self.entry_verdicts: dict[Pair, str] = {}
        self._last_entry_check = -ENTRY_CHECK
        self._applying = threading.Lock()  # one spec at a time, judged then applied
        self._stop = threading.Event()
        self._loop = Loop("agent-supervisor", self.tick, 0.5, wake=self.wake, logger=log)
        self._last_removal_check = 0.0
        self._last_sweep = 0.0
        #: Folders not made by modelcache already named in the log (each is said once).
        self._told_foreign: set[str] = set()
        #: The last spec refused as invalid (modelcache.kube.validate), until a valid one comes:
        #: (problems, its generation, when it was refused). Reported as a SpecValid=False condition.
        self.refused: tuple[list[str], int | None, str] | None = None
        self.report = Report(self)
        (cfg.root / "models").mkdir(parents=True, exist_ok=True)

    def set_group_limit(self, group: str, limit: int | None) -> None:
        """A node group's storageLimit (a GroupLimit, with its per-namespace share); None: it has none."""
        with self.lock:
            if limit is None:
                self.group_limits.pop(group, None)
            else:
                self.group_limits[group] = limit

    def status(self) -> dict[str, Any]:
        """Our part of ``LocalModelNode.status`` (without ``lastUpdated``), derived now (agent/report.py)."""
        return self.report.status()

    # ---- what is on disk --------------------------------------------------------------------

    def present(self, key: str) -> bool:
        """The model's manifest is installed (it is published last), not marked damaged (a check
        that finds the files damaged marks it) and no publish of it is under way: the on-disk half
        of every derived state."""
        return self.store.published(key)

    def _on_disk(self, key: str) -> bool:
        """Anything of the model left to delete: folder, manifest, staged or repair download."""
        return self.store.has(key)

    def _disk_keys(self) -> set[str]:
        """Every storageKey with something under the root: published, unlisted, staged or repairing."""
        return {k for k in self.store.disk_keys() if STORAGE_KEY.match(k)}

    # ---- desired state --------------------------------------------------------------------

    def refuse_spec(self, problems: list[str], generation: int | None = None) -> None:
        """An invalid spec changes nothing: the last valid one stays in force, the status says why."""
        with self.lock:
            if self.refused is None or self.refused[:2] != (problems, generation):
                self.refused = (list(problems), generation, rfc3339())
        self.changed.set()

    def set_spec(self, entries: list[LocalModelInfo], generation: int | None = None,
                 reported: Mapping[str, str] | None = None) -> None:
        """Apply a valid spec. The status is written at once only if this changed something: the
        resync re-applies the same spec every --resync-period, and a write for it would be a
        progress write between two --status-interval ticks. ``reported``: the ``modelStatus``
        persisted in the LocalModelNode (KServe's agent's, before the switch): a folder it
        reported ``ModelDownloaded`` is carried over (agent/state.py). Its new namespace entries are
        judged first (agent/entries.py): no status shows one unjudged."""
        desired = group_entries(entries)
        with self._applying:
            with self.lock:
                known = dict(self.entry_verdicts)
            new = [e for e in namespace_entries((k, v[1]) for k, v in desired.items()) if pair(e) not in known]
            verdicts = judge_entries(self.credentials, new, known)
            self._apply_spec(desired, generation, reported, verdicts)

    def _apply_spec(self, desired: dict[str, tuple[str, list[LocalModelInfo]]], generation: int | None,
                    reported: Mapping[str, str] | None, verdicts: dict[Pair, str]) -> None:
        with self.lock:
            self.entry_verdicts.update(verdicts)
            changed = self.refused is not None or not self.spec_seen.is_set() or generation != self.generation
            self.refused = None
            for key, (uri, infos) in desired.items():
                rec = self.records.get(key)
                if rec is None:
                    self.records[key] = self._new_record(key, uri, infos, reported or {})
                    changed = True
                    continue
                if rec.entries != infos or rec.uri != uri:
                    changed = True
                if rec.entries != infos and not rec.hopeless:
                    # Edited (say, its credentials) or back in the spec: a failed model retries now.
                    rec.next_attempt, rec.failures = 0.0, 0
                if not rec.wanted:
                    rec.mounted_by, rec.former = [], []
                    log.info("model back in the spec", extra=fields(storage_key=key))
                rec.entries, rec.uri = infos, uri
            for key, rec in self.records.items():
                if key not in desired and rec.wanted:
                    self._mark_removing(rec)
                    changed = True
            if not self.spec_seen.is_set():
                self._adopt_orphans()
                self._last_sweep = time.monotonic()
            self.generation = generation
            self._last_entry_check = -ENTRY_CHECK  # edited entries are judged again at the next tick
        self.spec_seen.set()
        if changed:
            self.changed.set()
        self.wake.set()

    def _new_record(self, key: str, uri: str, infos: list[LocalModelInfo],
                    reported: Mapping[str, str]) -> ModelRecord:
        rec = ModelRecord(key=key, uri=uri, entries=infos)
        rec.carried = self._carried(key, infos, reported)
        if rec.carried:
            # What the copy takes on disk counts against the node group's storageLimit (and shows in
            # the status) from now on, not only once verified.
            rec.files_total, rec.bytes_total = folder_size(self.store.layout.model_dir(key))
        try:
            parse_uri(uri)
        except ModelcacheError as exc:
            if self._job_container(uri) is None:  # (a download-Job container may read it)
                rec.failure = Failure(f"{exc.reason}: {exc}", exc.reason)
                rec.next_attempt = float("inf")  # a bad URI does not get better by retrying
                if rec.carried:
                    log.warning("a copy KServe downloaded of a URI modelcache does not read: served unverified",
                                extra=fields(storage_key=key, uri=redact_uri(uri), error=one_line(exc)))
                return rec
        manifest = self.store.manifest(key)
        if manifest is None:
            if self.store.layout.manifest_path(key).exists():  # ours, but its manifest is damaged
                self._mark_damaged(rec, "its manifest is damaged")
            return rec
        if not self.store.is_present(key):  # restart: stats against the manifest, no re-hash
            self._mark_damaged(rec, "a file is missing or has the wrong size")
            return rec
        rec.revision = manifest.revision or (manifest.resolved_uri if manifest.resolved_uri != manifest.uri else None)
        rec.bytes_total, rec.files_total = manifest.total_size, len(manifest.files)
        rec.finished_at = manifest.created_at
        rec.note = unverified_note(manifest)
        log.info("model present", extra=fields(storage_key=key, uri=redact_uri(uri), bytes=rec.bytes_total))
        return rec

    def _carried(self, key: str, infos: list[LocalModelInfo], reported: Mapping[str, str]) -> str:
        """Why the node counts this model before verifying it ("": it does not): the persisted
        status says ``ModelDownloaded`` for one of its entries (KServe's agent wrote it, or ours
        while carrying it over before a restart), and the folder holds a copy our store never
        knew (no manifest, no pin or repair of ours: a folder the store knew is never taken on
        anyone's word)."""
        names = [i.status_key for i in infos if reported.get(i.status_key) == MODEL_DOWNLOADED]
        if not names:
            return ""
        try:
            if not adopt.applies(self.store, key):  # (False for a folder the store knew: NodeStore.knew)
                return ""
        except (OSError, ModelcacheError):
            return ""
        log.info("a model folder reported ModelDownloaded: counted as downloaded while it is verified in place",
                 extra=fields(storage_key=key, entries=",".join(names)))
        return "reported ModelDownloaded before the switch"

    def _mark_removing(self, rec: ModelRecord) -> None:
        rec.former, rec.entries = rec.entries, []
        if rec.task is not None:
            rec.task.stop(REMOVED)
        log.info("model left the spec: removing", extra=fields(storage_key=rec.key, uri=redact_uri(rec.uri)))

    def _adopt_orphans(self) -> None:
        """Files of models no entry wants (left while the agent was not running, or by a crash
        mid-download or mid-repair) become records without entries: the removal deletes them
        like any model that left the spec, mounted ones only once no pod uses them. Only what
        this store made: a folder someone else put under ``models/`` stays (said once)."""
        orphans = sorted(self._disk_keys() - self.records.keys())
        staged = {s.storage_key: s.uri for s in staged_pulls(self.store)} if orphans else {}
        for key in orphans:
            known = self.store.manifest(key) or self.store.pinned_manifest(key)
            uri = known.uri if known else staged.get(key, "")
            self.records[key] = ModelRecord(key=key, uri=uri, entries=[])
            log.info("files of a model no entry wants: removing",
                     extra=fields(storage_key=key, **({"uri": redact_uri(uri)} if uri else {})))
        for name in sorted(set(self.store.foreign()) - self._told_foreign - self.records.keys()):
            self._told_foreign.add(name)
            log.warning("a folder under the root was not made by modelcache: kept (the agent never deletes it); "
                        "delete it by name if it is not needed", extra=fields(
                            folder=str(self.layout.model_dir(name)),
                            command=f"modelcache rm --root {self.cfg.root} {name}"))

    def _sweep(self, now: float) -> None:
        self._last_sweep = now
        with self.lock:
            self._adopt_orphans()
        self.store.clear_trash()  # folders a crash left between a rename and its delete

    # ---- supervisor -----------------------------------------------------------------------

    def start(self) -> Agent:
        self._loop.start()
        return self

    def alive(self) -> bool:
        return self._loop.alive()

    def stop(self) -> None:
        """Cancel the downloads and wait for them: they end "interrupted" (Pending, resumed by
        the next agent from their staged data), not failed."""
        self._stop.set()
        self.wake.set()
        with self.lock:
            for rec in self.records.values():
                if rec.task is not None:
                    rec.task.stop(STOPPING)
        self._loop.stop(10)
        self.pool.shutdown(wait=True, cancel_futures=True)
        self.checker.stop()
        with self.lock:
            for rec in self.records.values():
                if rec.task is not None:  # submitted but never started before the pool shut down
                    rec.task, rec.note = None, INTERRUPTED
        self.changed.set()

    def tick(self) -> None:
        if not self.spec_seen.is_set() or self._stop.is_set():
            return
        now = time.monotonic()
        with self.lock:
            running = sum(1 for r in self.records.values() if r.task is not None)
            # Cluster caches' models first (a cluster admin's; namespace caches get what they leave).
            for rec in sorted(self.records.values(), key=lambda r: bool(owners(r.entries))):
                if not rec.wanted or rec.task is not None or rec.deleting:
                    continue
                present = self.present(rec.key)
                if rec.due(present, now):
                    if running < self.cfg.max_concurrent_models:
                        self._start(rec)
                        running += 1
                elif present:
                    self.checker.maybe_check(rec, now)
        self._removals(now)
        if now - self._last_entry_check >= ENTRY_CHECK:
            self._last_entry_check = now
            self._check_entries()
        if self.cfg.sweep_interval > 0 and now - self._last_sweep >= self.cfg.sweep_interval:
            self._sweep(now)
        self.report.log_progress(now)

    # ---- downloads ------------------------------------------------------------------------

    def _start(self, rec: ModelRecord) -> None:
        task = rec.task = Task()
        rec.attempts += 1
        rec.started_at, rec.finished_at, rec.note = rfc3339(), None, ""
        log.info("download started", extra=fields(storage_key=rec.key, uri=redact_uri(rec.uri), attempt=rec.attempts))
        self.changed.set()
        self.pool.submit(self._download, rec, task, rec.primary)

    def _admit(self, rec: ModelRecord, task: Task, primary: LocalModelInfo, plan: PullPlan) -> None:
        rec.bytes_total, rec.files_total = plan.total_bytes, plan.files
        if plan.revision:
            rec.revision = plan.revision
        staged = self.layout.repair_dir(rec.key) if task.repairing else self.layout.staging_dir(rec.key)
        self.capacity.reserve(rec.key, plan.bytes_needed, plan.total_bytes, self._admitting_limit(rec),
                              plan.location.display, staged=staged, owners=owners(rec.entries),
                              advice=self.cfg.space_advice())
        log.info("download admitted", extra=fields(storage_key=rec.key, bytes_total=plan.total_bytes,
                                                   bytes_needed=plan.bytes_needed, files=plan.files,
                                                   revision=plan.revision or ""))
        self.changed.set()

    def _admitting_limit(self, rec: ModelRecord) -> int | None:
        """The storageLimit a download is admitted against: entries sharing a URI share one
        folder, and each is judged in its own node group, so the model is fetched if any wanting
        group has room (the most generous limit; None if one sets none). An entry whose own
        group has no room is reported failed, naming its group (``_group_refusal``)."""
        limits = [self.group_limits.get(info.node_group or "") for info in rec.entries] or [None]
        return None if any(limit is None for limit in limits) else max(limits, key=lambda x: int(x or 0))

    def _download(self, rec: ModelRecord, task: Task, primary: LocalModelInfo) -> None:
        t0 = time.monotonic()
        scheme = "job" if self._job_container(rec.uri) is not None else _scheme(rec.uri)
        self.metrics.download_started(scheme)
        error: BaseException | None = None
        result = None
        try:
            result = (self._download_by_job(rec, task, primary) if self._job_container(rec.uri) is not None
                      else self._pull_model(rec, task, primary))
        except BaseException as exc:
            error = exc
        finally:
            self.capacity.release(rec.key)
        elapsed = time.monotonic() - t0
        snap = task.progress.snapshot()
        if result is None or not result.cached:
            self.metrics.bytes.labels(scheme=scheme).inc(max(0, snap.bytes_done))
        origin_peers = self._count_sources(rec.key) if result is None or not result.cached else {}
        event = None
        with self.lock:
            rec.task = None
            carried = rec.carried
            if error is None and result is not None:
                rec.carried = ""
                if carried:
                    drift = getattr(result, "drift", None)
                    rec.drift = drift.message if drift is not None and drift.drifted else ""
                    # Verified at the revision the folder holds: whether the source moved since is
                    # the drift check's to say, now rather than an interval from now.
                    rec.last_drift_check = float("-inf")
                manifest = self.store.manifest(rec.key)
                resolved = result.resolved_uri if result.resolved_uri != redact_uri(rec.uri) else None
                rec.revision = (manifest.revision if manifest else None) or resolved
                rec.bytes_total, rec.files_total = result.bytes, result.files
                rec.failure, rec.failures, rec.next_attempt = None, 0, 0.0
                # A repair stays visible in the status until the next change, not only in the logs.
                rec.note = f"repaired {rfc3339()}: {rec.damage}" if rec.damage else unverified_note(manifest)
                rec.damage, rec.old_files = "", []
                rec.finished_at = rfc3339()
                rec.last_size_check = rec.last_verify = time.monotonic()
                self.metrics.duration.labels(scheme=scheme, outcome="ok").observe(elapsed)
                log.info("download finished", extra=fields(
                    storage_key=rec.key, uri=redact_uri(rec.uri), bytes=result.bytes, files=result.files,
                    seconds=round(elapsed, 2), cached=result.cached, revision=rec.revision or "", **origin_peers))
                if rec.wanted and carried:
                    event = ("Normal", "Verified", f"{names(rec)}: the copy KServe downloaded was verified in place "
                             f"({rec.bytes_total or 0} bytes" + (f"; drift: {rec.drift}" if rec.drift else "") + ")")
                elif rec.wanted:
                    event = ("Normal", "Downloaded", f"{names(rec)}: downloaded {rec.bytes_total or 0} bytes")
            elif task.why == STOPPING:
                # Not a failure: the staged data stays, and the next agent resumes from it.
                rec.note = INTERRUPTED
                log.info("download interrupted: the agent is stopping", extra=fields(storage_key=rec.key))
            elif task.why == REMOVED:
                log.info("download stopped: model left the spec" + ("; back in it now, restarting" if rec.wanted
                                                                      else ""), extra=fields(storage_key=rec.key))
            else:
                self._failed(rec, error, elapsed, scheme)
                if rec.wanted and rec.carried:
                    event = ("Warning", "Unverified", f"{names(rec)}: serving the copy KServe downloaded, unverified: "
                             f"{one_line(error)}")
                elif rec.wanted:
                    event = ("Warning", "DownloadFailed", f"{names(rec)}: {rec.failure.reason}: {one_line(error)}"
                             if rec.failure else f"{names(rec)}: {one_line(error)}")
        self.changed.set()
        self.wake.set()
        self._emit(event)

    def _pull_model(self, rec: ModelRecord, task: Task, primary: LocalModelInfo) -> Any:
        """Our own download: the core pull (adoption, archives unpacked), or an in-place repair."""
        with self.credentials.settings_for(primary) as settings:
            def pull_into(dest: Any = None, uri: str | None = None, check: Any = None, only: Any = None,
                          adoption: str = adopt.COMPLETE) -> Any:
                where: dict[str, Any] = {"dest": dest} if dest is not None else {"root": self.cfg.root}

                def admit(plan: PullPlan) -> None:
                    if check is not None:
                        check(plan)  # a repair refuses a listing that is not its pinned revision
                    self._admit(rec, task, primary, plan)

                peers = self.ports.peering.network if self.ports.peering is not None and dest is None else None
                # unpack: a repair's folder holds the model as the store does (archives unpacked).
                # One margin: the agent's --space-margin, which its admission (above) has checked.
                space = SpacePolicy(self.cfg.space_margin, self.cfg.space_advice())
                return pull(uri or rec.uri, settings=settings, options=self.cfg.transfer_options(),
                            progress=task.progress, admit=admit, cancel=task.cancel, only=only, peers=peers,
                            unpack=True, space=space, adoption=adoption, **where)

            with self.store.lock(rec.key, cancel=task.cancel):
                self.store.recover(rec.key)  # a publish a crash interrupted is finished or undone first
            if needs_repair(self.store, rec.key, rec.old_files):
                # Damaged, or left half-repaired by a crash: fix the files inside the folder that
                # serving pods mount; a publish would swap the folder out from under them.
                task.repairing = True
                return repair(self.store, rec.key, pull_into, rec.old_files).result
            if rec.carried and not adopt.applies(self.store, rec.key):
                with self.lock:
                    rec.carried = ""  # the copy KServe left is gone: an ordinary download from here
                log.warning("the folder counted on KServe's word is gone: downloading the model",
                            extra=fields(storage_key=rec.key))
                self.changed.set()
            # A copy reported complete is adopted as found: pods are reading it (adopt, AS_FOUND).
            return pull_into(adoption=adopt.AS_FOUND if rec.carried else adopt.COMPLETE)

    def containers_changed(self) -> None:
        """KServe's download containers changed: a URI one of them now reads is no longer an
        invalid URI (the container may have been created after the entry)."""
        with self.lock:
            for rec in self.records.values():
                if rec.hopeless and rec.task is None and self._job_container(rec.uri) is not None:
                    rec.failure, rec.failures, rec.next_attempt = None, 0, 0.0
                    log.info("a download container reads this URI now", extra=fields(storage_key=rec.key))
        self.changed.set()
        self.wake.set()

    def _job_container(self, uri: str) -> Mapping[str, Any] | None:
        """KServe's download-Job container for a URI none of our sources reads (agent/downloadjob.py)."""
        if self.ports.jobs is None:
            return None
        try:
            parse_uri(uri)
            return None  # ours: pulled in-process
        except ModelcacheError:
            return self.ports.jobs.container_for(uri)

    def _download_by_job(self, rec: ModelRecord, task: Task, primary: LocalModelInfo) -> Any:
        jobs = self.ports.jobs
        assert jobs is not None
        from modelcache.adopt import record_folder
        from modelcache.pull import PullResult

        self.store.claim(rec.key)  # the container fills the folder: until its manifest, a folder of ours
        with self.credentials.env_for(primary) as env:
            passed = {k: v for k, v in env.items() if self.credentials.base_env.get(k) != v}
            job = jobs.run(primary, rec.key, self.store.layout.model_dir(rec.key), task.cancel, passed)
        manifest = record_folder(self.store, rec.key, redact_uri(rec.uri))
        log.info("download Job succeeded", extra=fields(storage_key=rec.key, job=job, files=len(manifest.files)))
        return PullResult(uri=manifest.uri, storage_key=rec.key, path=self.store.layout.model_dir(rec.key),
                          resolved_uri=manifest.uri, files=len(manifest.files), bytes=manifest.total_size,
                          cached=False, elapsed=0.0)

    def _count_sources(self, key: str) -> dict[str, int]:
        """Where the attempt's bytes came from (peer transfer on): metrics, and the log line's fields."""
        stats = self.ports.peering.network.stats(key) if self.ports.peering is not None else None
        if stats is None:
            return {}
        self.metrics.model_bytes.labels(storage_key=key, source="origin").inc(stats.from_origin)
        self.metrics.model_bytes.labels(storage_key=key, source="peer").inc(stats.from_peers)
        return {"bytes_from_origin": stats.from_origin, "bytes_from_peers": stats.from_peers}

    def _emit(self, event: tuple[str, str, str] | None) -> None:
        if event is not None and self.ports.events is not None:
            try:
                self.ports.events(*event)
            except Exception as exc:
                log.warning("could not report an event", extra=fields(error=one_line(exc)))

    def _failed(self, rec: ModelRecord, error: BaseException | None, elapsed: float, scheme: str) -> None:
        reason = getattr(error, "reason", None) or type(error).__name__
        message = one_line(error)
        rec.failures += 1
        delay = min(self.cfg.backoff_max, self.cfg.backoff_initial * 2 ** (rec.failures - 1))
        rec.next_attempt = time.monotonic() + delay
        # A one-shot standalone run ends once every model is Downloaded or Error: it promises no retry.
        one_shot = self.cfg.standalone is not None and not self.cfg.watch
        retry = "" if one_shot else f" (retry {rec.failures} in {seconds(delay)})"
        rec.failure = Failure(f"{reason}: {message}{retry}", reason)
        rec.finished_at = rfc3339()
        self.metrics.errors.labels(reason=reason).inc()
        self.metrics.duration.labels(scheme=scheme, outcome="error").observe(elapsed)
        later = {} if one_shot else {"retry_in": round(delay, 2)}
        log.warning("download failed", extra=fields(storage_key=rec.key, uri=redact_uri(rec.uri), reason=reason,
                                                    error=message, **later))

    def _mark_damaged(self, rec: ModelRecord, problem: str) -> bool:
        """Withdraw a damaged model's manifest (it is not present for any reader of the store
        until a repair installs a new one) and schedule the repair. Caller holds the lock."""
        try:
            with self.store.lock(rec.key, blocking=False):
                # Kept as the repair's pin: which revision to restore and which files were ours.
                manifest = self.store.pin_damaged(rec.key)
                rec.old_files = [f.path for f in manifest.files] if manifest else []
        except ModelcacheError:
            return False  # someone else holds the model right now: check again later
        rec.failure = Failure(f"damaged: {problem}; repairing", "Damaged")
        rec.damage = f"was damaged: {problem}"
        rec.next_attempt, rec.failures = 0.0, 0
        self.metrics.errors.labels(reason="Damaged").inc()
        log.warning("model damaged: repairing", extra=fields(storage_key=rec.key, problem=problem))
        return True

    def damaged(self, rec: ModelRecord, problem: str) -> None:
        """A check found the model damaged: report it and download it again (repair)."""
        with self.lock:
            if not rec.wanted or rec.task is not None or rec.deleting or not self.present(rec.key):
                return
            if not self._mark_damaged(rec, problem):
                return
        self.changed.set()
        self.wake.set()
        self._emit(("Warning", "ModelDamaged", f"{names(rec)}: {problem}; repairing"))

    # ---- removals -------------------------------------------------------------------------

    def _removals(self, now: float) -> None:
        with self.lock:
            waiting = [r for r in self.records.values() if not r.wanted and r.task is None and not r.deleting]
            for rec in [r for r in waiting if not self._on_disk(r.key)]:
                del self.records[rec.key]  # never downloaded (or already gone): nothing to delete
                waiting.remove(rec)
                self.changed.set()
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
            log.warning("cannot tell which pods mount the models; keeping them", extra=fields(error=one_line(exc)))
            return
        for rec in waiting:
            pods = users.get(rec.key, [])
            with self.lock:
                # The check took a while (API reads, earlier deletes): act only if the spec still
                # says "remove" now, and mark the delete so a re-add waits for it to finish.
                if rec.wanted or rec.task is not None or rec.deleting or self.records.get(rec.key) is not rec:
                    continue
                if pods:
                    if pods != rec.mounted_by:
                        rec.mounted_by = pods
                        log.info("removal waits: model mounted by a running pod",
                                 extra=fields(storage_key=rec.key, pods=",".join(pods)))
                        self.changed.set()
                    continue
                rec.deleting = True
            self._delete(rec)
        self.metrics.removals_waiting.set(sum(1 for r in waiting if r.mounted_by and not r.wanted))

    def _delete(self, rec: ModelRecord) -> None:
        try:
            self.store.remove(rec.key)  # an unfinished repair with it
            deleted = True
        except ModelcacheError as exc:
            log.info("removal deferred", extra=fields(storage_key=rec.key, error=one_line(exc)))
            deleted = False
        with self.lock:
            rec.deleting = False
            if deleted:
                # Every deletion is a warning: files went, and the log says which and why.
                log.warning("model deleted: no entry of the spec wants it", extra=fields(
                    storage_key=rec.key, **({"uri": redact_uri(rec.uri)} if rec.uri else {})))
                # Nothing of the old copy is true any more: a re-added entry starts from scratch.
                rec.mounted_by, rec.failure, rec.failures, rec.next_attempt = [], None, 0, 0.0
                rec.note, rec.damage, rec.old_files, rec.revision = "", "", [], None
                if not rec.wanted and self.records.get(rec.key) is rec:
                    del self.records[rec.key]
                elif rec.wanted:
                    log.info("model came back while it was being deleted: downloading it again",
                             extra=fields(storage_key=rec.key))
        self.changed.set()
        self.wake.set()

    # ---- reporting ------------------------------------------------------------------------

    def _check_entries(self) -> None:
        """Judge every namespace cache's entry again (agent/entries.py: grants change)."""
        with self.lock:
            entries = self._namespace_entries()
            known = dict(self.entry_verdicts)
        verdicts = judge_entries(self.credentials, entries, known)
        with self.lock:
            # An entry a spec brought meanwhile keeps the verdict set_spec gave it: dropped, it
            # would be reported Pending until the next check.
            wanted = {pair(e) for e in self._namespace_entries()}
            verdicts = {p: v for p, v in {**self.entry_verdicts, **verdicts}.items() if p in wanted}
            changed, self.entry_verdicts = verdicts != self.entry_verdicts, verdicts
        if changed:
            self.changed.set()

    def _namespace_entries(self) -> list[Entry]:
        return namespace_entries((r.key, r.entries) for r in self.records.values() if r.wanted)

    def used_bytes(self) -> int:
        with self.lock:
            return sum(r.bytes_total or 0 for r in self.records.values()
                       if not r.deleting and (self.present(r.key) or r.carried))

    def _namespace_used(self, namespace: str) -> int:
        """Bytes of the models on this node that count against ``namespace``'s share of its group."""
        return self._namespaces_held().get(namespace, 0)

    def _namespaces_held(self) -> dict[str, int]:
        """namespace -> bytes of the models on this node that count against its share."""
        held: dict[str, int] = {}
        with self.lock:
            for r in self.records.values():
                if not r.deleting and (self.present(r.key) or r.carried):
                    for ns in owners(r.entries):
                        held[ns] = held.get(ns, 0) + (r.bytes_total or 0)
        return held

    def _counted(self, key: str) -> int:
        """Bytes of ``key`` that ``used_bytes`` counts already (a carried copy being adopted)."""
        with self.lock:
            rec = self.records.get(key)
            return (rec.bytes_total or 0) if rec is not None and not rec.deleting and (
                self.present(key) or rec.carried) else 0

    def _cluster_pending(self) -> list[tuple[str, str, int]]:
        """(storage key, cache names, bytes) of the models cluster caches want here that are not
        here yet and whose size is known (listed once, even if refused for room)."""
        with self.lock:
            return [(r.key, ", ".join(sorted({e.model_name for e in r.entries if not e.namespace})), r.bytes_total)
                    for r in self.records.values()
                    if r.wanted and not r.deleting and r.bytes_total and not owners(r.entries)
                    and not (self.present(r.key) or r.carried)]

    def state_of(self, key: str) -> str | None:
        """The derived state of one storageKey (None: no record)."""
        with self.lock:
            rec = self.records.get(key)
            return rec.state(self.present(key)) if rec is not None else None

    def settled(self) -> bool:
        """Every model in the spec Downloaded or Error, nothing running, and nothing left to
        delete but what a pod still mounts (standalone's exit test)."""
        with self.lock:
            if not self.spec_seen.is_set():
                return False
            for rec in self.records.values():
                if rec.task is not None or rec.deleting:
                    return False
                if rec.wanted and rec.state(self.present(rec.key)) not in (MODEL_DOWNLOADED, MODEL_DOWNLOAD_ERROR):
                    return False
                if not rec.wanted and not rec.mounted_by:
                    return False
            return True


def _scheme(uri: str) -> str:
    try:
        return parse_uri(uri).kind
    except ModelcacheError:
        return "invalid"
