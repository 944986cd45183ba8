"""Wiring: which informer events wake which reconciler (controller-runtime's ``Watches``).

Cache keys route by shape: ``name`` to the LocalModelCache controller, ``namespace/name`` to the
LocalModelNamespaceCache controller.
"""

from __future__ import annotations

from collections.abc import Callable, Iterable
from dataclasses import dataclass, field
from typing import Any

from coordinator import metrics
from coordinator.caches import CacheReconciler, cache_keys_for_kind
from coordinator.nodes import NodeReconciler
from coordinator.nodeselector import node_ready
from coordinator.pacing import CacheBurst, StatusPacer
from coordinator.services import ServiceReconciler
from coordinator.urimatch import isvc_storage_uri, llmisvc_model_uri
from coordinator.view import (
    BY_CACHE,
    PENDING,
    ClusterView,
    entry_cache_keys,
    service_cache_keys,
    user_labels,
    volume_cache_keys,
)
from modelcache.kube.client import INFERENCE_SERVICES, Resource
from modelcache.kube.controller import Controller, Manager, Result, generation_or_meta_changed, own_key
from modelcache.kube.events import EventRecorder
from modelcache.kube.informer import ADDED, DELETED, Informer
from modelcache.kube.objects import meta
from modelcache.kube.predicates import (
    MODIFIED,
    Predicate,
    all_of,
    annotations_of,
    deletion_of,
    event_in,
    labels_of,
    on_update,
    spec_of,
)
from modelcache.kube.types import MODEL_DOWNLOAD_ERROR, MODEL_DOWNLOADED
from modelcache.kube.views import CacheView, LocalModelNodeView

Obj = dict[str, Any]


@dataclass
class Options:
    mutate_services: bool = False
    workers: int = 2
    #: Our namespace's uid (see coordinator/uninstall.py); None: unknown.
    install_uid: str | None = None


def counted(name: str, reconcile: Callable[[str], Result]) -> Callable[[str], Result]:
    def run(key: str) -> Result:
        try:
            result = reconcile(key)
        except Exception:
            metrics.RECONCILES.labels(name, "error").inc()
            raise
        metrics.RECONCILES.labels(name, "ok").inc()
        return result
    return run


# The predicates of the watches below (modelcache/kube/predicates.py): every add and delete, and
# an update only when one of these views of the object changed.
#: Nodes: label changes and readiness flips; not the kubelet's heartbeats.
node_changed = on_update(labels_of, node_ready)
#: What can change a cache's members: not our own downloaded-model labels.
node_membership_changed = on_update(user_labels, node_ready)


def _reports(obj: Obj | None) -> Any:
    """What the believed states depend on (coordinator.reports): ``modelStatus``, the storageKey
    each detail names, whether a copy is counted on KServe's word (``verification``, for the
    caches' CopiesVerified), and the Node the agent reported for; not the agent's progress."""
    lmn = LocalModelNodeView(obj)
    details = {k: lmn.detail(k) for k in lmn.model_details}
    keys = {k: d.get("storageKey") for k, d in details.items() if d.get("storageKey")}
    verification = {k: d.get("verification") for k, d in details.items() if d.get("verification")}
    # modelStatus as written (absent and {} differ), as before the view.
    return lmn.status.get("modelStatus"), keys, verification, lmn.node_uid


#: LocalModelNode spec or reported-state changes; not the agent's progress details.
entries_or_states_changed = on_update(spec_of, _reports)
#: A service's labels, annotations or deletion (what makes it ask for a cache).
service_meta_changed = on_update(labels_of, annotations_of, deletion_of)
#: A cache's spec or its deletion; not its status.
cache_spec_changed = on_update(spec_of, deletion_of)
#: PVs and PVCs: only their coming and going.
volume_exists = event_in(ADDED, DELETED)


#: A cache's own events that urge its status: a changed spec or its deletion, not its creation
#: (a new cache's first status is progress: coordinator/pacing.py) and not its status or
#: finalizer (each status write came back as an update that urged the next one: 12.5 status
#: writes per cache at 10,000 nodes, one a second per cache instead of the pace).
cache_spec_updated = all_of(event_in(MODIFIED), cache_spec_changed)


