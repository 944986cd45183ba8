"""The coordinator's write budget at scale, without a cluster: cache status pacing
(coordinator/pacing.py), the events that urge a cache's status, the index that tells whether
members still report, and the node-group labels agents watch their peers by.
bench/coordinator_scale.py measures what these save on the real control plane."""

from __future__ import annotations

import copy
import threading
import time
from typing import Any

from kubernetes.client import ApiClient
from kubernetes.client.exceptions import ApiException

from coordinator.controllers import build_wiring, lost_or_failed
from coordinator.entries import desired_entry
from coordinator.nodes import group_labels, group_labels_differ
from coordinator.pacing import CacheBurst, StatusPacer
from coordinator.view import BY_CACHE, ClusterView, cache_key, pending_cache_keys, service_cache_keys
from modelcache.kube.client import INFERENCE_SERVICES, Kube
from modelcache.kube.events import EventRecorder
from modelcache.kube.informer import Informer, Store
from modelcache.kube.types import (
    CACHE_FINALIZER,
    LOCALMODEL_LABEL,
    LOCALMODEL_NAMESPACE_LABEL,
    NAMESPACE_CACHE_FINALIZER,
    node_group_label,
)


class Clock:
    def __init__(self) -> None:
        self.now = 100.0

    def __call__(self) -> float:
        return self.now


def test_progress_is_paced_across_caches_and_what_matters_is_not() -> None:
    clock = Clock()
    pacer = StatusPacer(rate=0.5, min_interval=1.0, window=30.0, clock=clock)
    # A new cache is paced from its first ask: alone, one interval (1 / rate) later.
    assert pacer.wait("a", progress=True) == 2.0
    clock.now += 2.0
    assert pacer.wait("a", progress=True) == 0
    pacer.wrote("a")
    clock.now += 1.0
    # Alone, a cache reporting progress writes every 1 / rate seconds.
    assert pacer.wait("a", progress=True) == 1.0
    clock.now += 1.0
    assert pacer.wait("a", progress=True) == 0
    pacer.wrote("a")
    # 20 caches reporting at once share the pace: each every 20 / 0.5 = 40 s.
    for i in range(19):
        assert pacer.wait(f"c{i}", progress=True) == 2.0 * (i + 2)  # new: a whole interval
        pacer.wrote(f"c{i}")
    assert pacer.interval() == 40.0
    clock.now += 5
    assert pacer.wait("a", progress=True) == 35.0
    # The last member reported (nothing pending): only the 1 s between two writes applies.
    assert pacer.wait("a", progress=False) == 0
    pacer.wrote("a")
    clock.now += 0.5
    assert pacer.wait("a", progress=False) == 0.5
    # A copy lost urges the cache: its next write is not paced, once.
    clock.now += 1.0
    pacer.urge(["a"])
    assert pacer.wait("a", progress=True) == 0
    pacer.wrote("a")
    clock.now += 1.0
    assert pacer.wait("a", progress=True) > 30
    # Caches that stopped asking stop counting after the window.
    clock.now += 31
    assert pacer.wait("a", progress=True) == 0 and pacer.interval() == 2.0
    pacer.forget("a")
    assert pacer.wait("a", progress=True) == 2.0  # new again


def test_a_new_caches_first_status_is_paced_unless_urged_or_done() -> None:
    """bench/coordinator_scale.py at 10,000 nodes: 200 new caches each wrote 1,000 members'
    pending nodeStatus at once (7 MB, 17.5 % of the coordinator's API time)."""
    clock = Clock()
    pacer = StatusPacer(rate=0.5, min_interval=1.0, window=1000.0, clock=clock)
    for i in range(200):
        pacer.wait(f"c{i}", progress=True)
    assert pacer.interval() == 400.0
    clock.now += 100
    assert pacer.wait("c0", progress=True) == 300.0  # counted from its first ask, not written yet
    assert pacer.wait("new", progress=True) == 402.0  # one more cache asking: a whole interval
    assert pacer.wait("done", progress=False) == 0  # every member reported: shown at once
    pacer.urge(["c1"])
    assert pacer.wait("c1", progress=True) == 0  # what must show now still does
    clock.now += 302
    assert pacer.wait("c0", progress=True) == 0
    pacer.wrote("c0")
    clock.now += 1
    assert pacer.wait("c0", progress=True) == 401.0  # written: paced from its write as before


