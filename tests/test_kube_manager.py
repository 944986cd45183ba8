"""Manager with leader election, namespaced and core-kind informers with selectors, Events."""

from __future__ import annotations

import subprocess
import sys
import threading
from typing import Any

import pytest

from modelcache.kube.client import (
    EVENTS,
    LEASES,
    LOCAL_MODEL_NAMESPACE_CACHES,
    LOCAL_MODEL_NODES,
    NAMESPACES,
    NODES,
    PODS,
    Kube,
    load_api_client,
)
from modelcache.kube.controller import Controller, Manager, Result
from modelcache.kube.events import WARNING, EventRecorder
from modelcache.kube.informer import Informer
from modelcache.kube.leader import LeaderElector
from modelcache.kube.types import LocalModelNamespaceCache
from modelcache.runtime.clock import rfc3339
from tests.fixtures.cluster import Cluster
from tests.helpers import REPO, wait_until


@pytest.fixture
def kube(cluster: Cluster) -> Kube:
    return Kube(load_api_client(str(cluster.kubeconfig)))


def ns(kube: Kube, *names: str) -> None:
    for name in names:
        kube.create(NAMESPACES, {"metadata": {"name": name}})


def test_only_the_leaders_controllers_reconcile_and_a_standby_takes_over(kube: Kube) -> None:
    ns(kube, "sys")
    timing = {"lease_duration": 1.5, "renew_deadline": 1.0, "retry_period": 0.2}
    reconciled: dict[str, list[str]] = {"a": [], "b": []}
    managers: dict[str, tuple[Manager, LeaderElector, Informer, threading.Event]] = {}
    results: dict[str, bool] = {}
    threads = []
    for ident in ("a", "b"):
        inf = Informer(kube, LOCAL_MODEL_NODES)
        manager = Manager()
        manager.add(Controller(f"c-{ident}", lambda key, i=ident: reconciled[i].append(key) or Result()).watch(inf))
        elector = LeaderElector(kube, "sys", "mgr", ident, **timing)
        stop = threading.Event()
        managers[ident] = (manager, elector, inf, stop)
        t = threading.Thread(target=lambda i=ident, m=manager, e=elector, s=stop: results.update({i: m.run(s, e)}))
        t.start()
        threads.append(t)
        if ident == "a":
            assert elector.wait_for_leadership(5)
    try:
        kube.create(LOCAL_MODEL_NODES, {"metadata": {"name": "n1"}, "spec": {"localModels": []}})
        wait_until(lambda: "n1" in reconciled["a"], timeout=10, what="leader reconciles")
        b_inf = managers["b"][2]
        wait_until(lambda: b_inf.store.get_raw("n1") is not None, timeout=10, what="standby cache warm")
        assert reconciled["b"] == [] and not managers["b"][0].controllers_running

        managers["a"][1].pause_renewing()  # a hangs
        assert managers["b"][1].wait_for_leadership(6)
        wait_until(lambda: "n1" in reconciled["b"], timeout=10, what="new leader reconciles from its warm cache")
    finally:
        for _m, _e, _i, stop in managers.values():
            stop.set()
        for t in threads:
            t.join(10)
    assert results == {"a": True, "b": True}  # both stopped on request, not by losing the lease


def test_lost_leadership_ends_run_with_false(kube: Kube) -> None:
    ns(kube, "sys2")
    manager = Manager()
    elector = LeaderElector(kube, "sys2", "mgr", "x", lease_duration=1.5, renew_deadline=1.0, retry_period=0.2)
    stop = threading.Event()
    out: list[bool] = []
    t = threading.Thread(target=lambda: out.append(manager.run(stop, elector)))
    t.start()
    assert elector.wait_for_leadership(5)
    # Someone else holds the lease now (e.g. after a partition): x cannot renew and must step down.
    lease = kube.get(LEASES, "mgr", "sys2")
    lease["spec"].update(holderIdentity="y", renewTime=rfc3339(digits=6), leaseDurationSeconds=30)
    kube.replace(LEASES, lease, "sys2")
    t.join(10)
    assert out == [False] and stop.is_set()


