"""Reconciler for Nodes (key: node name): the node's LocalModelNode and its labels.

The LocalModelNode's ``spec.localModels`` is computed here, for one node from every cache, and
written in one request: with 50 caches on 500 nodes that is one write per node, not one per
(cache, node), and two caches never race on the same object. For each cache:
* the node is a Ready member of one of its groups -> the entry, with KServe's exact fields;
* the node is a member but NotReady -> whatever entry it has is kept (a flapping node must
  not lose its files);
* the entry's node group does not exist (any more) but the cache still lists it -> kept, as
  KServe does, for ``--missing-group-grace`` (default: until the group returns; coordinator.grace);
* otherwise (not a member, cache deleted or being deleted) -> no entry. "Deleted" means gone
  from the API server, not only from our informer (which can lag): a live read confirms it.
A deleted Node's LocalModelNode is deleted once the Node has been gone for ``--deleted-node-grace``
(KServe orphans it, kserve#6159; a Node registered again within the grace keeps it, with the
entries a vanished group's nodes keep: coordinator.grace.GoneNodes). The node carries
``downloaded.modelcache.io/<storageKey>`` exactly for the models its agent reports
ModelDownloaded (the pod webhook places serving pods by these labels). The LocalModelNode carries
``nodegroup.modelcache.io/<group>`` for each group its entries name, written with the entries (no
extra request): each agent watches only its groups' LocalModelNodes to find its peers.
"""

from __future__ import annotations

import copy
import logging
from collections.abc import Callable, Mapping
from typing import Any

from kubernetes.client.exceptions import ApiException

from coordinator import entries, metrics, nodelabels, reports
from coordinator.membership import Member
from coordinator.pacing import CacheBurst
from coordinator.view import ClusterView, cache_key
from modelcache.kube.client import LOCAL_MODEL_CACHES, LOCAL_MODEL_NAMESPACE_CACHES, LOCAL_MODEL_NODES, NODES
from modelcache.kube.controller import Result
from modelcache.kube.echoes import OwnWrites
from modelcache.kube.objects import meta
from modelcache.kube.status import update_if_changed
from modelcache.kube.types import NODE_GROUP_LABEL_PREFIX, node_group_label
from modelcache.kube.views import CacheView

log = logging.getLogger(__name__)


def desired_models(
    node: str,
    current: list[dict[str, Any]],
    caches: Mapping[str, dict[str, Any]],
    members_of: Callable[[list[str]], Mapping[str, Member]],
    keep_missing: Callable[[str], bool] = lambda _group: False,
) -> list[dict[str, Any]]:
    """The node's ``localModels``: existing entries first, in their order, then new ones by cache key.

    ``caches`` maps cache keys to objects; ``members_of(groups)`` gives a cache's members;
    ``keep_missing(group)`` says whether an entry of a group that does not exist (any more) is
    kept (coordinator.grace).
    """
    out: list[dict[str, Any]] = []
    seen: set[str] = set()

    def want(key: str, have: dict[str, Any] | None) -> dict[str, Any] | None:
        cache = caches.get(key)
        if cache is None or meta(cache).deleting:
            return None
        groups = CacheView(cache).node_groups
        member = members_of(groups).get(node)
        if member is None:
            group = (have or {}).get("nodeGroup")
            if have is not None and isinstance(group, str) and group in groups and keep_missing(group):
                return have  # its group vanished (a replace, a prune): keep the files meanwhile
            return None
        if not member.ready:
            return have
        entry = entries.desired_entry(cache, member.group)
        if have is not None and all(have.get(k) == entry.get(k) for k in entries.COMPARED):
            return have  # unchanged: keep any extra fields others wrote
        return entry

    for have in current:
        key = cache_key(have.get("namespace") or None, have.get("modelName", ""))
        if key in seen:
            continue  # a duplicate entry (hand-written): keep the first
        seen.add(key)
        kept = want(key, have)
        if kept is not None:
            out.append(kept)
    for key in sorted(caches.keys() - seen):
        new = want(key, None)
        if new is not None:
            out.append(new)
    return out


def group_labels(models: list[dict[str, Any]]) -> dict[str, str]:
    """The LocalModelNode's node-group labels: one per group its entries name (agents watch their
    groups' LocalModelNodes by these: agent/peering.py)."""
    return {node_group_label(str(m["nodeGroup"])): "true" for m in models if m.get("nodeGroup")}


def group_labels_differ(lmn: dict[str, Any], models: list[dict[str, Any]]) -> bool:
    """Whether the object's node-group labels differ from those ``models`` need."""
    have = {k: v for k, v in meta(lmn).labels.items()
            if k.startswith(NODE_GROUP_LABEL_PREFIX)}
    return have != group_labels(models)