def test_a_caches_own_creation_and_status_writes_do_not_urge_it_a_spec_change_does() -> None:
    """Each status write comes back as an update of the cache; when it urged the next write, a
    cache wrote once a second whatever the pace (2,492 status writes for 200 caches at 10,000
    nodes)."""
    view = ClusterView.build(Kube(ApiClient()), with_services=False)
    wiring = build_wiring(view, EventRecorder(view.kube, "test"))
    clock = Clock()
    wiring.pacer.clock = clock
    cache = {"metadata": {"name": "c", "resourceVersion": "1"},
             "spec": {"sourceModelUri": "s3://b/m", "nodeGroups": ["g"]}}

    def event(kind: str, **changes: Any) -> None:
        """The watch event of the cache, changed (and with a new resourceVersion)."""
        obj = copy.deepcopy(view.caches.store.get_raw("c") or cache)
        rv = int(obj["metadata"]["resourceVersion"])
        obj.update(copy.deepcopy(changes))
        obj["metadata"]["resourceVersion"] = str(rv + 1)
        view.caches._event({"type": kind, "object": obj})

    event("ADDED")
    assert wiring.pacer.wait("c", progress=True) == 2.0  # created: paced
    clock.now += 2
    wiring.pacer.wrote("c")
    event("MODIFIED", status={"copies": {"available": 0, "total": 1000}})  # our own write, back
    event("MODIFIED", metadata={**cache["metadata"], "finalizers": ["localmodel.kserve.io/finalizer"]})
    clock.now += 1
    assert wiring.pacer.wait("c", progress=True) == 1.0  # still paced: one interval after the write
    event("MODIFIED", spec={**cache["spec"], "nodeGroups": ["g", "h"]})
    assert wiring.pacer.wait("c", progress=True) == 0  # a spec change shows at once
    assert [len(ctl.queue) for ctl in wiring.manager.controllers if ctl.name == "LocalModelCache"] == [1]


def lmn(models: dict[str, str | None], **status: Any) -> dict[str, Any]:
    return {"metadata": {"name": "n1"},
            "spec": {"localModels": [{"modelName": m, "sourceModelUri": f"s3://b/{m}", "nodeGroup": "g"}
                                     for m in models]},
            "status": {"modelStatus": {m: s for m, s in models.items() if s}, **status}}


def test_pending_index_counts_entries_not_yet_done_or_failed() -> None:
    store = Store({"pending": pending_cache_keys})
    store.put(lmn({"a": None, "b": "ModelDownloading", "c": "ModelDownloaded", "d": "ModelDownloadError"}))
    assert [store.count("pending", k) for k in "abcd"] == [1, 1, 0, 0]
    store.put(lmn({"a": "ModelDownloaded", "b": "ModelDownloaded"}))
    assert store.count("pending", "a") == store.count("pending", "b") == 0


def test_copies_lost_and_failures_urge_progress_does_not() -> None:
    was = lmn({"a": "ModelDownloaded", "b": "ModelDownloading", "c": "ModelDownloading"})
    now = lmn({"a": "ModelDownloading", "b": "ModelDownloadError", "c": "ModelDownloaded"})
    assert lost_or_failed("MODIFIED", now, was) == ["a", "b"]
    assert lost_or_failed("MODIFIED", was, lmn({"a": None, "b": None, "c": None})) == []
    assert lost_or_failed("DELETED", was, None) == ["a"]  # a copy went with the object


def test_local_model_nodes_are_labelled_by_the_groups_of_their_entries() -> None:
    models = [{"modelName": "a", "nodeGroup": "gpu"}, {"modelName": "b", "nodeGroup": "gpu"},
              {"modelName": "c", "nodeGroup": "x" * 200}]
    labels = group_labels(models)
    assert labels == {"nodegroup.modelcache.io/gpu": "true", node_group_label("x" * 200): "true"}
    assert all(len(k.split("/")[1]) <= 63 for k in labels)  # a long group name is hashed to fit
    obj = {"metadata": {"labels": {**labels, "team": "a"}}}
    assert not group_labels_differ(obj, models)
    assert group_labels_differ(obj, models[:1])
    assert group_labels_differ({"metadata": {}}, models)


