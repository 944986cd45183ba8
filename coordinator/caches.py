"""Reconciler for LocalModelCache and LocalModelNamespaceCache (one key at a time).

From the informer caches, then diffed against what exists:
* the finalizer is on while the cache lives;
* ``status`` = nodeStatus/copies over the current members of its groups (NotReady members show
  ``NodeNotReady``), and the services labelled with the cache;
* serving PV/PVC pairs exist for each (namespace, group) with a service, and no others.
The LocalModelNode entries are written by the node reconciler (one write per node for all
caches). Deletion never depends on the node groups (kserve#6154): once no LocalModelNode holds
the entry any more, our volumes are deleted and the finalizer goes.
"""

from __future__ import annotations

import copy
import logging
from collections.abc import Callable, Mapping
from typing import Any

from kubernetes.client.exceptions import ApiException

from coordinator import aggregate, entries, metrics, reports, volumes
from coordinator.membership import Member
from coordinator.pacing import StatusPacer
from coordinator.uninstall import RELEASED_ANNOTATION, released_for
from coordinator.view import BY_CACHE, PENDING, ClusterView, cache_key
from modelcache.kube.client import (
    LOCAL_MODEL_CACHES,
    LOCAL_MODEL_NAMESPACE_CACHES,
    LOCAL_MODEL_NODES,
    PERSISTENT_VOLUME_CLAIMS,
    PERSISTENT_VOLUMES,
    Resource,
    error_message,
)
from modelcache.kube.controller import Result
from modelcache.kube.events import NORMAL, WARNING, EventRecorder
from modelcache.kube.objects import meta
from modelcache.kube.status import patch_status_if_changed, update_if_changed
from modelcache.kube.types import (
    CACHE_FINALIZER,
    MODEL_DOWNLOADED,
    NAMESPACE_CACHE_FINALIZER,
    NODE_DOWNLOAD_ERROR,
    label_value,
)
from modelcache.kube.views import CacheView
from modelcache.runtime.clock import rfc3339
from modelcache.sources.uri import storage_key

log = logging.getLogger(__name__)


