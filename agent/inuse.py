"""Removal safety: which pods on this node still mount a model folder.

A serving pod reads a cached model through a PVC bound to its node group's PV (whose local
path is this agent's root), with a volume mount ``subPath: models/<storageKey>[/...]``. A model
that left the spec is deleted only when no pod on this node that is not finished mounts it.
"""

from __future__ import annotations

import logging
from collections.abc import Iterable
from typing import Protocol

from agent.hostpath import RootPaths, pv_root
from modelcache.kube.client import PERSISTENT_VOLUME_CLAIMS, PERSISTENT_VOLUMES, PODS, Kube
from modelcache.kube.objects import meta, namespaced_key

log = logging.getLogger(__name__)

FINISHED_PHASES = ("Succeeded", "Failed")


class MountChecker(Protocol):
    def users(self, keys: Iterable[str]) -> dict[str, list[str]]:
        """storageKey -> ``namespace/pod`` names that mount it (only keys with users)."""
        ...


class NoMounts:
    """Standalone mode: no pods, nothing mounts anything."""

    def users(self, keys: Iterable[str]) -> dict[str, list[str]]:
        return {}


def subpath_key(sub_path: str) -> str | None:
    parts = [p for p in sub_path.strip("/").split("/") if p]
    return parts[1] if len(parts) >= 2 and parts[0] == "models" else None


class KubeMountChecker:
    """Live reads (pods by ``spec.nodeName``, their PVCs and PVs): only called while a removal waits.

    ``paths`` knows the root's host path as PVs name it (the group PVs' ``local.path``); a PV with
    another path holds other data, so its mounts do not count. An unknown host path counts every
    PV (the safe side), and while a node group names another path nothing can be told: ``users``
    raises and the agent keeps every model.
    """

    def __init__(self, kube: Kube, node: str, paths: RootPaths | None = None) -> None:
        self.kube, self.node = kube, node
        self.paths = paths or RootPaths(None)
        self.pv_paths: set[str] = set()

    def _pv_counts(self, namespace: str, claim: str, cache: dict[tuple[str, str], bool]) -> bool:
        if (namespace, claim) in cache:
            return cache[(namespace, claim)]
        result = True  # unknown: keep the model
        pvc = self.kube.get_or_none(PERSISTENT_VOLUME_CLAIMS, claim, namespace)
        volume = ((pvc or {}).get("spec") or {}).get("volumeName")
        if pvc is not None and volume and self.pv_paths:
            pv = self.kube.get_or_none(PERSISTENT_VOLUMES, volume)
            if pv is not None:
                result = pv_root(pv.get("spec") or {}) in self.pv_paths
        cache[(namespace, claim)] = result
        return result

    def users(self, keys: Iterable[str]) -> dict[str, list[str]]:
        wanted = set(keys)
        if not wanted:
            return {}
        self.pv_paths = self.paths.pv_paths()
        # resourceVersion 0: served from the API server's watch cache (indexed by node), not etcd.
        pods = self.kube.list(PODS, None, field_selector=f"spec.nodeName={self.node}",
                              resource_version="0").get("items") or []
        out: dict[str, list[str]] = {}
        cache: dict[tuple[str, str], bool] = {}
        for pod in pods:
            if ((pod.get("status") or {}).get("phase")) in FINISHED_PHASES:
                continue
            m, spec = meta(pod), pod.get("spec") or {}
            ns = m.namespace or "default"
            claims = {v["name"]: v["persistentVolumeClaim"]["claimName"] for v in spec.get("volumes") or []
                      if (v.get("persistentVolumeClaim") or {}).get("claimName")}
            containers = [*(spec.get("initContainers") or []), *(spec.get("containers") or [])]
            for c in containers:
                for mount in c.get("volumeMounts") or []:
                    claim = claims.get(mount.get("name"))
                    key = subpath_key(mount.get("subPath") or "")
                    if claim is None or key not in wanted:
                        continue
                    if self._pv_counts(ns, claim, cache):
                        users = out.setdefault(key, [])
                        name = namespaced_key(ns, m.name)
                        if name not in users:
                            users.append(name)
        return out