def test_a_burst_of_caches_holds_node_writes_until_it_is_over_or_too_long() -> None:
    clock = Clock()
    burst = CacheBurst(quiet=1.0, longest=30.0, clock=clock)
    assert burst.hold() == 0  # no cache ever changed
    burst.saw()
    assert burst.hold() == 1.0
    for _ in range(10):  # one every half second: still the same burst
        clock.now += 0.5
        burst.saw()
    assert burst.hold() == 1.0
    clock.now += 1.0
    assert burst.hold() == 0  # a second without a change: over
    for _ in range(100):  # a steady stream holds for at most `longest` from its start
        burst.saw()
        clock.now += 0.5
    assert burst.hold() == 0
    clock.now += 5
    burst.saw()  # a new burst
    assert burst.hold() == 1.0


def test_a_nodes_entries_wait_while_caches_arrive_and_its_status_writes_do_not_count() -> None:
    """bench/coordinator_scale.py at 10,000 nodes, 200 caches created one after another: 391
    nodes reconciled meanwhile were written twice (LocalModelNode update, Node label patch)."""
    view = ClusterView.build(Kube(ApiClient()), with_services=False)  # no server: a write would fail
    wiring = build_wiring(view, EventRecorder(view.kube, "test"))
    clock = Clock()
    wiring.burst.clock = clock
    node_ctl = next(ctl for ctl in wiring.manager.controllers if ctl.name == "node")
    view.nodes._event({"type": "ADDED", "object": {
        "metadata": {"name": "n1", "resourceVersion": "1", "labels": {"pool": "a"}},
        "status": {"conditions": [{"type": "Ready", "status": "True"}]}}})
    cache = {"metadata": {"name": "c", "resourceVersion": "1"}, "spec": {"sourceModelUri": "s3://b/m"}}
    view.caches._event({"type": "ADDED", "object": cache})
    assert wiring.burst.hold() == 1.0
    assert node_ctl.reconcile("n1").requeue_after == 1.0  # held: nothing written
    clock.now += 5
    assert wiring.burst.hold() == 0
    view.caches._event({"type": "MODIFIED", "object": {
        **cache, "metadata": {"name": "c", "resourceVersion": "2"}, "status": {"copies": {"total": 1}}}})
    assert wiring.burst.hold() == 0  # a status write is not a cache arriving


def group(name: str, pool: str) -> dict[str, Any]:
    """A node group whose PV selects the nodes labelled pool=<pool>."""
    terms = [{"matchExpressions": [{"key": "pool", "operator": "In", "values": [pool]}]}]
    return {"metadata": {"name": name, "resourceVersion": "1"},
            "spec": {"persistentVolumeSpec": {"storageClassName": "local", "capacity": {"storage": "1Gi"},
                                              "nodeAffinity": {"required": {"nodeSelectorTerms": terms}}},
                     "persistentVolumeClaimSpec": {"resources": {"requests": {"storage": "1Gi"}}}}}


def node(name: str, pool: str) -> dict[str, Any]:
    return {"metadata": {"name": name, "uid": f"uid-{name}", "resourceVersion": "1", "labels": {"pool": pool}},
            "status": {"conditions": [{"type": "Ready", "status": "True"}]}}


def add(inf: Any, obj: dict[str, Any]) -> None:
    inf._event({"type": "ADDED", "object": obj})


class Writes:
    """Stands in for the API server's writes (the informers are fed by hand): records them."""

    def __init__(self, kube: Kube) -> None:
        self.done: list[tuple[str, str, str]] = []
        kube.create = self.create  # type: ignore[method-assign]

    def create(self, res: Any, body: dict[str, Any], namespace: str | None = None) -> dict[str, Any]:
        self.done.append(("create", res.kind, body["metadata"]["name"]))
        return body


