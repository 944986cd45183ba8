"""Serving-pod mutation: place the pod only where its model is complete, and (optionally) mount it.

Placement: a required node-affinity expression ``downloaded.modelcache.io/<storageKey> Exists``
ANDed into every existing required term (terms are ORed, so adding it to each keeps the user's
constraints and adds ours). A pod then never lands on a group node whose download failed or is
still running (kserve#4681); it stays Pending until a copy is ready.

Rewrite (for clusters without KServe's pod mutator): KServe's local-model rewrite: volume
``kserve-pvc-source`` from the cache PVC, mounted at ``/mnt/models`` with subPath
``models/<storageKey><sub-path>``, read-only unless ``storage.kserve.io/readonly: "false"``,
no storage-initializer, ``STORAGE_URI`` pointed at ``/mnt/models``.
"""

from __future__ import annotations

import copy
from dataclasses import dataclass
from typing import Any

from coordinator.nodelabels import model_label
from modelcache.kube.objects import meta
from modelcache.sources.uri import storage_key

PVC_VOLUME = "kserve-pvc-source"
MOUNT_PATH = "/mnt/models"
STORAGE_INITIALIZER = "storage-initializer"
READONLY_ANNOTATION = "storage.kserve.io/readonly"
SOURCE_URI_ANNOTATION = "internal.serving.kserve.io/storage-initializer-sourceuri"
#: Containers that get the model mount (KServe: the predictor or worker, and the transformer).
MODEL_CONTAINERS = ("kserve-container", "worker-container", "transformer-container")


@dataclass(frozen=True)
class PodTarget:
    cache_uri: str
    pvc_name: str
    sub_path: str = ""  # "" or "/a/b"

    @property
    def label(self) -> str:
        return model_label(self.cache_uri)

    @property
    def mount_sub_path(self) -> str:
        return f"models/{storage_key(self.cache_uri)}{self.sub_path}"


def add_placement(pod: dict[str, Any], label: str) -> None:
    expr = {"key": label, "operator": "Exists"}
    spec = pod.setdefault("spec", {})
    affinity = spec.setdefault("affinity", {}) or {}
    spec["affinity"] = affinity
    node_aff = affinity.setdefault("nodeAffinity", {})
    required = node_aff.setdefault("requiredDuringSchedulingIgnoredDuringExecution", {})
    terms = required.setdefault("nodeSelectorTerms", [])
    if not terms:
        terms.append({"matchExpressions": []})
    for term in terms:
        exprs = term.setdefault("matchExpressions", [])
        if expr not in exprs:
            exprs.append(dict(expr))


def add_cache_mount(pod: dict[str, Any], target: PodTarget) -> None:
    annotations = meta(pod).annotations
    read_only = annotations.get(READONLY_ANNOTATION) != "false"
    spec = pod.setdefault("spec", {})
    volumes = spec.setdefault("volumes", [])
    if not any(v.get("name") == PVC_VOLUME for v in volumes):
        volumes.append({"name": PVC_VOLUME, "persistentVolumeClaim": {"claimName": target.pvc_name,
                                                                       "readOnly": read_only}})
    mount = {"name": PVC_VOLUME, "mountPath": MOUNT_PATH, "subPath": target.mount_sub_path, "readOnly": read_only}
    for container in spec.get("containers") or []:
        if container.get("name") not in MODEL_CONTAINERS:
            continue
        mounts = container.setdefault("volumeMounts", [])
        if not any(m.get("mountPath") == MOUNT_PATH for m in mounts):
            mounts.append(dict(mount))
        for env in container.get("env") or []:
            if env.get("name") == "STORAGE_URI" and env.get("value"):
                env["value"] = MOUNT_PATH
    inits = [c for c in spec.get("initContainers") or [] if c.get("name") != STORAGE_INITIALIZER]
    if inits:
        spec["initContainers"] = inits
    else:
        spec.pop("initContainers", None)


def mutate(pod: dict[str, Any], target: PodTarget, rewrite: bool) -> dict[str, Any]:
    out = copy.deepcopy(pod)
    add_placement(out, target.label)
    if rewrite:
        add_cache_mount(out, target)
    return out


def escape_pointer(key: str) -> str:
    """A key as one JSON Pointer segment (RFC 6901)."""
    return key.replace("~", "~0").replace("/", "~1")


def json_patch(old: dict[str, Any], new: dict[str, Any]) -> list[dict[str, Any]]:
    """RFC 6902 ops turning ``old`` into ``new`` at the level of ``spec`` members."""
    ops: list[dict[str, Any]] = []
    old_spec, new_spec = old.get("spec") or {}, new.get("spec") or {}
    for key in sorted(old_spec.keys() - new_spec.keys()):
        ops.append({"op": "remove", "path": f"/spec/{escape_pointer(key)}"})
    for key in sorted(new_spec):
        if old_spec.get(key) != new_spec[key] or key not in old_spec:
            ops.append({"op": "add", "path": f"/spec/{escape_pointer(key)}", "value": new_spec[key]})
    return ops
