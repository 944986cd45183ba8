"""Where the model root is on the host, and whether the node groups' PVs name the same place.

Serving pods read a model through their node group's PV (``local.path`` or ``hostPath.path``);
the agent writes it under its root, a hostPath volume of its own pod. Only when the two paths are
the same directory do the agent's files reach the pods, and only then can the agent tell which
pods mount a model it is about to delete. So:

* the host path is read from the agent's own Pod (the volume mounted at ``--root``), which is what
  the kubelet mounted: deploy/ names the path once, in the DaemonSet's volume, and any way of
  changing it (an overlay, ``kubectl patch``) is seen; ``--host-path`` overrides it outside a pod;
* every node group this node's LocalModelNode entries name must have that path; while one does
  not, the agent deletes nothing (:class:`RootPaths.pv_paths` raises) and says so.
"""

from __future__ import annotations

import logging
import posixpath
import threading
import time
from collections.abc import Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from modelcache.kube.client import PODS, Kube
from modelcache.kube.objects import meta
from modelcache.kube.types import norm_path as norm
from modelcache.kube.types import pv_root

log = logging.getLogger("agent.hostpath")


def host_path_of(pod: Mapping[str, Any], root: Path) -> str | None:
    """The host path behind ``root`` in ``pod``: a container's mount at ``root`` of a hostPath
    volume (plus the mount's subPath)."""
    spec = pod.get("spec") or {}
    volumes = {v.get("name"): v for v in spec.get("volumes") or []}
    want = norm(str(root))
    for container in [*(spec.get("containers") or []), *(spec.get("initContainers") or [])]:
        for mount in container.get("volumeMounts") or []:
            if norm(mount.get("mountPath") or "") != want:
                continue
            host = ((volumes.get(mount.get("name")) or {}).get("hostPath") or {}).get("path")
            if host:
                return norm(posixpath.join(host, mount.get("subPath") or ""))
    return None


def discover(kube: Kube, node: str, pod_namespace: str | None, pod_name: str | None, root: Path,
             attempts: int = 10, delay: float = 3.0) -> str | None:
    """Read our own Pod (listed by node and name: the agent's RBAC lists pods, it does not get
    them) and return the host path of ``root``; None outside a pod, without a hostPath root, or
    when the API server cannot be asked (then every PV counts: the safe side)."""
    if not pod_name:
        return None
    selector = f"spec.nodeName={node},metadata.name={pod_name}"
    for attempt in range(attempts):
        try:
            items = kube.list(PODS, None, field_selector=selector, resource_version="0").get("items") or []
            break
        except Exception as exc:
            log.warning("cannot read this agent's Pod (%s: %s); retrying", type(exc).__name__, exc)
            if attempt + 1 < attempts:
                time.sleep(delay)
    else:
        return None
    for pod in items:
        if pod_namespace and meta(pod).namespace != pod_namespace:
            continue
        path = host_path_of(pod, root)
        if path:
            return path
    return None


class RootMismatch(Exception):
    """The node groups' PVs name another directory than the agent's root."""


@dataclass(frozen=True)
class Mismatch:
    group: str
    pv_path: str | None
    found: bool = True


class RootPaths:
    """The root's host path and the node groups in use; thread-safe (informer and supervisor threads).

    ``host_path`` None means unknown: every PV counts as the root's (the safe side for removals).
    """

    def __init__(self, host_path: str | None) -> None:
        self.host_path = norm(host_path) if host_path else None
        self._lock = threading.Lock()
        self._mismatches: list[Mismatch] = []

    def update(self, groups_in_use: Mapping[str, Mapping[str, Any] | None]) -> list[Mismatch]:
        """Re-check against ``group name -> LocalModelNodeGroup`` (None: not found); returns the
        mismatches (a group we cannot see, or one whose PV names another directory)."""
        found: list[Mismatch] = []
        if self.host_path is not None:
            for name in sorted(groups_in_use):
                group = groups_in_use[name]
                pv_spec = ((group or {}).get("spec") or {}).get("persistentVolumeSpec") or {}
                path = pv_root(pv_spec)
                if group is None or path != self.host_path:
                    found.append(Mismatch(name, path, group is not None))
        with self._lock:
            self._mismatches = found
        return found

    def message(self, mismatches: list[Mismatch]) -> str:
        parts = [f"{m.group}: {m.pv_path}" if m.pv_path else
                 f"{m.group}: {'no local/hostPath path' if m.found else 'not found'}" for m in mismatches]
        return (f"the model root is host path {self.host_path} but node group PVs name another path "
                f"({'; '.join(parts)}): serving pods would not see these files; nothing is deleted until "
                f"the DaemonSet's hostroot volume and the groups' persistentVolumeSpec.local.path agree")

    def refusal(self, group: str | None) -> str | None:
        """Why a model of node group ``group`` must not be reported Downloaded: its PV puts serving
        pods elsewhere than this root (both paths named, and the fix); None when they agree."""
        with self._lock:
            found = [m for m in self._mismatches if m.group == group]
        if not found:
            return None
        m = found[0]
        where = f"names {m.pv_path}" if m.pv_path else ("names no local.path" if m.found else "is not found")
        return (f"downloaded into host path {self.host_path} (the agent's root), but node group {m.group}'s "
                f"PV {where}: serving pods would mount an empty folder. Make the DaemonSet's hostroot volume and "
                f"the group's persistentVolumeSpec.local.path the same directory (`modelcache migrate` prints "
                f"the patch)")

    def pv_paths(self) -> set[str]:
        """The PV paths that are this root (empty: unknown, count every PV); raises
        :class:`RootMismatch` while a node group disagrees."""
        with self._lock:
            mismatches = list(self._mismatches)
        if mismatches:
            raise RootMismatch(self.message(mismatches))
        return {self.host_path} if self.host_path else set()