def rollout(namespaced: bool, members: int = 50, service: bool = True) -> tuple[ClusterView, Any, Writes, str]:
    """A cache of group ga over ``members`` nodes, each with its entry written and not reported
    yet, used by a service in namespace team (``service``); returns the view, the wiring, the
    recorded writes and the cache's key."""
    view = ClusterView.build(Kube(ApiClient()), with_services=False)
    view.isvcs = Informer(view.kube, INFERENCE_SERVICES, indexers={BY_CACHE: service_cache_keys})
    wiring = build_wiring(view, EventRecorder(view.kube, "test"))
    writes = Writes(view.kube)
    add(view.groups, group("ga", "a"))
    ns = "team" if namespaced else None
    cache = {"metadata": {"name": "c", "resourceVersion": "1", "uid": "uid-c",
                          "finalizers": [NAMESPACE_CACHE_FINALIZER if namespaced else CACHE_FINALIZER],
                          **({"namespace": ns} if ns else {})},
             "spec": {"sourceModelUri": "s3://b/m", "nodeGroups": ["ga"]}}
    for i in range(members):
        add(view.nodes, node(f"n{i}", "a"))
    if service:
        labels = {LOCALMODEL_LABEL: "c", **({LOCALMODEL_NAMESPACE_LABEL: ns} if ns else {})}
        add(view.isvcs, {"metadata": {"name": "svc", "namespace": "team", "resourceVersion": "1", "labels": labels}})
    add(view.ns_caches if namespaced else view.caches, cache)
    for i in range(members):
        add(view.lmns, {"metadata": {"name": f"n{i}", "resourceVersion": "1"},
                        "spec": {"localModels": [desired_entry(cache, "ga")]}})
    wiring.pacer.forget(cache_key(ns, "c"))  # what setting up urged (members joined, a service came)
    return view, wiring, writes, cache_key(ns, "c")


def test_a_paced_cache_reconcile_copies_nothing_and_reads_no_member(monkeypatch: Any) -> None:
    """py-spy at 10,000 nodes: 13.6 % of the coordinator's samples in cache reconciles that end
    paced, after a deep copy of the cache (1,000 members' nodeStatus: 4.4 %) and the members'
    lock (4.2 %)."""
    view, wiring, writes, key = rollout(namespaced=False, service=False)
    ctl = next(c for c in wiring.manager.controllers if c.name == "LocalModelCache")
    copies, reads, members = [0], [0], [0]
    real_copy, lmn_get, node_get, real_members = copy.deepcopy, view.lmns.store.get_raw, view.nodes.store.get_raw, \
        view.members

    def counting(*args: Any, **kw: Any) -> Any:
        copies[0] += 1
        return real_copy(*args, **kw)

    def read(get: Any) -> Any:
        def reading(k: str) -> Any:
            reads[0] += 1
            return get(k)
        return reading

    def asked(groups: list[str]) -> Any:
        members[0] += 1
        return real_members(groups)

    monkeypatch.setattr(copy, "deepcopy", counting)
    monkeypatch.setattr(view.lmns.store, "get_raw", read(lmn_get))
    monkeypatch.setattr(view.nodes.store, "get_raw", read(node_get))
    monkeypatch.setattr(view, "members", asked)
    assert ctl.reconcile(key).requeue_after == 2.0  # paced: a new cache, its members reporting
    assert (copies[0], reads[0], members[0], writes.done) == (0, 0, 0, [])


def test_a_namespace_caches_claim_is_made_while_its_status_is_paced() -> None:
    """The claim waits on the cache's first Downloaded report (CacheReconciler.entitled); that
    report is progress, whose status is paced (400 s with 200 caches): the claim must not wait too."""
    view, wiring, writes, key = rollout(namespaced=True)
    ctl = next(c for c in wiring.manager.controllers if c.name == "LocalModelNamespaceCache")
    assert ctl.reconcile(key).requeue_after == 2.0 and writes.done == []  # no member reported: no claim
    lmn = copy.deepcopy(view.lmns.store.get_raw("n7"))
    lmn["metadata"]["resourceVersion"] = "2"
    lmn["status"] = {"modelStatus": {key: "ModelDownloaded"}, "nodeUID": "uid-n7"}
    view.lmns._event({"type": "MODIFIED", "object": lmn})
    wait = ctl.reconcile(key).requeue_after
    assert wait is not None and wait > 0  # the status is still paced (49 members reporting) ...
    assert [(verb, kind) for verb, kind, _name in writes.done] == [  # ... the claim is not
        ("create", "PersistentVolume"), ("create", "PersistentVolumeClaim")]


def two_groups_of_caches() -> tuple[ClusterView, Writes, Any]:
    """Node n1 in group ga of two (ga, gb), 20 caches alternating between them, their burst long
    over: the view, the recorded writes and the node controller."""
    view = ClusterView.build(Kube(ApiClient()), with_services=False)
    wiring = build_wiring(view, EventRecorder(view.kube, "test"))
    writes = Writes(view.kube)
    add(view.groups, group("ga", "a"))
    add(view.groups, group("gb", "b"))
    add(view.nodes, node("n1", "a"))
    for i in range(20):
        add(view.caches, {"metadata": {"name": f"c{i}", "resourceVersion": "1"},
                          "spec": {"sourceModelUri": f"s3://b/m{i}", "nodeGroups": ["ga" if i % 2 else "gb"]}})
    wiring.burst.clock = lambda: 1e9  # the caches' burst is long over
    return view, writes, next(ctl for ctl in wiring.manager.controllers if ctl.name == "node")