class CacheReconciler:
    def __init__(self, view: ClusterView, recorder: EventRecorder, namespaced: bool,
                 install_uid: str | None = None, pacer: StatusPacer | None = None) -> None:
        self.view = view
        #: Our namespace's uid: a cache released for the uninstall of *this* install keeps no finalizer.
        self.install_uid = install_uid
        self.kube = view.kube
        self.recorder = recorder
        self.namespaced = namespaced
        self.res: Resource = LOCAL_MODEL_NAMESPACE_CACHES if namespaced else LOCAL_MODEL_CACHES
        self.finalizer = NAMESPACE_CACHE_FINALIZER if namespaced else CACHE_FINALIZER
        self.pacer = pacer or StatusPacer()
        self.name = self.res.kind

    def __call__(self, key: str) -> Result:
        # Read as stored, not copied: while members report, most reconciles end paced, and a copy
        # of a cache with 1,000 members' nodeStatus was 4.4 % of the coordinator's samples at
        # 10,000 nodes (py-spy). Nothing below edits it; the finalizer writes copy first.
        obj = self.view.cache(key)
        if obj is None:
            # Gone without our finalizer (stripped by hand, or lost in an etcd restore): what we
            # kept about it goes too, or its copies gauges would show a cache that is not there.
            _forget_gauges(key)
            self.pacer.forget(key)
            return Result()
        if meta(obj).deleting:
            return self.finalize(key, obj)
        if self.uninstalling(obj):
            return Result()  # released by coordinator/uninstall.py: create nothing more
        obj = self.ensure_finalizer(obj) or obj
        node_groups = CacheView(obj).node_groups
        groups = self.view.group_map()
        # Volumes whatever the pace: a namespace cache's claim waits on its first Downloaded
        # report, which is progress (paced), and a service must not wait for the pace of a status.
        refused = self.sync_volumes(key, obj, groups, may_create=lambda: not self.namespaced or self.entitled(
            obj, self.view.members(node_groups)))
        wait = self.paced(key, node_groups)
        if wait == 0:
            missing = [g for g in node_groups if g not in groups]
            self.sync_status(key, obj, self.view.members(node_groups), missing, refused)
        # A quota raised or a LimitRange changed wakes nothing of ours: try again in a while.
        waits = [w for w in (wait or None, REFUSED_RETRY if refused else None) if w is not None]
        return Result(requeue_after=min(waits)) if waits else Result()

    def paced(self, key: str, node_groups: list[str]) -> float:
        """Seconds the status must wait for the pacer (coordinator/pacing.py; 0: write it now):
        500 members reporting one by one make one write per interval, not 500, and 200 caches
        reporting at once share one pace. Whether members are still reporting is read from the
        indexes, and the members (a lock the node reconcilers contend for) only when none is
        pending, so that a paced reconcile costs next to nothing."""
        store = self.view.lmns.store
        # Members still to report: an entry not reported done or failed, or not written yet.
        reporting = store.count(PENDING, key) > 0 or store.count(BY_CACHE, key) < len(self.view.members(node_groups))
        return self.pacer.wait(key, progress=reporting)

    # -- finalizer ----------------------------------------------------------------------------
    def uninstalling(self, obj: dict[str, Any]) -> bool:
        """Released for the uninstall of this install (not of an earlier one, whose namespace had
        another uid: then the cache is ours again)."""
        released = released_for(obj)
        return bool(released) and (self.install_uid is None or released == self.install_uid)

    def ensure_finalizer(self, obj: dict[str, Any]) -> dict[str, Any] | None:
        if self.finalizer in meta(obj).finalizers:
            return None

        def add(o: dict[str, Any]) -> None:  # edits the object written back: the dict, not a view
            if RELEASED_ANNOTATION in (o["metadata"].get("annotations") or {}):
                del o["metadata"]["annotations"][RELEASED_ANNOTATION]  # released by an earlier install
            fins = o["metadata"].setdefault("finalizers", [])
            if self.finalizer not in fins:
                fins.append(self.finalizer)

        written = update_if_changed(self.kube, self.res, meta(obj).name, add, meta(obj).namespace,
                                    current=copy.deepcopy(obj))  # edited in place: not the informer's
        return metrics.wrote(self.res.kind, "update", written)  # type: ignore[return-value]

    def finalize(self, key: str, obj: dict[str, Any]) -> Result:
        m = meta(obj)
        if self.finalizer not in m.finalizers:
            return Result()
        name, ns = m.name, m.namespace
        # The node reconcilers, woken by the deletion, remove the entry; wait until none holds it
        # (checked in a fresh list too: an entry written a moment ago must not be missed).
        if self.view.lmns.store.by_index(BY_CACHE, key, copy_objects=False) or any(
                entries.has((lmn.get("spec") or {}).get("localModels") or [], name, ns)
                for lmn in self.kube.list(LOCAL_MODEL_NODES).get("items") or []):
            return Result(requeue_after=0.5)
        for pvc in self.view.pvcs.store.by_index(BY_CACHE, key, copy_objects=False):
            self._delete(PERSISTENT_VOLUME_CLAIMS, meta(pvc).name, meta(pvc).namespace)
        for pv in self.view.pvs.store.by_index(BY_CACHE, key, copy_objects=False):
            self._delete(PERSISTENT_VOLUMES, meta(pv).name, None)

        def drop(o: dict[str, Any]) -> None:  # edits the object written back: the dict, not a view
            o["metadata"]["finalizers"] = [f for f in o["metadata"].get("finalizers") or [] if f != self.finalizer]

        update_if_changed(self.kube, self.res, name, drop, ns, current=copy.deepcopy(obj))  # not the informer's
        _forget_gauges(key)
        self.pacer.forget(key)
        log.info("%s %s: finalized", self.res.kind, key)
        return Result()

    # -- serving volumes -------------------------------------------------------------------------
    def entitled(self, obj: dict[str, Any], members: Mapping[str, Member]) -> bool:
        """May a namespace cache's namespace get its serving claim now? Only once an agent reports
        this cache's own entry downloaded. A claim reads the folder of the URI's storage key, which
        caches of one URI share (KServe's contract): a tenant naming the URI of someone else's
        private model must not read the folder downloaded with their credentials, and an agent
        reports a namespace cache's entry downloaded only when it names the credentials the folder
        was downloaded with, granted to its namespace (agent/credentials.py). Waiting for that even
        for a URI no other cache has yet closes the order where the tenant's claim comes first.
        Serving pods wait for a copy anyway (pod placement)."""
        cache = CacheView(obj)
        uri, skey = cache.source_model_uri, cache.key  # a cache's key is its entries' modelStatus key
        return any(reports.reported_state(self.view.lmns.store.get_raw(node),
                                          reports.node_uid(self.view.nodes.store.get_raw(node)), skey, uri)
                   == MODEL_DOWNLOADED for node in members)

    def sync_volumes(self, key: str, obj: dict[str, Any], groups: dict[str, dict[str, Any]],
                     may_create: Callable[[], bool] = lambda: True) -> list[str]:
        """Create and delete serving PVs/PVCs; returns the creations the API refused (a namespace's
        ResourceQuota or LimitRange, an invalid group spec), each as one line, also recorded as a
        Warning Event on the cache. ``may_create()`` False: none is created yet (``entitled``);
        asked only when one is missing (``entitled`` reads every member's report)."""
        isvcs, llms = self.view.services_of(key)
        uses = [volumes.Use(m.namespace or "", m.annotations) for m in map(meta, [*isvcs, *llms]) if not m.deleting]
        pairs = volumes.desired_pairs(obj, groups, uses)
        have_pvs = {meta(pv).name: pv for pv in self.view.pvs.store.by_index(BY_CACHE, key, copy_objects=False)}
        have_pvcs = {(meta(c).namespace or "", meta(c).name): c
                     for c in self.view.pvcs.store.by_index(BY_CACHE, key, copy_objects=False)}
        refused: list[str] = []
        missing = [p for p in pairs.values() if p.pv_name not in have_pvs or (p.namespace, p.pvc_name) not in have_pvcs]
        for pair in missing if missing and may_create() else ():
            group = groups[pair.group]
            try:
                if pair.pv_name not in have_pvs:
                    self._create(PERSISTENT_VOLUMES, volumes.pv_body(obj, group, pair), None)
                if (pair.namespace, pair.pvc_name) not in have_pvcs:
                    self._create(PERSISTENT_VOLUME_CLAIMS, volumes.pvc_body(obj, group, pair), pair.namespace)
            except ApiException as exc:
                if exc.status not in (403, 422):
                    raise  # not a refusal: retried with backoff
                line = error_message(exc)
                refused.append(line)
                self.recorder.record(obj, WARNING, "VolumeRefused", f"serving volume for namespace "
                                     f"{pair.namespace} (group {pair.group}) refused: {line}")
        want_pvcs = {(p.namespace, p.pvc_name) for p in pairs.values()}
        want_pvs = {p.pv_name for p in pairs.values()}
        listed = CacheView(obj).node_groups

        def kept(volume: dict[str, Any]) -> bool:  # a vanished group's volumes stay while its entries do
            value = meta(volume).labels.get(volumes.GROUP_LABEL, "")
            group = next((g for g in listed if label_value(g) == value), None)  # long names are hashed
            return group is not None and self.view.missing.keep(group, group in groups)

        for (ns, pvc_name) in have_pvcs.keys() - want_pvcs:
            if not kept(have_pvcs[(ns, pvc_name)]):
                self._delete(PERSISTENT_VOLUME_CLAIMS, pvc_name, ns)
        for pv_name in have_pvs.keys() - want_pvs:
            if not kept(have_pvs[pv_name]):
                self._delete(PERSISTENT_VOLUMES, pv_name, None)
        return refused

    def _create(self, res: Resource, body: dict[str, Any], ns: str | None) -> None:
        try:
            metrics.WRITES.labels(res.kind, "create").inc()
            self.kube.create(res, body, ns)
        except ApiException as exc:
            if exc.status != 409:  # exists (made by us a moment ago, or by hand): create-if-absent
                raise

    def _delete(self, res: Resource, name: str, ns: str | None) -> None:
        metrics.WRITES.labels(res.kind, "delete").inc()
        self.kube.delete(res, name, ns)

    # -- status ----------------------------------------------------------------------------------
    def sync_status(self, key: str, obj: dict[str, Any], members: Mapping[str, Member], missing: list[str],
                    refused: list[str] | None = None) -> None:
        """Write the status if it changed (once ``paced`` says it may)."""
        cache = CacheView(obj)
        uri, skey = cache.source_model_uri, cache.key  # a cache's key is its entries' modelStatus key
        model_states: dict[str, str | None] = {}
        reasons: dict[str, str] = {}
        verification: dict[str, str] = {}
        uri_key = storage_key(uri)  # once, not once per member
        names = list(members)
        lmns, nodes = self.view.lmns.store.get_raw_many(names), self.view.nodes.store.get_raw_many(names)
        for node, lmn, node_obj in zip(names, lmns, nodes, strict=True):
            report = reports.report_of(lmn, reports.node_uid(node_obj), skey, uri_key)
            model_states[node] = report.state
            reasons[node] = report.message
            if report.verification:
                verification[node] = report.verification
        node_status = aggregate.node_status(members, model_states)
        failing = {n: reasons[n] or "no reason given" for n, st in node_status.items() if st == NODE_DOWNLOAD_ERROR}
        copies = aggregate.copies(node_status)
        isvcs, llms = self.view.services_of(key)

        def refs(items: list[dict[str, Any]]) -> list[dict[str, str]]:
            return sorted(({"namespace": meta(s).namespace or "", "name": meta(s).name} for s in items),
                          key=lambda r: (r["namespace"], r["name"]))

        old_status = dict(CacheView(obj).node_status)

        def desired(current: dict[str, Any]) -> dict[str, Any]:
            status = dict(current.get("status") or {})
            status["nodeStatus"] = node_status
            status["copies"] = copies.to_dict()
            for field, items in (("inferenceServices", isvcs), ("llmInferenceServices", llms)):
                if items:
                    status[field] = refs(items)
                else:
                    status.pop(field, None)
            message = f"node group(s) not found: {', '.join(missing)}" if missing else "all node groups exist"
            conditions = aggregate.set_condition(
                list(status.get("conditions") or []), GROUPS_CONDITION, not missing,
                "NodeGroupNotFound" if missing else "NodeGroupsFound", message, rfc3339())
            # Why nodes fail, where `kubectl describe` shows it (nodeStatus has only the state):
            # shown once a node failed, and from then on (True again once none does).
            if failing or any(c.get("type") == FAILURES_CONDITION for c in conditions):
                conditions = aggregate.set_condition(
                    conditions, FAILURES_CONDITION, not failing, "NodeDownloadError" if failing else "NoDownloadErrors",
                    _failures(failing) if failing else "no node reports a download error", rfc3339())
            # Shown once a volume was refused, and from then on (True again once all exist).
            if refused or any(c.get("type") == VOLUMES_CONDITION for c in conditions):
                conditions = aggregate.set_condition(
                    conditions, VOLUMES_CONDITION, not refused, "VolumeRefused" if refused else "VolumesCreated",
                    "; ".join(refused) if refused else "every serving PV and PVC exists", rfc3339())
            # Shown once a copy is counted on KServe's word (the switch-over), True once all are verified.
            if verification or any(c.get("type") == VERIFIED_CONDITION for c in conditions):
                conditions = aggregate.set_condition(
                    conditions, VERIFIED_CONDITION, not verification, _verification_reason(verification),
                    _verification_message(verification), rfc3339())
            status["conditions"] = conditions
            return status

        written = patch_status_if_changed(self.kube, self.res, meta(obj).name, desired, meta(obj).namespace,
                                          current=obj)
        for state, value in copies.to_dict().items():
            metrics.COPIES.labels(key, state).set(value)
        if written is None:
            return
        self.pacer.wrote(key)
        metrics.WRITES.labels(self.res.kind, "status").inc()
        gained, lost = aggregate.copy_changes(old_status, node_status)
        summary = f"{copies.available}/{copies.total} copies available"
        # Not one event per node, nor per status write: the first copy, the last one, and every
        # loss (10,000 nodes must not mean 10,000 events, nor one per progress write).
        before = aggregate.copies(old_status).available
        if gained and (before == 0 or copies.available == copies.total):
            self.recorder.record(obj, NORMAL, "CopyAvailable",
                                 f"model downloaded on {_nodes(gained)} ({summary})")
        if lost:
            self.recorder.record(obj, WARNING, "CopyLost", f"no usable copy any more on {_nodes(lost)} ({summary})")
        newly = sorted(n for n in failing if old_status.get(n) != NODE_DOWNLOAD_ERROR)
        if newly:
            self.recorder.record(obj, WARNING, "DownloadFailed", _failures({n: failing[n] for n in newly}))


