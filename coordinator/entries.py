"""The cache's entry in each member's LocalModelNode, with KServe's exact fields.

Entries are plain dicts so that fields written by others (a newer KServe, our agent's
additions) survive; an entry is identified by (``modelName``, ``namespace``), with an empty
namespace meaning a cluster cache, as KServe matches them.
"""

from __future__ import annotations

import copy
from collections.abc import Mapping
from typing import Any

from modelcache.kube.views import CacheView

#: Fields whose difference makes the entry be replaced (KServe's list, plus the URI).
COMPARED = ("sourceModelUri", "serviceAccountName", "nodeGroup", "storage")


def desired_entry(cache: Mapping[str, Any], node_group: str) -> dict[str, Any]:
    view = CacheView(cache)
    m, spec = view.meta, view.spec
    entry: dict[str, Any] = {"modelName": m.name, "sourceModelUri": view.source_model_uri}
    if m.namespace:
        entry["namespace"] = m.namespace

    entry["nodeGroup"] = node_group
    if spec.get("serviceAccountName"):
        entry["serviceAccountName"] = spec["serviceAccountName"]
    if spec.get("storage"):
        entry["storage"] = copy.deepcopy(spec["storage"])
    return entry


def same_entry(entry: Mapping[str, Any], model_name: str, namespace: str | None) -> bool:
    return entry.get("modelName") == model_name and (entry.get("namespace") or None) == (namespace or None)


def has(models: list[dict[str, Any]], model_name: str, namespace: str | None) -> bool:
    return any(same_entry(m, model_name, namespace) for m in models)