def test_a_nodes_reconcile_asks_the_members_once_per_group_not_per_cache(monkeypatch: Any) -> None:
    """py-spy at 10,000 nodes: 7.1 % of samples waiting on the members' lock, taken once per cache
    (200) in each node's reconcile, for caches that share 10 groups."""
    view, writes, node_ctl = two_groups_of_caches()
    asked: list[tuple[str, ...]] = []
    real = view.members
    monkeypatch.setattr(view, "members", lambda groups: asked.append(tuple(groups)) or real(groups))
    node_ctl.reconcile("n1")
    assert sorted(asked) == [("ga",), ("gb",)]
    assert writes.done == [("create", "LocalModelNode", "n1")]


def test_workers_asking_for_a_groups_members_at_once_compute_them_once(monkeypatch: Any) -> None:
    """16 node workers that miss the members of one group together: one pass over the Nodes, the
    others wait for it (bench/coordinator_scale.py at 3,000 nodes: 40 passes for 10 groups), and a
    change of membership while it ran is not kept for later askers."""
    import coordinator.view as view_module

    view, _writes, _ctl = two_groups_of_caches()
    add(view.nodes, node("n0", "b"))  # a Node added: every group's members are asked again
    passes: list[tuple[str, ...]] = []
    inside = threading.Event()
    release = threading.Event()
    real = view_module.place

    def slow_place(groups: Any, *args: Any) -> Any:
        passes.append(tuple(groups))
        inside.set()
        release.wait(10)
        return real(groups, *args)

    monkeypatch.setattr(view_module, "place", slow_place)
    results: list[Any] = []
    entered = threading.Semaphore(0)

    def ask() -> None:
        entered.release()
        results.append(view.members(["ga"]))

    askers = [threading.Thread(target=ask) for _ in range(16)]
    for t in askers:
        t.start()
    assert inside.wait(10)
    for _ in askers:
        assert entered.acquire(timeout=10)
    time.sleep(0.2)  # all 16 are in members(): without the gate each would be in place() by now
    release.set()
    for t in askers:
        t.join(10)
    assert passes == [("ga",)] and len(results) == 16
    assert all(r is results[0] for r in results) and set(results[0]) == {"n1"}
    # A membership change bumps the epoch: the next asker computes again and sees it.
    add(view.nodes, node("n2", "a"))
    assert set(view.members(["ga"])) == {"n1", "n2"} and passes == [("ga",), ("ga",)]


def report_downloaded(view: ClusterView, node_name: str, key: str) -> None:
    """The agent's status patch of ``node_name``'s LocalModelNode, as its watch event."""
    lmn = copy.deepcopy(view.lmns.store.get_raw(node_name))
    lmn["metadata"]["resourceVersion"] = str(int(lmn["metadata"]["resourceVersion"]) + 1)
    lmn["status"] = {"modelStatus": {key: "ModelDownloaded"}, "nodeUID": f"uid-{node_name}"}
    view.lmns._event({"type": "MODIFIED", "object": lmn})


def drained(queue: Any) -> list[str]:
    """The keys queued now (each marked done)."""
    keys = []
    while len(queue):
        key = queue.get(timeout=1)
        queue.done(key)
        keys.append(key)
    return keys