def urging(pacer: StatusPacer, mapper: Callable[[str, Obj, Obj | None], Iterable[str]],
           when: Predicate | None = None) -> Callable[[str, Obj, Obj | None], list[str]]:
    """``mapper``, whose caches' next status is shown at once (not paced); with ``when``, only
    after the events it passes (the others wake the caches all the same)."""
    def mapped(event: str, obj: Obj, old: Obj | None) -> list[str]:
        keys = list(mapper(event, obj, old))
        if when is None or when(event, obj, old):
            pacer.urge(keys)
        return keys
    return mapped


def lost_or_failed(event: str, obj: Obj, old: Obj | None) -> list[str]:
    """Caches whose entry on this LocalModelNode was reported ModelDownloaded and no longer is
    (or the entry or the object went), or is now reported ModelDownloadError."""
    before, after = (obj, None) if event == DELETED else (old, obj)
    was, now = LocalModelNodeView(before).model_status, LocalModelNodeView(after).model_status
    out = set()
    for o in (before, after):
        for entry in LocalModelNodeView(o).entries:
            skey = entry.key  # the entry's modelStatus key is its cache's key
            if (was.get(skey) == MODEL_DOWNLOADED and now.get(skey) != MODEL_DOWNLOADED) or (
                    now.get(skey) == MODEL_DOWNLOAD_ERROR and was.get(skey) != MODEL_DOWNLOAD_ERROR):
                out.add(skey)
    return sorted(out)


@dataclass
class Wiring:
    """What wiring a service kind discovered after start needs (see :func:`wire_services`)."""

    view: ClusterView
    manager: Manager
    options: Options
    #: (cache controller, its service -> cache keys mapper)
    cache_watchers: list[tuple[Controller, Callable[[str, Obj, Obj | None], list[str]]]] = field(default_factory=list)
    #: The one pace of both kinds of cache's status writes.
    pacer: StatusPacer = field(default_factory=StatusPacer)
    #: Holds the node reconciler's writes while caches are still arriving.
    burst: CacheBurst = field(default_factory=CacheBurst)


def build(view: ClusterView, recorder: EventRecorder, options: Options | None = None) -> Manager:
    return build_wiring(view, recorder, options).manager


