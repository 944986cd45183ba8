"""Serving PV ``<cache>-<group>-<namespace>`` and PVC ``<cache>-<group>`` (KServe's names).

One pair per (namespace, group) that has a service using the cache. The PV spec is the node
group's ``persistentVolumeSpec`` as is (its node affinity keeps pods on group nodes); the PVC
is the group's ``persistentVolumeClaimSpec`` bound to that PV by ``volumeName``. We label
both so we can find and remove exactly the ones we made, and a cluster cache owns them (the
garbage collector cleans up even if we never get to).
"""

from __future__ import annotations

import copy
from collections.abc import Iterable, Mapping
from dataclasses import dataclass
from typing import Any

from coordinator.urimatch import serving_pvc_name
from modelcache.kube.types import API_VERSION, NODEGROUP_ANNOTATION

MANAGED_BY_LABEL = "app.kubernetes.io/managed-by"
MANAGED_BY = "modelcache-coordinator"
CACHE_LABEL = "modelcache.io/cache"
CACHE_NAMESPACE_LABEL = "modelcache.io/cache-namespace"
GROUP_LABEL = "modelcache.io/node-group"
MANAGED_SELECTOR = f"{MANAGED_BY_LABEL}={MANAGED_BY}"


def serving_pv_name(cache: str, group: str, namespace: str) -> str:
    return f"{cache}-{group}-{namespace}"


@dataclass(frozen=True)
class Use:
    """One service using the cache: where it runs and which group it asked for."""

    namespace: str
    annotations: Mapping[str, str]


@dataclass(frozen=True)
class VolumePair:
    namespace: str
    group: str
    pv_name: str
    pvc_name: str


def group_for_use(cache_groups: tuple[str, ...] | list[str], annotations: Mapping[str, str]) -> str | None:
    """The annotation's group if the cache has it; None if it names another group (no volume,
    as KServe); the cache's first group without the annotation."""
    wanted = annotations.get(NODEGROUP_ANNOTATION)
    if wanted:
        return wanted if wanted in cache_groups else None
    return cache_groups[0] if cache_groups else None


def desired_pairs(
    cache: Mapping[str, Any], groups: Mapping[str, Any], uses: Iterable[Use]
) -> dict[tuple[str, str], VolumePair]:
    meta, spec = cache.get("metadata") or {}, cache.get("spec") or {}
    name, cache_ns = meta["name"], meta.get("namespace")
    cache_groups = list(spec.get("nodeGroups") or [])
    out: dict[tuple[str, str], VolumePair] = {}
    for use in uses:
        if cache_ns and use.namespace != cache_ns:
            continue  # a namespace cache serves only its own namespace
        group = group_for_use(cache_groups, use.annotations)
        if group is None or group not in groups:
            continue
        out[(use.namespace, group)] = VolumePair(
            use.namespace, group, serving_pv_name(name, group, use.namespace), serving_pvc_name(name, group)
        )
    return out


def _labels(cache: Mapping[str, Any], group: str) -> dict[str, str]:
    meta = cache.get("metadata") or {}
    labels = {MANAGED_BY_LABEL: MANAGED_BY, CACHE_LABEL: meta["name"], GROUP_LABEL: group}
    if meta.get("namespace"):
        labels[CACHE_NAMESPACE_LABEL] = meta["namespace"]
    return labels


def _owner(cache: Mapping[str, Any]) -> list[dict[str, Any]]:
    meta = cache.get("metadata") or {}
    if meta.get("namespace") or not meta.get("uid"):
        return []  # a cluster object cannot be owned by a namespaced one (KServe: none either)
    return [{
        "apiVersion": API_VERSION, "kind": cache.get("kind") or "LocalModelCache", "name": meta["name"],
        "uid": meta["uid"], "controller": True, "blockOwnerDeletion": True,
    }]


def pv_body(cache: Mapping[str, Any], group: Mapping[str, Any], pair: VolumePair) -> dict[str, Any]:
    meta: dict[str, Any] = {"name": pair.pv_name, "labels": _labels(cache, pair.group)}
    if owners := _owner(cache):
        meta["ownerReferences"] = owners
    spec = copy.deepcopy((group.get("spec") or {}).get("persistentVolumeSpec") or {})
    return {"metadata": meta, "spec": spec}


def pvc_body(cache: Mapping[str, Any], group: Mapping[str, Any], pair: VolumePair) -> dict[str, Any]:
    meta: dict[str, Any] = {"name": pair.pvc_name, "namespace": pair.namespace, "labels": _labels(cache, pair.group)}
    if owners := _owner(cache):
        meta["ownerReferences"] = owners
    spec = copy.deepcopy((group.get("spec") or {}).get("persistentVolumeClaimSpec") or {})
    spec["volumeName"] = pair.pv_name
    return {"metadata": meta, "spec": spec}


def cache_of(obj: Mapping[str, Any]) -> tuple[str | None, str] | None:
    """(cache namespace or None, cache name) a managed PV/PVC belongs to, from its labels."""
    labels = (obj.get("metadata") or {}).get("labels") or {}
    if labels.get(MANAGED_BY_LABEL) != MANAGED_BY or CACHE_LABEL not in labels:
        return None
    return labels.get(CACHE_NAMESPACE_LABEL) or None, labels[CACHE_LABEL]
