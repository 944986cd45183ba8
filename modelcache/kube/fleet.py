"""`modelcache status`: the fleet at a glance, read from the objects the agents and the coordinator
already write (no metrics server needed): per cache its copies by node group and its services, per
node its free space and models, what is in flight with rate and ETA, and every failure with its
one-line cause. ``build`` is pure (lists of objects in, a Fleet out); ``gather`` lists them."""

from __future__ import annotations

from dataclasses import asdict, dataclass, field
from typing import Any

from modelcache.kube.client import LOCAL_MODEL_CACHES, LOCAL_MODEL_NAMESPACE_CACHES, LOCAL_MODEL_NODES, Kube
from modelcache.kube.objects import meta, namespaced_key
from modelcache.kube.types import (
    MODEL_DOWNLOAD_ERROR,
    MODEL_DOWNLOADED,
    MODEL_DOWNLOADING,
)
from modelcache.kube.views import CacheView, LocalModelNodeView
from modelcache.runtime.progress import human_bytes, human_duration

Obj = dict[str, Any]


@dataclass
class GroupCopies:
    group: str
    downloaded: int = 0
    nodes: int = 0


@dataclass
class CacheRow:
    key: str  # name, or namespace/name for a LocalModelNamespaceCache
    source: str
    size: str
    available: int
    total: int
    failed: int
    groups: list[GroupCopies]
    services: list[str]


@dataclass
class ModelOnNode:
    model: str  # the status key: cache name, or namespace/name
    state: str
    bytes_done: int | None = None
    bytes_total: int | None = None
    rate: int | None = None
    eta_seconds: float | None = None
    message: str | None = None
    drift: str | None = None

    @property
    def percent(self) -> float | None:
        return 100 * (self.bytes_done or 0) / self.bytes_total if self.bytes_total else None


@dataclass
class NodeRow:
    node: str
    groups: list[str]
    free_bytes: int | None
    total_bytes: int | None
    models: list[ModelOnNode]
    updated: str | None

    def count(self, state: str) -> int:
        return sum(1 for m in self.models if m.state == state)


@dataclass
class Failure:
    node: str
    model: str
    message: str


@dataclass
class Fleet:
    caches: list[CacheRow] = field(default_factory=list)
    nodes: list[NodeRow] = field(default_factory=list)
    failures: list[Failure] = field(default_factory=list)

    def to_dict(self) -> dict[str, Any]:
        return asdict(self)


def _eta(done: int | None, total: int | None, rate: int | None) -> float | None:
    if not total or not rate or done is None:
        return None
    return max(0.0, (total - done) / rate)


def build(caches: list[Obj], nodes: list[Obj]) -> Fleet:
    """The fleet from LocalModelCaches and LocalModelNamespaceCaches (``caches``) and LocalModelNodes."""
    fleet = Fleet()
    # Which node holds which cache for which group: the LocalModelNodes' spec entries and status.
    by_cache: dict[str, dict[str, GroupCopies]] = {}
    # Failed copies are counted from the same LocalModelNodes as the FAILURES section, not taken from
    # the cache's paced status: an agent retrying a failed download flips between ModelDownloading
    # and ModelDownloadError, and one snapshot must not show a failure under FAILURES and none in its row.
    failed: dict[str, int] = {}
    for n in sorted(nodes, key=lambda o: meta(o).name):
        lmn = LocalModelNodeView(n)
        name, states = lmn.meta.name, lmn.model_status
        groups: list[str] = []
        models = []
        for entry in lmn.entries:
            key = entry.key
            group = entry.node_group or "-"
            if group not in groups:
                groups.append(group)
            state = states.get(key) or "Unknown"
            copies = by_cache.setdefault(key, {}).setdefault(group, GroupCopies(group))
            copies.nodes += 1
            copies.downloaded += state == MODEL_DOWNLOADED
            d = lmn.detail(key)
            done, total, rate = d.get("bytesDone"), d.get("bytesTotal"), d.get("rate")
            models.append(ModelOnNode(key, state, done, total, rate if state == MODEL_DOWNLOADING else None,
                                      _eta(done, total, rate) if state == MODEL_DOWNLOADING else None,
                                      d.get("message"), d.get("drift")))
            if state == MODEL_DOWNLOAD_ERROR:
                failed[key] = failed.get(key, 0) + 1
                fleet.failures.append(Failure(name, key, d.get("message") or "download failed"))
        capacity = lmn.capacity
        fleet.nodes.append(NodeRow(name, groups, capacity.get("freeBytes"), capacity.get("totalBytes"), models,
                                   lmn.last_updated))
    for c in sorted(caches, key=lambda o: (meta(o).namespace or "", meta(o).name)):
        cache = CacheView(c)
        key, counts = cache.key, cache.copies
        per_group = by_cache.get(key, {})
        for g in cache.node_groups:
            per_group.setdefault(g, GroupCopies(g))
        services = [namespaced_key(s.get("namespace"), str(s.get("name") or ""))
                    for s in cache.status.get("inferenceServices") or []]
        fleet.caches.append(CacheRow(key, cache.source_model_uri, str(cache.spec.get("modelSize", "")),
                                     int(counts.get("available") or 0), int(counts.get("total") or 0),
                                     failed.get(key, 0), [per_group[g] for g in sorted(per_group)],
                                     services))
    return fleet


