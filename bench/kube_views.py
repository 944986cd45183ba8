#!/usr/bin/env python3
"""Benchmark: reading Kubernetes objects through the typed views against the dict paths they replaced.

The coordinator reads every Node and LocalModelNode of the cluster on each membership pass, and
the informers key every event; so ``meta(obj)`` and the kind views (``modelcache.kube.objects``,
``modelcache.kube.views``) must cost about what the hand-written dict paths cost. This reads the
same fields four ways, side by side, over N Node-like and LocalModelNode-like objects shaped as
the coordinator's informers keep them (12 labels, a Ready condition, 4 entries with their states):

- ``dict``: the dict paths the code had (``(obj.get("metadata") or {}).get("name", "")``, ...): the peer;
- ``copy``: the first ``meta()``, a frozen dataclass built from a copy of the nine fields and both maps;
- ``meta``: ``meta()`` as it is (reading in place), the spec and status by the dict paths;
- ``view``: ``meta()`` and the kind views (modelcache.kube.views) for everything.

It prints, per way, the best of ``--rounds`` runs in microseconds per object and the ratio to ``dict``.

    .venv/bin/python bench/kube_views.py                 # 10,000 objects, 5 rounds
    .venv/bin/python bench/kube_views.py --objects 2000 --rounds 3
"""

from __future__ import annotations

import argparse
import os
import sys
import time
from collections.abc import Callable, Mapping
from dataclasses import dataclass, field
from typing import Any

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from modelcache.kube.objects import meta
from modelcache.kube.views import LocalModelNodeView, NodeView


@dataclass(frozen=True)
class CopiedMeta:
    """The first ``Meta``: every field copied out of the object when it is made."""

    name: str = ""
    namespace: str | None = None
    uid: str = ""
    generation: int = 0
    resource_version: str = ""
    labels: Mapping[str, str] = field(default_factory=dict)
    annotations: Mapping[str, str] = field(default_factory=dict)
    deletion_timestamp: str | None = None
    finalizers: tuple[str, ...] = ()


def copied_meta(obj: Mapping[str, Any] | None) -> CopiedMeta:
    raw = (obj or {}).get("metadata") or {}
    return CopiedMeta(name=str(raw.get("name") or ""), namespace=raw.get("namespace") or None,
                      uid=str(raw.get("uid") or ""), generation=int(raw.get("generation") or 0),
                      resource_version=str(raw.get("resourceVersion") or ""), labels=dict(raw.get("labels") or {}),
                      annotations=dict(raw.get("annotations") or {}),
                      deletion_timestamp=raw.get("deletionTimestamp") or None,
                      finalizers=tuple(raw.get("finalizers") or ()))


def objects(n: int) -> tuple[list[dict[str, Any]], list[dict[str, Any]]]:
    nodes, lmns = [], []
    for i in range(n):
        labels = {f"topology.example.com/l{j}": f"v{j}" for j in range(11)} | {"gpu": "a100"}
        nodes.append({"metadata": {"name": f"node-{i}", "uid": f"uid-{i}", "resourceVersion": str(i),
                                   "labels": labels},
                      "status": {"conditions": [{"type": "Ready", "status": "True"}]}})
        entries = [{"modelName": f"m{j}", "sourceModelUri": f"s3://b/m{j}", "nodeGroup": "g"} for j in range(4)]
        lmns.append({"metadata": {"name": f"node-{i}", "uid": f"u-{i}", "resourceVersion": str(i)},
                     "spec": {"localModels": entries},
                     "status": {"modelStatus": {f"m{j}": "ModelDownloaded" for j in range(4)}, "nodeUID": f"uid-{i}"}})
    return nodes, lmns


# Each way reads, per Node: name, uid, labels, Ready; per LocalModelNode: name, each entry's key, URI
# and state, and the nodeUID (what coordinator.membership, coordinator.reports and nodelabels read).
def _spec_and_status_by_dict(node: dict[str, Any], lmn: dict[str, Any]) -> int:
    seen = 0
    for cond in (node.get("status") or {}).get("conditions") or []:
        if cond.get("type") == "Ready":
            seen += cond.get("status") == "True"
            break
    status = lmn.get("status") or {}
    states = status.get("modelStatus") or {}
    for e in (lmn.get("spec") or {}).get("localModels") or []:
        ns, name = e.get("namespace") or None, e.get("modelName", "")
        key = f"{ns}/{name}" if ns else name
        seen += len(str(e.get("sourceModelUri") or "")) + (states.get(key) is not None)
    return seen + len(status.get("nodeUID") or "")


def by_dict(node: dict[str, Any], lmn: dict[str, Any]) -> int:
    md = node.get("metadata") or {}
    seen = len(str(md.get("name", ""))) + len(md.get("uid") or "") + len(md.get("labels") or {})
    seen += len(str((lmn.get("metadata") or {}).get("name", "")))
    return seen + _spec_and_status_by_dict(node, lmn)


def by_copy(node: dict[str, Any], lmn: dict[str, Any]) -> int:
    m = copied_meta(node)
    seen = len(m.name) + len(m.uid) + len(m.labels) + len(copied_meta(lmn).name)
    return seen + _spec_and_status_by_dict(node, lmn)


def by_meta(node: dict[str, Any], lmn: dict[str, Any]) -> int:
    m = meta(node)
    seen = len(m.name) + len(m.uid) + len(m.labels) + len(meta(lmn).name)
    return seen + _spec_and_status_by_dict(node, lmn)


def by_view(node: dict[str, Any], lmn: dict[str, Any]) -> int:
    m, nv = meta(node), NodeView(node)
    seen = len(m.name) + len(m.uid) + len(nv.labels) + nv.ready
    view = LocalModelNodeView(lmn)
    seen += len(view.meta.name)
    states = view.model_status
    for e in view.entries:
        seen += len(e.source_model_uri) + (states.get(e.key) is not None)
    return seen + len(view.node_uid or "")


def best(way: Callable[[dict[str, Any], dict[str, Any]], int], nodes: list[dict[str, Any]],
         lmns: list[dict[str, Any]], rounds: int) -> tuple[float, int]:
    times, total = [], 0
    for _ in range(rounds):
        start = time.perf_counter()
        total = sum(way(n, lmn) for n, lmn in zip(nodes, lmns, strict=True))
        times.append(time.perf_counter() - start)
    return min(times), total


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--objects", type=int, default=10_000)
    parser.add_argument("--rounds", type=int, default=5)
    args = parser.parse_args()
    nodes, lmns = objects(args.objects)
    print(f"load before: {os.getloadavg()[0]:.2f}; {args.objects:,} Nodes + LocalModelNodes, best of {args.rounds}")
    results = {}
    for label, way in (("dict", by_dict), ("copy", by_copy), ("meta", by_meta), ("view", by_view)):
        results[label] = best(way, nodes, lmns, args.rounds)
    if len({total for _t, total in results.values()}) != 1:
        print("the ways read different values:", {k: v[1] for k, v in results.items()})
        return 1
    base = results["dict"][0]
    for label, (seconds, _total) in results.items():
        print(f"{label:5} {seconds / args.objects * 1e6:7.2f} us per Node + LocalModelNode   x{seconds / base:.2f}")
    print(f"load after: {os.getloadavg()[0]:.2f}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
