"""Reconciler for Nodes (key: node name).

* A deleted node's LocalModelNode is deleted (KServe orphans it, kserve#6159); the cache
  reconcilers, woken by the same event, drop the node from every cache's status.
* The node carries ``downloaded.modelcache.io/<storageKey>`` exactly for the models its
  agent reports ModelDownloaded (the pod webhook places serving pods by these labels).
* Entries whose cache no longer exists are removed (a cache deleted while an entry was being
  written must not leave the agent holding its files forever).
"""

from __future__ import annotations

import logging
from typing import Any

from coordinator import entries, metrics, nodelabels
from coordinator.view import ClusterView, cache_key
from modelcache.kube.client import LOCAL_MODEL_NODES, NODES
from modelcache.kube.controller import Result
from modelcache.kube.status import update_if_changed

log = logging.getLogger(__name__)


class NodeReconciler:
    name = "node"

    def __init__(self, view: ClusterView) -> None:
        self.view = view
        self.kube = view.kube

    def __call__(self, key: str) -> Result:
        node = self.view.nodes.store.get(key)
        lmn = self.view.lmns.store.get(key)
        if node is None:
            if lmn is not None:
                metrics.WRITES.labels("LocalModelNode", "delete").inc()
                self.kube.delete(LOCAL_MODEL_NODES, key)
                log.info("node %s is gone: deleted its LocalModelNode", key)
            return Result()
        if lmn is not None:
            self._drop_orphans(key, lmn)
        patch = nodelabels.label_patch(node, nodelabels.downloaded_labels(lmn))
        if patch:
            metrics.WRITES.labels("Node", "patch").inc()
            self.kube.patch(NODES, key, patch)
        return Result()

    def _drop_orphans(self, key: str, lmn: dict[str, Any]) -> None:
        models = (lmn.get("spec") or {}).get("localModels") or []
        known = set(self.view.cache_keys())
        orphans = [m for m in models if cache_key(m.get("namespace") or None, m.get("modelName", "")) not in known]
        if not orphans:
            return

        def drop(o: dict[str, Any]) -> None:
            spec = o.setdefault("spec", {})
            kept = spec.get("localModels") or []
            for m in orphans:
                kept = entries.remove(kept, m.get("modelName", ""), m.get("namespace") or None)
            spec["localModels"] = kept

        metrics.wrote("LocalModelNode", "update",
                      update_if_changed(self.kube, LOCAL_MODEL_NODES, key, drop, current=lmn))
        log.info("node %s: removed entries of deleted caches: %s", key,
                 ", ".join(cache_key(m.get("namespace"), m.get("modelName", "")) for m in orphans))