def test_the_node_controller_is_not_woken_by_its_own_writes_but_by_anyone_elses(monkeypatch: Any) -> None:
    """bench/coordinator_scale.py at 10,000 nodes: 6 node reconciles per node to converge, two of
    them for the events of the node controller's own LocalModelNode create and label patch."""
    view, _writes, node_ctl = two_groups_of_caches()
    versions = iter(range(10, 100))
    written: list[dict[str, Any]] = []

    def stored(body: dict[str, Any]) -> dict[str, Any]:  # what the API server answers a write with
        out = {**copy.deepcopy(body), "metadata": {**body["metadata"], "resourceVersion": str(next(versions))}}
        written.append(out)
        return copy.deepcopy(out)

    def patch(_res: Any, name: str, body: dict[str, Any], namespace: str | None = None, **kw: Any) -> dict[str, Any]:
        assert kw == {"metadata_only": True}  # a label patch needs only the metadata back
        node_now = copy.deepcopy(view.nodes.store.get_raw(name))
        labels = {**node_now["metadata"]["labels"], **body["metadata"]["labels"]}
        node_now["metadata"]["labels"] = {k: v for k, v in labels.items() if v is not None}
        return stored(node_now)

    monkeypatch.setattr(view.kube, "create", lambda _res, body, namespace=None: stored(body))
    monkeypatch.setattr(view.kube, "patch", patch)
    drained(node_ctl.queue)
    node_ctl.reconcile("n1")
    created = written[-1]
    view.lmns._event({"type": "ADDED", "object": copy.deepcopy(created)})
    assert drained(node_ctl.queue) == []  # our own create
    report_downloaded(view, "n1", created["spec"]["localModels"][0]["modelName"])
    assert drained(node_ctl.queue) == ["n1"]  # the agent's report
    node_ctl.reconcile("n1")
    labelled = written[-1]
    assert len(labelled["metadata"]["labels"]) == 2  # pool, and the downloaded model's label
    view.nodes._event({"type": "MODIFIED", "object": copy.deepcopy(labelled)})
    assert drained(node_ctl.queue) == []  # our own label patch
    # Someone else takes the label off: that wakes it (and puts the label back).
    by_hand = copy.deepcopy(labelled)
    by_hand["metadata"].update(resourceVersion="99", labels={"pool": "a"})
    view.nodes._event({"type": "MODIFIED", "object": by_hand})
    assert drained(node_ctl.queue) == ["n1"]
    node_ctl.reconcile("n1")
    relabelled = written[-1]
    assert relabelled["metadata"]["labels"] == labelled["metadata"]["labels"]
    # A reconcile between our write and its event read the Node from before the write (our
    # informer lags our own patches): the event then wakes the controller, to look again.
    node_ctl.reconcile("n1")
    view.nodes._event({"type": "MODIFIED", "object": copy.deepcopy(relabelled)})
    assert drained(node_ctl.queue) == ["n1"]


def test_progress_does_not_wake_a_paced_cache_its_last_report_does() -> None:
    """Each LocalModelNode event woke its node's 20 caches (bench/coordinator_scale.py: 200
    caches over 10 groups), to be told by the pacer to wait."""
    view, wiring, _writes, key = rollout(namespaced=False, members=3, service=False)
    ctl = next(c for c in wiring.manager.controllers if c.name == "LocalModelCache")
    while len(ctl.queue):
        ctl.queue.done(ctl.queue.get(timeout=0))
    assert ctl.reconcile(key).requeue_after == 2.0  # paced, requeued for then
    report_downloaded(view, "n0", key)
    report_downloaded(view, "n1", key)
    assert len(ctl.queue) == 0  # progress: not woken before its time
    report_downloaded(view, "n2", key)
    assert len(ctl.queue) == 1  # the last report: shown at once


def test_progress_wakes_a_paced_namespace_cache_whose_claim_waits_on_a_report() -> None:
    view, wiring, _writes, key = rollout(namespaced=True, members=3)
    ctl = next(c for c in wiring.manager.controllers if c.name == "LocalModelNamespaceCache")
    while len(ctl.queue):
        ctl.queue.done(ctl.queue.get(timeout=0))
    assert ctl.reconcile(key).requeue_after == 2.0
    report_downloaded(view, "n0", key)
    assert len(ctl.queue) == 1


def test_caches_arriving_schedule_their_members_for_the_holds_end_instead_of_waking_them() -> None:
    """bench/coordinator_scale.py at 2,000 nodes and 200 caches: 52,337 node reconciles to
    converge (26 per node), most of them told to wait for the burst, each requeued again."""
    view = ClusterView.build(Kube(ApiClient()), with_services=False)
    wiring = build_wiring(view, EventRecorder(view.kube, "test"))
    clock = Clock()
    wiring.burst.clock = clock
    node_ctl = next(ctl for ctl in wiring.manager.controllers if ctl.name == "node")
    node_ctl.queue._clock = clock
    add(view.groups, group("ga", "a"))
    for i in range(3):
        add(view.nodes, node(f"n{i}", "a"))
    while len(node_ctl.queue):  # what the groups and nodes woke
        node_ctl.queue.done(node_ctl.queue.get(timeout=0))
    for i in range(20):  # a 200-cache apply, as one group sees it
        add(view.caches, {"metadata": {"name": f"c{i}", "resourceVersion": "1"},
                          "spec": {"sourceModelUri": f"s3://b/m{i}", "nodeGroups": ["ga"]}})
        clock.now += 0.05
    assert len(node_ctl.queue) == 0  # none woken while caches arrive ...
    assert node_ctl.queue.pending_delayed() == 3  # ... each member waits once, for the hold's end
    clock.now += 1.0
    assert sorted(str(node_ctl.queue.get(timeout=0)) for _ in range(3)) == ["n0", "n1", "n2"]


