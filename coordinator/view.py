"""The coordinator's view of the cluster: one informer per kind it reads, with the indexes the
reconcilers and event mappers need, so a reconcile reads from memory and the API only sees writes.

Cache keys are ``name`` for a LocalModelCache and ``namespace/name`` for a
LocalModelNamespaceCache (a cluster object's name never contains ``/``), and the same keys
are the index values linking services, LocalModelNode entries and volumes to their cache.
"""

from __future__ import annotations

import logging
import threading
from collections.abc import Iterable, Mapping
from dataclasses import dataclass, field
from types import MappingProxyType
from typing import Any

from kubernetes.client.exceptions import ApiException

from coordinator.grace import GoneNodes, MissingGroups
from coordinator.membership import Member, place
from coordinator.nodelabels import LABEL_PREFIX
from coordinator.nodeselector import node_ready
from coordinator.urimatch import CacheRef
from coordinator.volumes import MANAGED_SELECTOR, cache_of
from modelcache.kube.client import (
    INFERENCE_SERVICES,
    KSERVE,
    LOCAL_MODEL_CACHES,
    LOCAL_MODEL_NAMESPACE_CACHES,
    LOCAL_MODEL_NODE_GROUPS,
    LOCAL_MODEL_NODES,
    NODES,
    PERSISTENT_VOLUME_CLAIMS,
    PERSISTENT_VOLUMES,
    Kube,
    Resource,
)
from modelcache.kube.informer import Informer
from modelcache.kube.objects import meta, namespaced_key
from modelcache.kube.types import (
    LOCALMODEL_LABEL,
    LOCALMODEL_NAMESPACE_LABEL,
    MODEL_DOWNLOAD_ERROR,
    MODEL_DOWNLOADED,
)
from modelcache.kube.views import LocalModelNodeView, NodeView

log = logging.getLogger(__name__)

BY_CACHE = "cache"
#: Caches by the node groups they list: a node's reconcile reads its own groups' caches, not all.
BY_GROUP = "group"
#: LocalModelNodes by the caches whose entry on them its agent has not reported done or failed yet.
PENDING = "pending"
#: LLMInferenceService versions, newest first: we use whichever the cluster serves.
LLMISVC_VERSIONS = ("v1alpha2", "v1alpha1")


def llm_resource(version: str) -> Resource:
    return Resource(KSERVE, version, "llminferenceservices", "LLMInferenceService", True)


def cache_key(namespace: str | None, name: str) -> str:
    return namespaced_key(namespace, name)


def user_labels(obj: dict[str, Any] | None) -> dict[str, str]:
    """Node labels other than our downloaded-model ones: those we write must not count as a
    membership change (a group selecting on them would be selecting on download state)."""
    return {k: v for k, v in meta(obj).labels.items() if not k.startswith(LABEL_PREFIX)}


def cache_groups(obj: dict[str, Any] | None) -> list[str]:
    """The node groups a cache lists (its BY_GROUP index values)."""
    return sorted(set((((obj or {}).get("spec") or {}).get("nodeGroups")) or ()))


def service_cache_keys(obj: dict[str, Any] | None) -> list[str]:
    """The cache a service is labelled with (KServe's defaulter labels)."""
    if not obj:
        return []
    m = meta(obj)
    labels = m.labels
    name = labels.get(LOCALMODEL_LABEL)
    if not name:
        return []
    cache_ns = labels.get(LOCALMODEL_NAMESPACE_LABEL)
    if cache_ns and cache_ns != m.namespace:
        return []  # a namespace cache serves only its own namespace
    return [cache_key(cache_ns or None, name)]


def entry_cache_keys(obj: dict[str, Any] | None) -> list[str]:
    if not obj:
        return []
    return sorted({entry.key for entry in LocalModelNodeView(obj).entries})