def gather(kube: Kube) -> Fleet:
    caches = kube.list(LOCAL_MODEL_CACHES)["items"] + kube.list(LOCAL_MODEL_NAMESPACE_CACHES)["items"]
    return build(caches, kube.list(LOCAL_MODEL_NODES)["items"])


def _table(header: list[str], rows: list[list[str]]) -> list[str]:
    widths = [max(len(r[i]) for r in [header, *rows]) for i in range(len(header))]
    return ["  ".join(cell.ljust(w) for cell, w in zip(r, widths, strict=True)).rstrip() for r in [header, *rows]]


def _in_flight(m: ModelOnNode) -> str:
    pct = f"{m.percent:.0f}%" if m.percent is not None else "listing"
    rate = f" {human_bytes(m.rate)}/s" if m.rate else ""
    eta = f" eta {human_duration(m.eta_seconds)}" if m.eta_seconds is not None else ""
    return f"{m.model} {pct}{rate}{eta}"


def render(fleet: Fleet) -> str:
    """What a person reads: three tables, then the failures, one line each."""
    out = [f"CACHES ({len(fleet.caches)})"]
    if fleet.caches:
        out += _table(["CACHE", "COPIES", "BY NODE GROUP", "SIZE", "SERVICES", "SOURCE"], [
            [c.key, f"{c.available}/{c.total}" + (f" ({c.failed} failed)" if c.failed else ""),
             ", ".join(f"{g.group} {g.downloaded}/{g.nodes}" for g in c.groups) or "-", c.size or "-",
             str(len(c.services)), c.source] for c in fleet.caches])
    else:
        out.append("no LocalModelCache or LocalModelNamespaceCache")
    out += ["", f"NODES ({len(fleet.nodes)})"]
    if fleet.nodes:
        out += _table(["NODE", "GROUPS", "FREE", "MODELS", "IN FLIGHT"], [
            [n.node, ",".join(n.groups) or "-",
             f"{human_bytes(n.free_bytes)} of {human_bytes(n.total_bytes)}" if n.free_bytes is not None
             and n.total_bytes else "?",
             f"{n.count(MODEL_DOWNLOADED)}/{len(n.models)} downloaded",
             "; ".join(_in_flight(m) for m in n.models if m.state == MODEL_DOWNLOADING) or "-"]
            for n in fleet.nodes])
    else:
        out.append("no LocalModelNode (no cache placed on a node yet)")
    drifted = [(n.node, m) for n in fleet.nodes for m in n.models if m.drift]
    if drifted:
        out += ["", f"DRIFTED ({len(drifted)})"]
        out += [f"{node}  {m.model}  {m.drift}" for node, m in drifted]
    out += ["", f"FAILURES ({len(fleet.failures)})"]
    out += [f"{f.node}  {f.model}  {f.message}" for f in fleet.failures] or ["none"]
    return "\n".join(out)