def test_a_key_added_after_many_times_waits_once_for_the_earliest() -> None:
    from modelcache.kube.workqueue import WorkQueue

    clock = Clock()
    q = WorkQueue(clock=clock)
    q.add_after("a", 5.0)
    q.add_after("a", 9.0)  # later: it waits already, for sooner
    q.add_after("a", 2.0)  # sooner: now it waits for this
    assert q.pending_delayed() == 1
    clock.now += 2.0
    assert q.get(timeout=0) == "a"
    q.done("a")
    clock.now += 10.0
    assert q.get(timeout=0) is None  # not again for the stale 5 s and 9 s


def test_a_nodes_reconcile_reads_its_own_groups_caches_and_its_entries_not_every_cache(monkeypatch: Any) -> None:
    """Offline, the bench's event flow (1,000 nodes, 200 caches over 10 groups): a node's
    reconcile went through all 200 caches, three times per node; only its group's 20 and the
    caches its entries name can change its entries."""
    import coordinator.nodes as nodes_mod

    view, writes, node_ctl = two_groups_of_caches()
    seen: list[tuple[list[str], list[str]]] = []  # (the caches read, the entries' caches wanted)
    real = nodes_mod.desired_models

    def recorded(node: str, current: Any, caches: Any, *a: Any) -> Any:
        out = real(node, current, caches, *a)
        seen.append((sorted(caches), sorted(m["modelName"] for m in out)))
        return out

    monkeypatch.setattr(nodes_mod, "desired_models", recorded)
    node_ctl.reconcile("n1")
    odd, even = sorted(f"c{i}" for i in range(1, 20, 2)), sorted(f"c{i}" for i in range(0, 20, 2))
    assert seen == [(odd, odd)]
    assert writes.done == [("create", "LocalModelNode", "n1")]
    # n1 moves from ga to gb: the caches its entries name (ga's) are read, and take theirs away
    add(view.lmns, {"metadata": {"name": "n1", "resourceVersion": "1", "labels": {node_group_label("ga"): "true"}},
                    "spec": {"localModels": [desired_entry(view.caches.store.get_raw(c), "ga") for c in odd]}})
    moved = node("n1", "b")
    moved["metadata"]["resourceVersion"] = "2"
    view.nodes._event({"type": "MODIFIED", "object": moved})
    replaced: list[dict[str, Any]] = []
    monkeypatch.setattr(view.kube, "replace", lambda res, obj, ns=None: replaced.append(obj) or obj)
    stored = copy.deepcopy(view.lmns.store.get_raw("n1"))
    seen.clear()
    node_ctl.reconcile("n1")
    assert seen[0] == (sorted(odd + even), even)
    assert [m["modelName"] for m in replaced[0]["spec"]["localModels"]] == even
    assert view.lmns.store.get_raw("n1") == stored  # the update edited a copy, not the informer's object