def pending_cache_keys(obj: dict[str, Any] | None) -> list[str]:
    """The caches whose entry on this LocalModelNode its agent has not reported ModelDownloaded or
    ModelDownloadError for (whoever it was reported for: a hint for pacing, coordinator/caches.py)."""
    if not obj:
        return []
    lmn = LocalModelNodeView(obj)
    states = lmn.model_status
    # An entry's modelStatus key is its cache's key.
    return sorted({e.key for e in lmn.entries if states.get(e.key) not in (MODEL_DOWNLOADED, MODEL_DOWNLOAD_ERROR)})


def volume_cache_keys(obj: dict[str, Any] | None) -> list[str]:
    owner = cache_of(obj or {})
    return [cache_key(*owner)] if owner else []


#: What the coordinator reads of a Node: its name, labels (membership, our downloaded-model labels)
#: and Ready condition. A real Node also carries its images (often 100+ of them), addresses,
#: capacity, annotations and managedFields: tens of KB each, times thousands of nodes.
NODE_METADATA = ("name", "uid", "resourceVersion", "labels", "deletionTimestamp")


def node_essentials(node: dict[str, Any]) -> dict[str, Any]:
    # Builds the slim object the informer keeps: copies raw fields as they are (not read through a view).
    raw = node.get("metadata") or {}
    ready = NodeView(node).ready_conditions
    return {"apiVersion": node.get("apiVersion"), "kind": node.get("kind"),
            "metadata": {k: raw[k] for k in NODE_METADATA if k in raw},
            "status": {"conditions": [{"type": "Ready", "status": c.get("status")} for c in ready]}}


def lmn_essentials(lmn: dict[str, Any]) -> dict[str, Any]:
    """A LocalModelNode as the coordinator reads it: of the agent's status only ``modelStatus``,
    the ``nodeUID`` it was written for and each model's ``storageKey`` (what a state is believed
    against: coordinator/reports.py), ``verification`` (a copy counted on KServe's word: the
    caches' CopiesVerified) and the message of a model in error (the reason a cache's status
    gives), not its progress or capacity. Its spec and metadata stay whole: the node reconciler
    writes the object back with a PUT (which ignores status)."""
    (lmn.get("metadata") or {}).pop("managedFields", None)
    status = lmn.get("status")
    if status:
        kept = {k: status[k] for k in ("modelStatus", "nodeUID") if k in status}
        details = status.get("modelDetails") or {}
        failed = {k for k, v in (status.get("modelStatus") or {}).items() if v == MODEL_DOWNLOAD_ERROR}
        keys = {k: {f: d[f] for f in ("storageKey", "verification") if d.get(f)}
                | ({"message": d["message"]} if k in failed and d.get("message") else {})
                for k, d in details.items() if isinstance(d, dict) and d.get("storageKey")}
        if keys:
            kept["modelDetails"] = keys
        lmn["status"] = kept
    return lmn


def served(kube: Kube, res: Resource) -> bool:
    """Whether the API serves ``res`` (a CRD may be absent: KServe not installed)."""
    try:
        kube.list(res, limit=1)
        return True
    except ApiException as exc:
        if exc.status == 404:
            return False
        raise