def _nodes(names: list[str], shown: int = 5) -> str:
    more = f" and {len(names) - shown} more" if len(names) > shown else ""
    return ("node " if len(names) == 1 else "nodes ") + ", ".join(names[:shown]) + more


def _failures(reasons: Mapping[str, str], shown: int = 3) -> str:
    """``node n1: Unauthorized: ...; node n2: ...`` (the first few, each cut to one sentence's worth)."""
    items = sorted(reasons.items())
    text = "; ".join(f"node {n}: {r[:300]}" for n, r in items[:shown])
    return text + (f"; and {len(items) - shown} more node(s)" if len(items) > shown else "")


GROUPS_CONDITION = "NodeGroupsFound"
#: False while a node reports a download error, naming each node and its reason.
FAILURES_CONDITION = "NoDownloadErrors"
VOLUMES_CONDITION = "ServingVolumesCreated"
#: False while a node counts a copy KServe's agent downloaded on its word (agent/state.py, carried over).
VERIFIED_CONDITION = "CopiesVerified"


def _verification_reason(verification: Mapping[str, str]) -> str:
    if not verification:
        return "Verified"
    return "Unverified" if "Unverified" in verification.values() else "Verifying"


def _verification_message(verification: Mapping[str, str]) -> str:
    if not verification:
        return "every copy was checked against its source (what differs is each node's modelDetails drift)"
    by_state: dict[str, list[str]] = {}
    for node, state in sorted(verification.items()):
        by_state.setdefault(state, []).append(node)
    parts = [f"{state} on {', '.join(nodes[:10])}" + (f" and {len(nodes) - 10} more" if len(nodes) > 10 else "")
             for state, nodes in sorted(by_state.items())]
    return ("copies KServe's agent downloaded, counted as available on its word: " + "; ".join(parts)
            + " (the node's modelDetails say why)")
#: Seconds until volumes the API refused are tried again.
REFUSED_RETRY = 60.0


def _forget_gauges(key: str) -> None:
    for state in ("available", "total", "failed"):
        try:
            metrics.COPIES.remove(key, state)
        except KeyError:
            pass


def cache_keys_for_kind(keys: list[str], namespaced: bool) -> list[str]:
    return [k for k in keys if ("/" in k) == namespaced]


__all__ = ["CacheReconciler", "cache_key", "cache_keys_for_kind"]