def test_an_entry_leaving_takes_its_label_off_even_when_our_node_copy_does_not_show_it_yet() -> None:
    """The Node informer can lag our own label patch of a moment ago: the label an entry's report
    justified is dropped with the entry, whatever our copy of the Node shows, so it never outlives
    the folder the agent deletes on seeing the entry go (the chaos test saw it stay 2-3 s)."""
    from coordinator.nodelabels import LABEL_PREFIX, model_label
    from coordinator.nodes import NodeReconciler
    from modelcache.sources.uri import storage_key

    view = ClusterView.build(Kube(ApiClient()), with_services=False)
    patches: list[dict[str, Any]] = []
    view.kube.patch = lambda res, name, body, *a, **kw: patches.append(body) or body  # type: ignore[method-assign]
    cache = {"metadata": {"name": "c", "resourceVersion": "1"}, "spec": {"sourceModelUri": "s3://b/m",
                                                                         "nodeGroups": ["ga"]}}
    entry = desired_entry(cache, "ga")
    reported = {"metadata": {"name": "n1", "resourceVersion": "7"}, "spec": {"localModels": []},
                "status": {"nodeUID": "uid-n1", "modelStatus": {"c": "ModelDownloaded"},
                           "modelDetails": {"c": {"storageKey": storage_key("s3://b/m")}}}}
    stale = node("n1", "a")  # our copy: the label we patched on is not in it yet
    other = LABEL_PREFIX + "0123456789abcdef"  # a label no entry justifies, shown in our copy
    shown = {**node("n1", "a"), "metadata": {**node("n1", "a")["metadata"],
                                             "labels": {"pool": "a", other: "true"}}}
    rec = NodeReconciler(view)
    rec._withdraw_labels(stale, reported, [entry], [])
    assert patches == [{"metadata": {"labels": {model_label("s3://b/m"): None}}}]
    patches.clear()
    rec._withdraw_labels(shown, reported, [entry], [entry])  # the entry stays: only the unjustified label goes
    assert patches == [{"metadata": {"labels": {other: None}}}]
    assert other not in shown["metadata"]["labels"] and shown["metadata"]["labels"]["pool"] == "a"


def test_a_reconcile_behind_our_own_update_does_not_put_back_the_label_of_an_entry_that_left() -> None:
    """The chaos test (seed 3397273558): two reconciles of one node 11 ms apart. The first took
    entry ``c`` off (its cache is deleting) and its label with it; the second still had the
    LocalModelNode from before that update in its informer, computed the same removal, got 409,
    read the object again and had nothing to write, and then computed the Node's labels from its
    stale copy, which still listed ``c`` as downloaded: the label came back while the agent was
    deleting the model (5 s, until the next leader)."""
    from coordinator.nodelabels import model_label
    from coordinator.nodes import NodeReconciler
    from modelcache.sources.uri import storage_key

    view = ClusterView.build(Kube(ApiClient()), with_services=False)
    add(view.groups, group("ga", "a"))
    caches = {}
    for name in ("anchor", "c"):
        caches[name] = {"metadata": {"name": name, "resourceVersion": "1"},
                        "spec": {"sourceModelUri": f"s3://b/{name}", "nodeGroups": ["ga"]}}
    caches["c"]["metadata"]["deletionTimestamp"] = "2026-12-03T12:01:51Z"
    for cache in caches.values():
        add(view.caches, cache)
    status = {"nodeUID": "uid-n1", "modelStatus": {n: "ModelDownloaded" for n in caches},
              "modelDetails": {n: {"storageKey": storage_key(f"s3://b/{n}")} for n in caches}}
    labels = {node_group_label("ga"): "true"}
    ours = {"metadata": {"name": "n1", "resourceVersion": "548", "labels": labels},
            "spec": {"localModels": [desired_entry(c, "ga") for c in caches.values()]}, "status": status}
    server = copy.deepcopy(ours)  # the first reconcile's update: "c" is gone; the agent has not reported yet
    server["metadata"]["resourceVersion"] = "552"
    server["spec"]["localModels"] = [desired_entry(caches["anchor"], "ga")]
    add(view.lmns, ours)
    shown = node("n1", "a")  # the first reconcile's label drop is in our copy already
    shown["metadata"]["labels"][model_label("s3://b/anchor")] = "true"
    add(view.nodes, shown)

    def replace(res: Any, obj: dict[str, Any], ns: Any = None) -> dict[str, Any]:
        raise ApiException(status=409, reason="Conflict")

    patches: list[dict[str, Any]] = []
    view.kube.replace = replace  # type: ignore[method-assign]
    view.kube.get_or_none = lambda res, name, ns=None: copy.deepcopy(server)  # type: ignore[method-assign]
    view.kube.patch = lambda res, name, body, *a, **kw: patches.append(body) or body  # type: ignore[method-assign]
    NodeReconciler(view)("n1")
    added = [k for p in patches for k, v in p["metadata"]["labels"].items() if v is not None]
    assert model_label("s3://b/c") not in added, patches
    # The withdrawal ran (its drop is idempotent); nothing was added.
    assert patches == [{"metadata": {"labels": {model_label("s3://b/c"): None}}}]
