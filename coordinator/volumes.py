"""Serving PV ``<cache>-<group>-<namespace>`` and PVC ``<cache>-<group>`` (KServe's names).

One pair per (namespace, group) that has a service using the cache. The PV spec is the node
group's ``persistentVolumeSpec`` as is (its node affinity keeps pods on group nodes); the PVC
is the group's ``persistentVolumeClaimSpec`` bound to that PV by ``volumeName``. We label
both so we can find and remove exactly the ones we made, and a cluster cache owns them (the
garbage collector cleans up even if we never get to).
"""

from __future__ import annotations

import copy
import hashlib
from collections.abc import Iterable, Mapping
from dataclasses import dataclass
from typing import Any

from coordinator.urimatch import serving_pvc_name
from modelcache.kube.objects import meta
from modelcache.kube.types import API_VERSION, NODEGROUP_ANNOTATION, label_value
from modelcache.kube.views import CacheView
from modelcache.sources.uri import storage_key

MANAGED_BY_LABEL = "app.kubernetes.io/managed-by"
MANAGED_BY = "modelcache-coordinator"
CACHE_LABEL = "modelcache.io/cache"
CACHE_NAMESPACE_LABEL = "modelcache.io/cache-namespace"
GROUP_LABEL = "modelcache.io/node-group"
#: The storage key of the cache's model: deploy/policies/serving-volumes.yaml holds every mount of a
#: serving claim to read-only models/<this key> (a tenant reads its own models, writes none).
STORAGE_KEY_LABEL = "modelcache.io/storage-key"
#: The cache's whole name: the labels hold names of up to 63 characters, longer ones hashed.
CACHE_ANNOTATION = "modelcache.io/cache"
MANAGED_SELECTOR = f"{MANAGED_BY_LABEL}={MANAGED_BY}"
MAX_NAME = 253


def serving_pv_name(cache: str, group: str, namespace: str) -> str:
    """KServe's name, or, where that would pass the 253 characters of an object name, the same
    shortened with a hash (KServe's PV creation fails then)."""
    name = f"{cache}-{group}-{namespace}"
    if len(name) <= MAX_NAME:
        return name
    return f"{name[:MAX_NAME - 17].rstrip('-.')}-{hashlib.sha256(name.encode()).hexdigest()[:16]}"


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
    view = CacheView(cache)
    name, cache_ns = view.meta.name, view.meta.namespace
    cache_groups = view.node_groups
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
    view = CacheView(cache)
    m = view.meta
    labels = {MANAGED_BY_LABEL: MANAGED_BY, CACHE_LABEL: label_value(m.name), GROUP_LABEL: label_value(group),
              STORAGE_KEY_LABEL: storage_key(view.source_model_uri)}
    if m.namespace:
        labels[CACHE_NAMESPACE_LABEL] = m.namespace
    return labels


def _meta(cache: Mapping[str, Any], pair: VolumePair, namespaced: bool) -> dict[str, Any]:
    out: dict[str, Any] = {"name": pair.pvc_name if namespaced else pair.pv_name,
                           "labels": _labels(cache, pair.group),
                           "annotations": {CACHE_ANNOTATION: meta(cache).name}}
    if namespaced:
        out["namespace"] = pair.namespace
    if owners := _owner(cache):
        out["ownerReferences"] = owners
    return out


def _owner(cache: Mapping[str, Any]) -> list[dict[str, Any]]:
    m = meta(cache)
    if m.namespace or not m.uid:
        return []  # a cluster object cannot be owned by a namespaced one (KServe: none either)
    return [{
        "apiVersion": API_VERSION, "kind": cache.get("kind") or "LocalModelCache", "name": m.name,
        "uid": m.uid, "controller": True, "blockOwnerDeletion": True,
    }]


def pv_body(cache: Mapping[str, Any], group: Mapping[str, Any], pair: VolumePair) -> dict[str, Any]:
    """The group's PV spec, pre-bound to our claim (``claimRef``): no other Pending claim of the
    same class can take it first."""
    spec = copy.deepcopy((group.get("spec") or {}).get("persistentVolumeSpec") or {})
    spec["claimRef"] = {"apiVersion": "v1", "kind": "PersistentVolumeClaim", "namespace": pair.namespace,
                        "name": pair.pvc_name}
    return {"metadata": _meta(cache, pair, namespaced=False), "spec": spec}


def pvc_body(cache: Mapping[str, Any], group: Mapping[str, Any], pair: VolumePair) -> dict[str, Any]:
    """The group's PVC spec bound to our PV by name, with the PV's storage class: a claim that
    names none would get the cluster's default class at admission and never match the PV."""
    group_spec = group.get("spec") or {}
    spec = copy.deepcopy(group_spec.get("persistentVolumeClaimSpec") or {})
    spec["volumeName"] = pair.pv_name
    if spec.get("storageClassName") is None:
        spec["storageClassName"] = (group_spec.get("persistentVolumeSpec") or {}).get("storageClassName") or ""
    return {"metadata": _meta(cache, pair, namespaced=True), "spec": spec}


def cache_of(obj: Mapping[str, Any]) -> tuple[str | None, str] | None:
    """(cache namespace or None, cache name) a managed PV/PVC belongs to (the whole name from our
    annotation; volumes made before it was written carry the name in their label)."""
    m = meta(obj)
    labels = m.labels
    if labels.get(MANAGED_BY_LABEL) != MANAGED_BY or CACHE_LABEL not in labels:
        return None
    name = m.annotations.get(CACHE_ANNOTATION) or labels[CACHE_LABEL]
    return labels.get(CACHE_NAMESPACE_LABEL) or None, name