def test_namespaced_informer_across_namespaces_with_a_label_selector(kube: Kube) -> None:
    ns(kube, "t1", "t2")

    def cache(name: str, namespace: str, team: str) -> dict[str, Any]:
        obj = LocalModelNamespaceCache(metadata={"name": name, "namespace": namespace, "labels": {"team": team}})
        obj.spec.source_model_uri, obj.spec.model_size, obj.spec.node_groups = "s3://b/m", "1Gi", ["g"]
        return obj.to_dict()

    kube.create(LOCAL_MODEL_NAMESPACE_CACHES, cache("c1", "t1", "red"), "t1")
    kube.create(LOCAL_MODEL_NAMESPACE_CACHES, cache("c2", "t2", "blue"), "t2")
    inf = Informer(kube, LOCAL_MODEL_NAMESPACE_CACHES, label_selector="team=red",
                   indexers={"uri": lambda o: [o["spec"]["sourceModelUri"]]}).start()
    try:
        assert inf.wait_for_sync(10)
        kube.create(LOCAL_MODEL_NAMESPACE_CACHES, cache("c3", "t2", "red"), "t2")
        wait_until(lambda: sorted(inf.store.keys()) == ["t1/c1", "t2/c3"], timeout=10, what="red caches")
        assert [o["metadata"]["name"] for o in inf.store.by_index("uri", "s3://b/m")] == ["c1", "c3"]
        # Relabelled out of the selector: the informer sees it leave.
        kube.patch(LOCAL_MODEL_NAMESPACE_CACHES, "c1", {"metadata": {"labels": {"team": "blue"}}}, "t1")
        wait_until(lambda: inf.store.keys() == ["t2/c3"], timeout=10, what="c1 gone from the cache")
        assert [o["metadata"]["name"] for o in inf.store.by_index("uri", "s3://b/m")] == ["c3"]
    finally:
        inf.stop()


def test_core_kind_informer_with_a_field_selector(kube: Kube) -> None:
    ns(kube, "w")
    for node in ("node-a", "node-b"):
        kube.create(NODES, {"metadata": {"name": node}})

    def pod(name: str, node: str) -> dict[str, Any]:
        return {"metadata": {"name": name, "namespace": "w"},
                "spec": {"nodeName": node, "containers": [{"name": "c", "image": "i"}]}}

    kube.create(PODS, pod("p1", "node-a"), "w")
    kube.create(PODS, pod("p2", "node-b"), "w")
    inf = Informer(kube, PODS, field_selector="spec.nodeName=node-a").start()
    try:
        assert inf.wait_for_sync(10)
        kube.create(PODS, pod("p3", "node-a"), "w")
        wait_until(lambda: sorted(inf.store.keys()) == ["w/p1", "w/p3"], timeout=10, what="pods on node-a")
        kube.delete(PODS, "p1", "w", grace_period=0)  # no kubelet here to confirm a graceful deletion
        wait_until(lambda: inf.store.keys() == ["w/p3"], timeout=10, what="p1 deleted")
        assert inf.store.get("w/p3")["kind"] == "Pod"
    finally:
        inf.stop()


def test_events_are_recorded_and_repeats_counted(kube: Kube) -> None:
    node = kube.create(LOCAL_MODEL_NODES, {"metadata": {"name": "n1"}, "spec": {"localModels": []}})
    rec = EventRecorder(kube, "modelcache-agent", host="n1")
    for _ in range(3):
        rec.record(node, WARNING, "DownloadFailed", "m0: s3://b/m: access denied; check the secret")
    events = kube.list(EVENTS, "default")["items"]
    assert len(events) == 1
    ev = events[0]
    assert (ev["reason"], ev["type"], ev["count"]) == ("DownloadFailed", "Warning", 3)
    assert ev["involvedObject"]["kind"] == "LocalModelNode" and ev["involvedObject"]["uid"] == node["metadata"]["uid"]
    # A restarted process continues the count instead of failing on the existing name.
    EventRecorder(kube, "modelcache-agent", host="n1").record(node, WARNING, "DownloadFailed",
                                                              "m0: s3://b/m: access denied; check the secret")
    assert kube.list(EVENTS, "default")["items"][0]["count"] == 4


def test_a_process_finds_the_api_server_through_kubeconfig(cluster: Cluster, kube: Kube) -> None:
    """No flag: a fresh process outside a cluster uses $KUBECONFIG, as kubectl does."""
    kube.create(NAMESPACES, {"metadata": {"name": "found-me"}})
    code = ("from modelcache.kube.client import NAMESPACES, Kube, load_api_client\n"
            "print(sorted(n['metadata']['name'] for n in Kube(load_api_client()).list(NAMESPACES)['items']))")
    env = {k: v for k, v in cluster.env().items() if not k.startswith("KUBERNETES_SERVICE")}
    out = subprocess.run([sys.executable, "-c", code], env=env, capture_output=True, text=True, timeout=60,
                         cwd=REPO, check=True).stdout
    assert "'found-me'" in out


def test_informer_lists_in_pages(kube: Kube) -> None:
    for i in range(7):
        kube.create(LOCAL_MODEL_NODES, {"metadata": {"name": f"p{i}"}, "spec": {"localModels": []}})
    inf = Informer(kube, LOCAL_MODEL_NODES, page_size=2).start()
    try:
        assert inf.wait_for_sync(10)
        assert sorted(inf.store.keys()) == [f"p{i}" for i in range(7)]
        late = kube.create(LOCAL_MODEL_NODES, {"metadata": {"name": "late"}, "spec": {"localModels": []}})
        wait_until(lambda: inf.store.get_raw("late") is not None, timeout=10, what="watch after a paged list")
        assert inf.store.get("late")["metadata"]["resourceVersion"] == late["metadata"]["resourceVersion"]
    finally:
        inf.stop()
