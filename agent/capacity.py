"""Disk reservations: a download is admitted only if it fits, before it writes a byte.

Two budgets are checked: the root's file system (free space minus a safety margin minus what
other downloads in flight still have to allocate) and, when the model's node group sets one,
``storageLimit`` (everything the store holds plus what is reserved). A model that cannot fit
fails at once with "insufficient space: need X, free Y" instead of ENOSPC halfway.

A download preallocates its files as it opens them, and from then on the file system's free
space already shows them: so a reservation counts only what its staging folder has *not yet
allocated* (its size minus the blocks already there), measured when it is read, never the
whole size a second time.
"""

from __future__ import annotations

import os
import shutil
import stat
import threading
from collections.abc import Callable, Iterable
from dataclasses import dataclass
from pathlib import Path

from modelcache.errors import InsufficientSpaceError
from modelcache.kube.share import share_advice
from modelcache.kube.types import NAMESPACE_LIMIT_ANNOTATION
from modelcache.runtime.progress import human_bytes


def allocated_bytes(folder: Path) -> int:
    """Bytes the file system has allocated to the files under ``folder`` (0 if it is missing)."""
    total = 0
    for dirpath, _dirs, files in os.walk(folder):
        for name in files:
            try:
                total += os.lstat(os.path.join(dirpath, name)).st_blocks * 512
            except OSError:
                continue  # renamed or deleted meanwhile: no longer ours to count
    return total




def folder_size(folder: Path) -> tuple[int, int]:
    """(files, bytes) of the regular files under ``folder``, links not followed (stats only)."""
    files = size = 0
    for base, _dirs, found in os.walk(folder):
        for name in found:
            try:
                st = os.lstat(os.path.join(base, name))
            except OSError:
                continue
            if stat.S_ISREG(st.st_mode):
                files, size = files + 1, size + st.st_size
    return files, size


class GroupLimit(int):
    """A node group's ``storageLimit`` in bytes, knowing its group (for the refusal's message) and
    its per-namespace share (``namespace_limit``, None: none; ``share_source``: where it comes
    from, modelcache/kube/share.py)."""

    group: str = ""
    namespace_limit: int | None = None
    share_source: str = ""

    def __new__(cls, value: int, group: str = "", namespace_limit: int | None = None,
                share_source: str = f"the group's annotation {NAMESPACE_LIMIT_ANNOTATION}") -> GroupLimit:
        obj = super().__new__(cls, value)
        obj.group = group
        obj.namespace_limit = namespace_limit
        obj.share_source = share_source
        return obj


def namespace_limit_refusal(what: str, namespace: str, model_bytes: int, limit: int, group: str, used: int,
                            reserved: int, source: str = f"the group's annotation {NAMESPACE_LIMIT_ANNOTATION}") -> str:
    return (f"{what}: does not fit namespace {namespace}'s share of node group '{group}': the model is "
            f"{human_bytes(model_bytes)}, a namespace's caches may hold {human_bytes(limit)} on each node of the "
            f"group ({source}) and namespace {namespace}'s caches hold {human_bytes(used)} here already "
            f"({human_bytes(reserved)} more reserved by downloads in flight); {share_advice(namespace)}")


def cluster_first_refusal(what: str, namespaces: Iterable[str], model_bytes: int, limit: int, used: int,
                          reserved: int, pending: list[tuple[str, int]]) -> str:
    """Why a namespace cache's model does not fit: the room left is what the node group's cluster
    caches (LocalModelCache, a cluster admin's) still need on this node."""
    group = getattr(limit, "group", "") or "?"
    need = sum(size for _name, size in pending)
    names = ", ".join(sorted(name for name, _size in pending))
    return (f"{what}: namespace {', '.join(sorted(namespaces))}: does not fit node group '{group}' next to its cluster "
            f"caches: the model is {human_bytes(model_bytes)}, storageLimit {human_bytes(limit)}, this node holds "
            f"{human_bytes(used)} ({human_bytes(reserved)} more reserved by downloads in flight) and LocalModelCache "
            f"{names} still need {human_bytes(need)} here; namespace caches get only what cluster caches leave. "
            f"Delete a LocalModelNamespaceCache of the namespace, or ask a cluster admin to raise spec.storageLimit "
            f"of LocalModelNodeGroup '{group}'")


def storage_limit_refusal(what: str, model_bytes: int, limit: int, used: int, reserved: int,
                          held: dict[str, int] | None = None) -> str:
    """Why a model does not fit its node group's ``storageLimit``, and what to do about it.
    ``held``: namespace -> bytes its namespace caches hold on the node (named for a cluster admin,
    whose cache they may keep out: nothing downloaded is deleted to make room)."""
    group = getattr(limit, "group", "") or "?"
    tenants = ", ".join(f"{ns} {human_bytes(n)}" for ns, n in sorted(held.items()) if n) if held else ""
    return (f"{what}: does not fit the node group's storageLimit: the model is {human_bytes(model_bytes)}, "
            f"LocalModelNodeGroup '{group}' has storageLimit {human_bytes(limit)} and this node holds "
            f"{human_bytes(used)} of models already ({human_bytes(reserved)} more reserved by downloads in flight"
            + (f"; namespace caches hold: {tenants}" if tenants else "") + "). "
            f"modelcache enforces storageLimit (KServe does not): raise spec.storageLimit of LocalModelNodeGroup "
            f"'{group}' (a Kubernetes quantity, e.g. {_suggest(used + reserved + model_bytes)}) or remove models "
            f"from this node")