def build_wiring(view: ClusterView, recorder: EventRecorder, options: Options | None = None) -> Wiring:
    options = options or Options()
    manager = Manager()
    wiring = Wiring(view, manager, options)
    cache_controllers: list[tuple[Controller, bool]] = []
    pacer = wiring.pacer
    for namespaced in (False, True):
        rec = CacheReconciler(view, recorder, namespaced, options.install_uid, pacer)
        ctl = Controller(rec.name, counted(rec.name, rec), workers=options.workers)
        own = view.ns_caches if namespaced else view.caches

        def mine(keys: Iterable[str], ns: bool = namespaced) -> list[str]:
            return cache_keys_for_kind(sorted(set(keys)), ns)

        def all_caches(_e: str, _o: Obj, _old: Obj | None, inf: Any = own) -> list[str]:
            return inf.store.keys()

        def by_group(_e: str, obj: Obj, old: Obj | None, inf: Any = own) -> list[str]:
            names = {meta(obj).name, meta(old).name}
            return [k for k in inf.store.keys()  # noqa: SIM118 (Store is not a dict)
                    if names & set(CacheView(inf.store.get_raw(k)).node_groups)]

        def by_entries(_e: str, obj: Obj, old: Obj | None, mine: Any = mine, ns: bool = namespaced) -> list[str]:
            keys = mine([*entry_cache_keys(obj), *entry_cache_keys(old)])
            if ns:  # a namespace cache's claim waits on its first Downloaded report: progress wakes it
                return keys
            # A member's progress does not wake a cache whose status waits for its pace (it is
            # requeued for then) while other members are still to report: each report woke its
            # node's 20 caches (bench/coordinator_scale.py: 200 caches over 10 groups). The last
            # report still wakes it, to be shown at once; copies lost or failed are urged below.
            pending = view.lmns.store
            return [k for k in keys if not (pacer.paced(k) and pending.count(PENDING, k) > 0)]

        def by_service(_e: str, obj: Obj, old: Obj | None, mine: Any = mine) -> list[str]:
            return mine([*service_cache_keys(obj), *service_cache_keys(old)])

        def by_volume(_e: str, obj: Obj, old: Obj | None, mine: Any = mine) -> list[str]:
            return mine([*volume_cache_keys(obj), *volume_cache_keys(old)])

        def by_lost_copies(e: str, obj: Obj, old: Obj | None, mine: Any = mine) -> list[str]:
            return mine(lost_or_failed(e, obj, old))

        ctl.watch(own, urging(pacer, own_key, cache_spec_updated))
        ctl.watch(view.groups, urging(pacer, by_group))
        ctl.watch(view.nodes, urging(pacer, all_caches), node_membership_changed)
        # A member's progress is paced (coordinator/pacing.py); a copy lost or a failure is not.
        ctl.watch(view.lmns, by_entries, entries_or_states_changed)
        ctl.watch(view.lmns, urging(pacer, by_lost_copies), entries_or_states_changed)
        wiring.cache_watchers.append((ctl, urging(pacer, by_service)))
        ctl.watch(view.pvs, urging(pacer, by_volume), volume_exists)
        ctl.watch(view.pvcs, urging(pacer, by_volume), volume_exists)
        manager.add(ctl)
        cache_controllers.append((ctl, namespaced))

    nodes = NodeReconciler(view, wiring.burst)
    node_ctl = Controller("node", counted("node", nodes), workers=options.workers)
    # Not for the events of its own writes: a LocalModelNode it created or updated, a Node it
    # labelled (2 of 6 reconciles per node at 10,000 nodes, each computing what it just wrote).
    node_ctl.watch(view.nodes, own_key, all_of(nodes.own_nodes.not_echo, node_changed))
    node_ctl.watch(view.lmns, own_key, all_of(nodes.own_lmns.not_echo, entries_or_states_changed))

    def cache_nodes(_e: str, obj: Obj, old: Obj | None) -> list[str]:
        """A cache's members (before and after) and the nodes holding its entry; while caches are
        still arriving, these are woken when the burst's hold ends, not now (their reconcile
        would be told to wait: bench/coordinator_scale.py at 2,000 nodes and 200 caches, 52,337
        node reconciles to converge, 26 per node)."""
        wiring.burst.saw()
        out: set[str] = set()
        for o in (obj, old):
            if o is None:
                continue
            out.update(view.members(CacheView(o).node_groups))
            out.update(meta(lmn).name for lmn in view.lmns.store.by_index(BY_CACHE, meta(o).key, copy_objects=False))
        held = wiring.burst.hold()
        if held > 0:
            for key in out:
                node_ctl.queue.add_after(key, held)  # once per node however many caches arrive
            return []
        return sorted(out)

    def all_nodes(_e: str, _o: Obj, _old: Obj | None) -> list[str]:
        return view.nodes.store.keys()

    node_ctl.watch(view.caches, cache_nodes, cache_spec_changed)
    node_ctl.watch(view.ns_caches, cache_nodes, cache_spec_changed)
    node_ctl.watch(view.groups, all_nodes)
    manager.add(node_ctl)

    for inf in view.service_informers():
        res = INFERENCE_SERVICES if inf is view.isvcs else view.llm_resource
        assert res is not None
        wire_services(wiring, inf, res)
    return wiring


def wire_services(wiring: Wiring, inf: Informer, res: Resource) -> list[Controller]:
    """Connect one service kind's informer: caches list its services, and (unless KServe's
    webhook does it) a controller keeps the services' local-model label and annotations.
    Returns the new controllers (already added to the manager, not started)."""
    view = wiring.view
    if inf not in wiring.manager.informers:
        wiring.manager.informers.append(inf)
    for ctl, by_service in wiring.cache_watchers:
        ctl.watch(inf, by_service, service_meta_changed)
    if not wiring.options.mutate_services:
        return []
    uri_of = isvc_storage_uri if res.plural == INFERENCE_SERVICES.plural else llmisvc_model_uri
    svc = ServiceReconciler(view, inf, res, uri_of)
    svc_ctl = Controller(res.kind, counted(res.kind, svc), workers=wiring.options.workers)
    svc_ctl.watch(inf, own_key, generation_or_meta_changed)

    def every_service(_e: str, _o: Obj, _old: Obj | None) -> list[str]:
        return inf.store.keys()

    svc_ctl.watch(view.caches, every_service, cache_spec_changed)
    svc_ctl.watch(view.ns_caches, every_service, cache_spec_changed)
    wiring.manager.add(svc_ctl)
    return [svc_ctl]
