"""What the agent says about its models: the LocalModelNode status, its gauges, its progress lines.

Rendered from the agent's records every time (agent/state.py derives each state): nothing stored
here but what keeps the report steady (the free space last reported, when carried-over copies
were first seen). Reads the agent through ``Reported``, so it imports nothing of agent/core.py.
"""

from __future__ import annotations

import logging
import threading
from typing import Any, Protocol

from agent.capacity import Capacity, storage_limit_refusal
from agent.config import AgentConfig
from agent.logs import fields
from agent.metrics import AgentMetrics
from agent.ports import Ports
from agent.state import INTERRUPTED, UNVERIFIED, ModelRecord
from modelcache.kube.types import (
    MODEL_DOWNLOAD_ERROR,
    MODEL_DOWNLOAD_PENDING,
    MODEL_DOWNLOADED,
    Condition,
    LocalModelInfo,
    ModelCounts,
    NodeCapacity,
)
from modelcache.pull import staged_pulls
from modelcache.runtime.clock import rfc3339
from modelcache.runtime.progress import format_line
from modelcache.runtime.redact import scrub_urls
from modelcache.sources.uri import redact_uri
from modelcache.store import Manifest, NodeStore

log = logging.getLogger("agent")

#: Free space in the status changes only in steps of this size (the metric is exact).
FREE_REPORT_STEP = 1 << 30


class Reported(Protocol):
    """The agent as its report reads it (agent.core.Agent)."""

    cfg: AgentConfig
    store: NodeStore
    metrics: AgentMetrics
    capacity: Capacity
    ports: Ports
    lock: threading.RLock
    records: dict[str, ModelRecord]
    group_limits: dict[str, int]
    entry_verdicts: dict[tuple[str, str], str]
    generation: int | None
    refused: tuple[list[str], int | None, str] | None

    def present(self, key: str) -> bool: ...

    def used_bytes(self) -> int: ...