class NodeReconciler:
    name = "node"

    def __init__(self, view: ClusterView, burst: CacheBurst | None = None) -> None:
        self.view = view
        self.kube = view.kube
        #: Told of every cache change by the wiring (coordinator/controllers.py).
        self.burst = burst or CacheBurst()
        #: What this reconciler wrote last, per Node and per LocalModelNode: the node controller
        #: is not woken by those writes' own events (modelcache/kube/echoes.py).
        self.own_nodes = OwnWrites()
        self.own_lmns = OwnWrites()

    def __call__(self, key: str) -> Result:
        # This reconcile may read copies from before our last writes' events: those must wake us.
        self.own_nodes.forget(key)
        self.own_lmns.forget(key)
        held = self.burst.hold()
        if held > 0 and self.view.nodes.store.get_raw(key) is not None:
            # Caches are still arriving: write the node's entries once they are all here. Asked
            # before the copies below: each cache of a 200-cache burst wakes its 1,000 members.
            return Result(requeue_after=held)
        # The informers' own objects, not deep copies (two per reconcile, three reconciles per node
        # in the bench's flow, most of them writing nothing): the Node's metadata is copied, which
        # _withdraw_labels edits; the LocalModelNode is copied before an update edits it.
        raw = self.view.nodes.store.get_raw(key)
        node = None if raw is None else {**raw, "metadata": dict(raw.get("metadata") or {})}
        lmn = self.view.lmns.store.get_raw(key)
        if node is None:
            if lmn is not None:
                left = self.view.gone.left(key)
                if left > 0:  # it may register again: keep what the LocalModelNode says (coordinator.grace)
                    return Result(requeue_after=left + 0.05)
                metrics.wrote("LocalModelNode", "delete", self.kube.delete(LOCAL_MODEL_NODES, key) or None)
                log.info("node %s is gone: deleted its LocalModelNode", key)
            self.view.gone.forget(key)
            return Result()
        self.view.gone.forget(key)
        lmn = self.sync_entries(key, lmn, node)
        patch = nodelabels.label_patch(node, nodelabels.downloaded_labels(lmn, reports.node_uid(node)))
        if patch:
            metrics.wrote("Node", "patch")
            self.own_nodes.wrote(self.kube.patch(NODES, key, patch, metadata_only=True))
        return Result(requeue_after=self.view.missing.recheck_after())  # a grace period may run out

    def _caches_for(self, node: str, groups: Mapping[str, Any],
                    members_of: Callable[[list[str]], Mapping[str, Member]],
                    current: list[dict[str, Any]]) -> dict[str, dict[str, Any]]:
        """The caches that can give ``node`` an entry or take one away (read-only: entries copy
        what they take): those of the groups it is a member of, and those its entries name. Any
        other cache has no member and no entry here (desired_models gives it none). Offline, the
        bench's event flow at 500 nodes and 100 caches: a node's reconcile went through every
        cache (200 at 10,000 nodes), 1.4 ms of CPU, 3 of them per node."""
        caches: dict[str, dict[str, Any]] = {}
        for group in groups:
            if node in members_of([group]):
                caches.update((meta(c).key, c) for c in self.view.caches_of_group(group))
        self._entries_caches(current, caches)
        return caches

    def _entries_caches(self, current: list[dict[str, Any]], caches: dict[str, dict[str, Any]]) -> None:
        """Add to ``caches`` the caches our informers have of ``current``'s entries."""
        for have in current:
            key = cache_key(have.get("namespace") or None, have.get("modelName", ""))
            if key not in caches:
                cache = self.view.cache(key)
                if cache is not None:
                    caches[key] = cache

    def _confirmed_gone(self, current: list[dict[str, Any]], caches: dict[str, dict[str, Any]]) -> None:
        """Add to ``caches`` the caches of ``current`` entries that our informer does not have but
        the API server does. The cache informer can lag the LocalModelNode informer (a new
        cache's entry, written by a leader whose view was ahead of ours, arrives first): an entry
        is dropped for its cache being gone only once a live read says so."""
        for have in current:
            key = cache_key(have.get("namespace") or None, have.get("modelName", ""))
            if key in caches:
                continue
            ns, name = have.get("namespace") or None, have.get("modelName", "")
            live = self.kube.get_or_none(LOCAL_MODEL_NAMESPACE_CACHES if ns else LOCAL_MODEL_CACHES, name, ns)
            if live is not None:
                log.info("cache %s is not in our view yet but exists: keeping its entry on %s", key,
                         (have.get("nodeGroup") or "?"))
                caches[key] = live

    def _withdraw_labels(self, node: dict[str, Any], lmn: dict[str, Any] | None, before: list[dict[str, Any]],
                         models: list[dict[str, Any]]) -> None:
        """Before entries leave a LocalModelNode, take their labels off the Node: the agent deletes
        a model as soon as it sees its entry go, and a label must never outlive its folder, even
        if we crash between the two writes (the label is added back later if it still holds).
        Dropped: the labels our copy of the Node has and the entries left no longer justify, and
        the labels the leaving entries justified, whether or not our copy shows them yet: the
        Node informer can lag our own label patch of a moment ago (the chaos test saw that label
        stay 2-3 s on a Node whose model was gone)."""
        uid = reports.node_uid(node)
        keep = nodelabels.downloaded_labels({**(lmn or {}), "spec": {"localModels": models}}, uid)
        justified = nodelabels.downloaded_labels({**(lmn or {}), "spec": {"localModels": before}}, uid)
        patch = nodelabels.label_patch(node, keep)
        drop: dict[str, None] = {k: None for k, v in meta(patch).labels.items() if v is None}
        drop.update({k: None for k in justified - keep})
        if drop:
            metrics.wrote("Node", "patch")
            self.own_nodes.wrote(self.kube.patch(NODES, meta(node).name, {"metadata": {"labels": drop}},
                                                 metadata_only=True))
            # Our copy of the Node as the patch left it (an edit: the dict, not a view).
            node["metadata"]["labels"] = {k: v for k, v in meta(node).labels.items() if k not in drop}

    def sync_entries(self, key: str, lmn: dict[str, Any] | None,
                     node: dict[str, Any] | None = None) -> dict[str, Any] | None:
        current = list(((lmn or {}).get("spec") or {}).get("localModels") or [])  # the dicts: rewritten below
        groups = self.view.group_map()
        members_of = _memo(self.view.members)
        caches = self._caches_for(key, groups, members_of, current)

        def keep(group: str) -> bool:
            return self.view.missing.keep(group, group in groups)

        self._confirmed_gone(current, caches)
        models = desired_models(key, current, caches, members_of, keep)
        if models == current and lmn is not None and not group_labels_differ(lmn, models):
            return lmn
        if lmn is None:
            if not models:
                return None
            try:
                body = {"metadata": {"name": key, "labels": group_labels(models)}, "spec": {"localModels": models}}
                created = self.kube.create(LOCAL_MODEL_NODES, body)
                self.own_lmns.wrote(created)
                metrics.wrote("LocalModelNode", "create")
                return created
            except ApiException as exc:
                if exc.status != 409:
                    raise  # else: it exists (our informer is behind): update it below

        last: list[dict[str, Any]] = []  # the object the last attempt computed from, as it left it

        def apply(o: dict[str, Any]) -> None:
            last[:] = [o]
            spec = o.setdefault("spec", {})
            have = list(spec.get("localModels") or [])
            self._entries_caches(have, caches)
            self._confirmed_gone(have, caches)
            spec["localModels"] = desired_models(key, have, caches, members_of, keep)
            if node is not None and spec["localModels"] != have:
                self._withdraw_labels(node, o, have, spec["localModels"])
            md = o.setdefault("metadata", {})
            labels = {k: v for k, v in (md.get("labels") or {}).items() if not k.startswith(NODE_GROUP_LABEL_PREFIX)}
            labels.update(group_labels(spec["localModels"]))
            if labels or md.get("labels"):
                md["labels"] = labels

        written = update_if_changed(self.kube, LOCAL_MODEL_NODES, key, apply,  # edits it: not the informer's
                                    current=copy.deepcopy(lmn) if lmn is not None else None)
        self.own_lmns.wrote(written)
        metrics.wrote("LocalModelNode", "update", written)
        # Nothing written after a conflict means the server's object (read again) already says it:
        # return that, not our informer's copy. The labels are computed from what is returned, and
        # the stale copy still listed the entry that had left, so its label came back on a Node
        # whose agent was deleting the model (the chaos test, seed 3397273558: 5 s, two reconciles
        # of one node 11 ms apart, the second before our informer had our own update).
        return written or (last[0] if last else lmn)


def _memo(members: Callable[[list[str]], Mapping[str, Member]]) -> Callable[[list[str]], Mapping[str, Member]]:
    """``members`` asked once per distinct list of groups: a node's reconcile asks for each of the
    200 caches, which share 10 groups (bench/coordinator_scale.py), and each ask takes the view's
    lock that 2 x 16 workers contend for (py-spy at 10,000 nodes: 7.1 % of samples waiting on it)."""
    seen: dict[tuple[str, ...], Mapping[str, Member]] = {}

    def members_of(groups: list[str]) -> Mapping[str, Member]:
        key = tuple(groups)
        hit = seen.get(key)
        if hit is None:
            hit = seen[key] = members(groups)
        return hit

    return members_of