def _suggest(need: int) -> str:
    gib = -(-need // (1 << 30))
    return f"{gib}Gi"


@dataclass(frozen=True)
class Reservation:
    key: str
    disk_bytes: int  # what the download writes in all (its remaining size when admitted)
    model_bytes: int  # the model's whole size, counted against storageLimit
    #: Where the download allocates its files (its staging folder), measured to see what it
    #: still has to allocate; None counts ``disk_bytes`` whole.
    staged: Path | None = None
    staged_at_admission: int = 0
    #: The namespaces whose share of the group it counts against (empty: a cluster cache wants it).
    owners: frozenset[str] = frozenset()

    def outstanding(self) -> int:
        """Bytes this download will still take from the file system's free space."""
        if self.staged is None:
            return self.disk_bytes
        grown = allocated_bytes(self.staged) - self.staged_at_admission
        return max(0, self.disk_bytes - max(0, grown))


class Capacity:
    def __init__(self, root: Path, margin: int, used_bytes: Callable[[], int],
                 disk_usage: Callable[[Path], tuple[int, int]] | None = None,
                 namespace_used: Callable[[str], int] | None = None,
                 cluster_pending: Callable[[], list[tuple[str, str, int]]] | None = None,
                 counted: Callable[[str], int] | None = None,
                 namespaces_held: Callable[[], dict[str, int]] | None = None) -> None:
        self.root = root
        self.margin = margin
        self.used_bytes = used_bytes  # bytes of published models in the store
        #: bytes of published models that count against a namespace's share
        self.namespace_used = namespace_used or (lambda _ns: 0)
        #: (storage key, cluster cache names, bytes) of the models cluster caches want on this node
        #: that are not here yet: namespace caches may not take their room (security review M4).
        self.cluster_pending = cluster_pending or (lambda: [])
        #: bytes of a model that ``used_bytes`` (and its namespaces' ``namespace_used``) count
        #: already: a copy KServe left, adopted in place, must not count twice against a limit.
        self.counted = counted or (lambda _key: 0)
        #: namespace -> bytes of the models on the node that count against its share
        self.namespaces_held = namespaces_held or (lambda: {})
        self._disk_usage = disk_usage or (lambda p: (lambda u: (u.total, u.free))(shutil.disk_usage(p)))
        self._lock = threading.Lock()
        self._reserved: dict[str, Reservation] = {}

    def disk(self) -> tuple[int, int]:
        """(total, free) bytes of the root's file system."""
        try:
            return self._disk_usage(self.root)
        except OSError:
            return (0, 0)

    @property
    def reserved_bytes(self) -> int:
        """What downloads in flight will still allocate (not what they have allocated already)."""
        with self._lock:
            reservations = list(self._reserved.values())
        return sum(r.outstanding() for r in reservations)

    def reserve(self, key: str, disk_bytes: int, model_bytes: int, limit: int | None, what: str,
                staged: Path | None = None, owners: frozenset[str] = frozenset(), advice: str = "") -> None:
        """Reserve or raise InsufficientSpaceError; a second reserve for ``key`` replaces the first.

        ``staged``: the folder the download allocates its files in; from then on only what it
        has not allocated yet counts against the other downloads. ``owners``: the namespaces whose
        share of the group (``limit.namespace_limit``) it also must fit.
        """
        with self._lock:
            others = [r for k, r in self._reserved.items() if k != key]
            _total, free = self.disk()
            free_disk = max(0, free - self.margin - sum(r.outstanding() for r in others))
            if disk_bytes > free_disk:
                raise InsufficientSpaceError(
                    f"{what}: insufficient space: need {human_bytes(disk_bytes)}, free {human_bytes(free_disk)} "
                    f"on {self.root} (after a {human_bytes(self.margin)} margin and downloads in flight)"
                    + (f"; {advice}" if advice else "")
                )
            own = self.counted(key)
            if limit is not None:
                used, reserved = self.used_bytes() - own, sum(r.model_bytes for r in others)
                if model_bytes > max(0, limit - used - reserved):
                    raise InsufficientSpaceError(storage_limit_refusal(
                        what, model_bytes, limit, used, reserved, None if owners else self.namespaces_held()))
            share: int | None = getattr(limit, "namespace_limit", None)
            for ns in sorted(owners) if share is not None else ():
                assert share is not None
                used, reserved = self.namespace_used(ns) - own, sum(r.model_bytes for r in others if ns in r.owners)
                if model_bytes > max(0, share - used - reserved):
                    raise InsufficientSpaceError(namespace_limit_refusal(
                        what, ns, model_bytes, share, getattr(limit, "group", "") or "?", used, reserved,
                        getattr(limit, "share_source", "")))
            if limit is not None and owners:
                # Cluster caches first: a namespace cache's model gets only what the cluster
                # caches of this node leave, the ones not downloaded yet included (their size
                # is known once listed); those downloading already are among ``others``.
                pending = [(name, size) for k, name, size in self.cluster_pending() if k not in self._reserved]
                used, reserved = self.used_bytes() - own, sum(r.model_bytes for r in others)
                if pending and model_bytes > max(0, limit - used - reserved - sum(s for _n, s in pending)):
                    raise InsufficientSpaceError(cluster_first_refusal(
                        what, owners, model_bytes, limit, used, reserved, pending))
            self._reserved[key] = Reservation(key, disk_bytes, model_bytes, staged,
                                              allocated_bytes(staged) if staged is not None else 0, owners)

    def release(self, key: str) -> None:
        with self._lock:
            self._reserved.pop(key, None)