class Report:
    def __init__(self, agent: Reported) -> None:
        self.agent = agent
        self._last_free: int | None = None
        #: When the first model still carried over was seen (ModelsVerified's transition time).
        self._carried_since: str | None = None

    def status(self) -> dict[str, Any]:
        """Our part of ``LocalModelNode.status`` (without ``lastUpdated``), derived now."""
        agent = self.agent
        root_check = agent.ports.root_check
        model_status: dict[str, str] = {}
        details: dict[str, Any] = {}
        removing: dict[str, Any] = {}
        with agent.lock:
            keys = sorted({r.key for r in agent.records.values() if r.wanted})
            used = agent.used_bytes() if agent.group_limits else 0
            # An interrupted download keeps its staged bytes: its progress is shown, not dropped.
            paused = [r.key for r in agent.records.values() if r.task is None and r.note == INTERRUPTED]
            staged = {p.storage_key: p for p in staged_pulls(agent.store) if p.storage_key in paused} if paused else {}
            for rec in agent.records.values():
                state = rec.state(agent.present(rec.key))
                for info in rec.entries:
                    d = rec.detail(state)
                    if rec.key in staged and state != MODEL_DOWNLOADED:
                        d.bytes_done, d.bytes_total = staged[rec.key].bytes_done, staged[rec.key].bytes_total
                    verdict = agent.entry_verdicts.get((info.status_key, rec.key)) if info.namespace else ""
                    blocked = (root_check(info.node_group) if root_check and state == MODEL_DOWNLOADED
                               else None) or verdict
                    if blocked:
                        # Downloaded here, but not where the node group's PV points serving pods; or
                        # not for this namespace cache (its credentials).
                        d.state, d.message = MODEL_DOWNLOAD_ERROR, blocked
                    elif verdict is None and state == MODEL_DOWNLOADED:  # (set_spec judges an entry first)
                        d.state, d.message = MODEL_DOWNLOAD_PENDING, "checking the credentials it names"
                    over = self._group_refusal(rec, info, used) if state == MODEL_DOWNLOADED else None
                    if over and not blocked:
                        # Downloaded for another entry's group; this entry's own group has no room.
                        d.state, d.message = MODEL_DOWNLOAD_ERROR, f"InsufficientSpace: {over}"
                    model_status[info.status_key] = d.state
                    details[info.status_key] = {**d.to_dict(), **self._peer_fields(rec.key)}
                for info in rec.former:
                    d = rec.detail(state)
                    d.message = ("removed from the spec; kept while mounted by " + ", ".join(rec.mounted_by)
                                 if rec.mounted_by else "removed from the spec; deleting")
                    removing[info.status_key] = d.to_dict()
        for k, v in removing.items():
            details.setdefault(k, v)
        total, free = self._reported_free()
        cap = NodeCapacity(total_bytes=total, free_bytes=free, reserved_bytes=agent.capacity.reserved_bytes,
                           free=quantity(free))
        out: dict[str, Any] = {
            "modelStatus": model_status,
            "modelDetails": details,
            "capacity": cap.to_dict(),
            "modelCounts": ModelCounts.of(model_status).to_dict(),
        }
        if agent.generation is not None:
            out["observedGeneration"] = agent.generation
        conditions = self._verified_condition()
        if conditions:
            out["conditions"] = conditions
        if agent.refused is not None:
            problems, generation, since = agent.refused
            out.setdefault("conditions", []).append(Condition(
                type="SpecValid", status="False", reason="InvalidSpec", last_transition_time=since,
                observed_generation=generation,
                message=one_line(ValueError(f"{len(problems)} problem(s), nothing applied or deleted until "
                                            "they are fixed: " + "; ".join(problems))),
            ).to_dict())
        if agent.ports.peering is not None:
            out["peer"] = agent.ports.peering.status(keys)
        return out

    def _group_refusal(self, rec: ModelRecord, info: LocalModelInfo, used: int) -> str | None:
        """Why a downloaded model does not fit ``info``'s own node group (its storageLimit), or None.
        ``used``: bytes of every model on the node, this one included."""
        limit = self.agent.group_limits.get(info.node_group or "")
        size = rec.bytes_total or 0
        if limit is None or size <= max(0, limit - (used - size)):
            return None
        return storage_limit_refusal(redact_uri(rec.uri), size, limit, used - size, 0)

    def _verified_condition(self) -> list[dict[str, Any]]:
        """``ModelsVerified=False`` while copies are carried over (counted on KServe's word), naming
        them; absent otherwise. Its time is when the first of them was seen, so it is stable."""
        with self.agent.lock:
            carried = sorted((rec for rec in self.agent.records.values() if rec.wanted and rec.carried),
                             key=lambda r: names(r))
            if not carried:
                self._carried_since = None
                return []
            if self._carried_since is None:
                self._carried_since = rfc3339()
            unverified = [r for r in carried if r.verification == UNVERIFIED]
            verifying = [r for r in carried if r.verification != UNVERIFIED]
        parts = []
        if unverified:
            parts.append(f"{len(unverified)} unverified (the source cannot be listed): " + "; ".join(
                f"{names(r)}: {r.failure.reason if r.failure else ''}" for r in unverified[:10]))
        if verifying:
            parts.append(f"{len(verifying)} verifying in place: " + ", ".join(names(r) for r in verifying[:10]))
        return [Condition(
            type="ModelsVerified", status="False", reason="Unverified" if unverified else "Verifying",
            last_transition_time=self._carried_since,
            message=one_line(ValueError(f"{len(carried)} copies KServe's agent downloaded are counted as downloaded "
                                        "on its word: " + "; ".join(parts))),
        ).to_dict()]

    def _peer_fields(self, key: str) -> dict[str, Any]:
        peering = self.agent.ports.peering
        return peering.model_fields(key) if peering is not None else {}

    def _reported_free(self) -> tuple[int, int]:
        """Free bytes for the status, held until they move by ``FREE_REPORT_STEP`` (or 1% of the
        disk, if less): other writers on the file system must not turn every tick into a PATCH."""
        total, free = self.agent.capacity.disk()
        last = self._last_free
        if last is None or abs(free - last) >= min(FREE_REPORT_STEP, max(1, total // 100)):
            self._last_free = last = free
        return total, last

    def update_gauges(self, status: dict[str, Any]) -> None:
        """The state, disk and limit gauges, from a status just derived (``status()``): the
        status writer's, at once after a change and every --status-interval. The supervisor's
        tick derived a status of its own for them every 0.5 s, half of an idle agent's CPU."""
        agent = self.agent
        counts: dict[str, int] = {}
        for state in status["modelStatus"].values():
            counts[state] = counts.get(state, 0) + 1
        agent.metrics.set_states(counts)
        total, free = agent.capacity.disk()
        agent.metrics.free.set(free)
        agent.metrics.size.set(total)
        agent.metrics.reserved.set(agent.capacity.reserved_bytes)
        agent.metrics.stored.set(agent.used_bytes())
        with agent.lock:
            groups = {info.node_group for r in agent.records.values() for info in r.entries if info.node_group}
            drifted = sum(1 for r in agent.records.values() if r.wanted and r.drift)
        agent.metrics.set_limits({g: int(agent.group_limits[g]) for g in groups if g in agent.group_limits})
        agent.metrics.drifted.set(drifted)

    def log_progress(self, now: float) -> None:
        """One progress line per download every few seconds, the first as soon as its size is known."""
        every = max(2.0, self.agent.cfg.status_interval)
        with self.agent.lock:
            active = [(r, r.task) for r in self.agent.records.values() if r.task is not None
                      and now - r.last_progress_log >= every]
        for rec, task in active:
            snap = task.progress.snapshot()
            if not snap.bytes_total:
                continue  # still listing
            rec.last_progress_log = now
            log.info("progress " + format_line(snap), extra=fields(
                storage_key=rec.key, bytes_done=snap.bytes_done, bytes_total=snap.bytes_total,
                rate=int(snap.rate)))


def names(rec: ModelRecord) -> str:
    """The entries a model's status, events and logs name (its storageKey when none wants it)."""
    return ", ".join(i.status_key for i in rec.entries) or rec.key


def one_line(exc: BaseException | None) -> str:
    """What status, events and logs say about an error: one line, every URL in it redacted (an
    SDK's own exception may quote a signed URL)."""
    text = str(exc) if exc is not None else "failed"
    return scrub_urls(" ".join(text.split()))[:500] or type(exc).__name__


def seconds(delay: float) -> str:
    """A backoff as people read it: 0.5s, 2s, 1m30s (was "0s" for any delay under half a second)."""
    if delay < 10:
        return f"{delay:.1f}".rstrip("0").rstrip(".") + "s"
    minutes, secs = divmod(round(delay), 60)
    return f"{minutes}m{secs:02d}s" if minutes else f"{secs}s"


def quantity(n: int) -> str:
    """Bytes as a Kubernetes-style quantity for ``kubectl get`` (``12Gi``)."""
    for suffix, size in (("Ti", 1 << 40), ("Gi", 1 << 30), ("Mi", 1 << 20), ("Ki", 1 << 10)):
        if n >= size:
            return f"{n // size}{suffix}"
    return str(n)


def unverified_note(manifest: Manifest | None) -> str:
    """The status note of a model adopted with files kept on their size alone (modelcache.adopt)."""
    n = len(manifest.unverified) if manifest is not None else 0
    return (f"unverified: {n} file(s) adopted on their size alone (the source gives no checksum; "
            "`modelcache pull --refresh` on the node fetches them again)") if n else ""