@dataclass
class ClusterView:
    kube: Kube
    caches: Informer
    ns_caches: Informer
    groups: Informer
    nodes: Informer
    lmns: Informer
    pvs: Informer
    pvcs: Informer
    isvcs: Informer | None = None
    llmisvcs: Informer | None = None
    llm_resource: Resource | None = None
    extra: list[Informer] = field(default_factory=list)
    #: When node groups went missing: their members' entries are kept meanwhile (coordinator.grace).
    missing: MissingGroups = field(default_factory=MissingGroups)
    #: When Nodes were seen deleted: their LocalModelNodes are kept meanwhile (coordinator.grace).
    gone: GoneNodes = field(default_factory=GoneNodes)
    _watch_timeout: int = 300
    #: Bumped after any node or group change that can alter membership (see members()).
    _epoch: int = 0
    _members: dict[tuple[str, ...], tuple[int, Mapping[str, Member]]] = field(default_factory=dict)
    #: One lock per list of groups: its members are computed by one thread at a time (see members()).
    _computing: dict[tuple[str, ...], threading.Lock] = field(default_factory=dict)
    _lock: threading.Lock = field(default_factory=threading.Lock)

    @classmethod
    def build(cls, kube: Kube, watch_timeout: int = 300, with_services: bool = True,
              missing_group_grace: float | None = None, deleted_node_grace: float = 15.0) -> ClusterView:
        def inf(res: Resource, **kw: Any) -> Informer:
            return Informer(kube, res, watch_timeout=watch_timeout, retry_delay=1.0, **kw)

        view = cls(
            kube=kube,
            caches=inf(LOCAL_MODEL_CACHES, indexers={BY_GROUP: cache_groups}),
            ns_caches=inf(LOCAL_MODEL_NAMESPACE_CACHES, indexers={BY_GROUP: cache_groups}),
            groups=inf(LOCAL_MODEL_NODE_GROUPS),
            nodes=inf(NODES, transform=node_essentials),
            lmns=inf(LOCAL_MODEL_NODES, indexers={BY_CACHE: entry_cache_keys, PENDING: pending_cache_keys},
                     transform=lmn_essentials),
            pvs=inf(PERSISTENT_VOLUMES, label_selector=MANAGED_SELECTOR, indexers={BY_CACHE: volume_cache_keys}),
            pvcs=inf(PERSISTENT_VOLUME_CLAIMS, label_selector=MANAGED_SELECTOR,
                     indexers={BY_CACHE: volume_cache_keys}),
        )
        view.missing = MissingGroups(missing_group_grace)
        view.gone = GoneNodes(deleted_node_grace)
        view.nodes.add_handler(view._bump_if_membership)
        view.groups.add_handler(view.missing.observe)
        view.groups.add_handler(view._bump)
        view._watch_timeout = watch_timeout
        if with_services:
            view.discover_services()
            if view.isvcs is None:
                log.info("InferenceService (serving.kserve.io/v1beta1) is not served: services are not tracked "
                         "until its CRD is installed")
            if view.llmisvcs is None:
                log.info("LLMInferenceService is not served: LLM services are not tracked until its CRD is installed")
        return view

    def discover_services(self) -> list[tuple[Informer, Resource]]:
        """Create informers (not started) for service kinds the API serves and we do not track yet.

        Called at start and then periodically: KServe may be installed after the coordinator, and a
        CRD added later must not need a restart. Returns the newly tracked (informer, resource)s.
        """
        def inf(res: Resource) -> Informer:
            return Informer(self.kube, res, watch_timeout=self._watch_timeout, retry_delay=1.0,
                            indexers={BY_CACHE: service_cache_keys})

        found: list[tuple[Informer, Resource]] = []
        if self.isvcs is None and served(self.kube, INFERENCE_SERVICES):
            self.isvcs = inf(INFERENCE_SERVICES)
            found.append((self.isvcs, INFERENCE_SERVICES))
        if self.llmisvcs is None:
            for version in LLMISVC_VERSIONS:
                res = llm_resource(version)
                if served(self.kube, res):
                    self.llmisvcs, self.llm_resource = inf(res), res
                    found.append((self.llmisvcs, res))
                    break
        return found

    # -- membership, memoized: 50 caches x 500 nodes must not re-match every node per reconcile --
    def _bump(self, _event: str, _obj: dict[str, Any], _old: dict[str, Any] | None) -> None:
        with self._lock:
            self._epoch += 1
            self._members.clear()

    def _bump_if_membership(self, event: str, obj: dict[str, Any], old: dict[str, Any] | None) -> None:
        if event != "MODIFIED" or old is None or user_labels(obj) != user_labels(old) or \
                node_ready(obj) != node_ready(old):
            self._bump(event, obj, old)

    def members(self, cache_groups: list[str]) -> Mapping[str, Member]:
        """node -> Member for a cache's groups, recomputed only after a relevant node/group change.

        Read-only and shared: the node reconciler asks once per cache for every node, so copying
        it each time (a 500-node group, 200 caches, 5,000 nodes) would dominate. The epoch is
        bumped after the informer has stored the change, so a result computed under an epoch never
        predates a change announced by that epoch's successor.
        """
        key = tuple(cache_groups)
        with self._lock:
            epoch, hit = self._epoch, self._members.get(key)
            gate = self._computing.setdefault(key, threading.Lock())
        if hit is not None and hit[0] == epoch:
            return hit[1]
        # One computation at a time per key; the threads that asked meanwhile take its result.
        # Without the gate every worker that missed computed it too: at 3,000 nodes and 10 groups
        # 40 computations where 10 were needed (bench/coordinator_scale.py, a counter), each a
        # pass over every Node, and py-spy at 10,000 nodes put 20 % of the coordinator's samples in place().
        with gate:
            with self._lock:
                epoch, hit = self._epoch, self._members.get(key)
            if hit is not None and hit[0] == epoch:
                return hit[1]
            result = MappingProxyType(place(cache_groups, self.group_map(), self.nodes.store.list(copy_objects=False)))
            with self._lock:
                if self._epoch == epoch:
                    self._members[key] = (epoch, result)
            return result

    def informers(self) -> list[Informer]:
        infs = [self.caches, self.ns_caches, self.groups, self.nodes, self.lmns, self.pvs, self.pvcs, *self.extra]
        return infs + [i for i in (self.isvcs, self.llmisvcs) if i is not None]

    def start(self) -> None:
        for inf in self.informers():
            if not inf.started:
                inf.start()

    def stop(self) -> None:
        for inf in self.informers():
            inf.stop()

    def synced(self) -> bool:
        return all(inf.synced.is_set() for inf in self.informers())

    def current(self) -> bool:
        """The informers that decide what nodes hold (caches, groups, Nodes, LocalModelNodes,
        our volumes) synced and following the server now, none retrying a failed watch: a
        leader acts only on such a view. The service kinds are left out: KServe can be
        uninstalled under us, and a kind no longer served must not stop every reconcile."""
        core = [self.caches, self.ns_caches, self.groups, self.nodes, self.lmns, self.pvs, self.pvcs]
        return all(inf.current for inf in core)

    # -- reads --------------------------------------------------------------------------------
    def cache(self, key: str) -> dict[str, Any] | None:
        """Read-only: the informer's own object, not a copy (a cache carrying 1,000 members'
        nodeStatus is costly to copy: 4.4 % of the coordinator's samples at 10,000 nodes)."""
        return (self.ns_caches if "/" in key else self.caches).store.get_raw(key)

    def caches_of_group(self, group: str) -> list[dict[str, Any]]:
        """Read-only: the caches (both kinds) that list ``group``."""
        return (self.caches.store.by_index(BY_GROUP, group, copy_objects=False) +
                self.ns_caches.store.by_index(BY_GROUP, group, copy_objects=False))

    def cache_keys(self) -> list[str]:
        return self.caches.store.keys() + self.ns_caches.store.keys()

    def cache_refs(self) -> tuple[list[CacheRef], list[CacheRef]]:
        """(namespace caches, cluster caches), skipping those being deleted."""
        def live(inf: Informer) -> list[CacheRef]:
            return [CacheRef.of(o) for o in inf.store.list(copy_objects=False) if not meta(o).deleting]
        return live(self.ns_caches), live(self.caches)

    def group_map(self) -> dict[str, dict[str, Any]]:
        """Read-only: the cache's own objects (callers copy what they change)."""
        return {meta(o).name: o for o in self.groups.store.list(copy_objects=False)}

    def services_of(self, key: str) -> tuple[list[dict[str, Any]], list[dict[str, Any]]]:
        """(InferenceServices, LLMInferenceServices) labelled with the cache; read-only."""
        isvcs = self.isvcs.store.by_index(BY_CACHE, key, copy_objects=False) if self.isvcs else []
        llms = self.llmisvcs.store.by_index(BY_CACHE, key, copy_objects=False) if self.llmisvcs else []
        return isvcs, llms

    def service_informers(self) -> Iterable[Informer]:
        return [i for i in (self.isvcs, self.llmisvcs) if i is not None]
