"""Coordinator reconcilers against the kube test server; agents are simulated by status patches."""

from __future__ import annotations

import time
from typing import Any

import pytest

from coordinator.nodelabels import model_label
from modelcache.kube.client import (
    EVENTS,
    INFERENCE_SERVICES,
    LOCAL_MODEL_CACHES,
    LOCAL_MODEL_NAMESPACE_CACHES,
    LOCAL_MODEL_NODE_GROUPS,
    LOCAL_MODEL_NODES,
    NODES,
    PERSISTENT_VOLUME_CLAIMS,
    PERSISTENT_VOLUMES,
    Kube,
    load_api_client,
)
from tests.coordinator_util import (
    entries_of,
    make_cache,
    make_group,
    make_isvc,
    make_namespace,
    make_node,
    report,
    set_ready,
    without_service_crds,
)
from tests.fixtures.cluster import Cluster
from tests.helpers import wait_until

URI = "http://models.example/m/model.bin"


@pytest.fixture
def kube(cluster: Cluster) -> Kube:
    return Kube(load_api_client(str(cluster.kubeconfig)))


def status(kube: Kube, name: str, ns: str | None = None) -> dict[str, Any]:
    res = LOCAL_MODEL_NAMESPACE_CACHES if ns else LOCAL_MODEL_CACHES
    return kube.get(res, name, ns).get("status") or {}


def eventually(check: Any, what: str, timeout: float = 30) -> None:
    wait_until(check, timeout=timeout, what=what)


def test_cache_to_nodes_status_and_node_lifecycle(cluster: Cluster, kube: Kube, coordinator_factory: Any) -> None:
    for n in ("n1", "n2"):
        make_node(kube, n, **{"kserve/localmodel": "worker"})
    make_node(kube, "outside")
    make_node(kube, "sick", ready=False, **{"kserve/localmodel": "worker"})
    make_group(kube, "workers")
    coordinator_factory(cluster)
    make_cache(kube, "llm", URI, ["workers"])

    entry = {"modelName": "llm", "sourceModelUri": URI, "nodeGroup": "workers"}
    eventually(lambda: entries_of(kube, "n1") == [entry] and entries_of(kube, "n2") == [entry], "entries on members")
    assert entries_of(kube, "outside") is None and entries_of(kube, "sick") is None
    # Labelled by its entries' group, in the same write: agents watch their group's objects by it.
    assert kube.get(LOCAL_MODEL_NODES, "n1")["metadata"]["labels"] == {"nodegroup.modelcache.io/workers": "true"}
    eventually(lambda: status(kube, "llm").get("nodeStatus") == {
        "n1": "NodeDownloadPending", "n2": "NodeDownloadPending", "sick": "NodeNotReady"}, "pending status")
    assert status(kube, "llm")["copies"] == {"available": 0, "total": 3, "failed": 0}
    assert "localmodel.kserve.io/finalizer" in kube.get(LOCAL_MODEL_CACHES, "llm")["metadata"]["finalizers"]

    # Agents report: n1 done, n2 failed.
    report(kube, "n1", {"llm": "ModelDownloaded"})
    report(kube, "n2", {"llm": "ModelDownloadError"})
    eventually(lambda: status(kube, "llm").get("copies") == {"available": 1, "total": 3, "failed": 1}, "copies")
    assert status(kube, "llm")["nodeStatus"]["n1"] == "NodeDownloaded"
    label = model_label(URI)
    eventually(lambda: kube.get(NODES, "n1")["metadata"]["labels"].get(label) == "true", "n1 labelled")
    assert label not in kube.get(NODES, "n2")["metadata"]["labels"]
    eventually(lambda: any(e["reason"] == "CopyAvailable" and "n1" in e["message"]
                           for e in kube.list(EVENTS, "default")["items"]), "CopyAvailable event")

    # A failing node recovers; a node goes NotReady.
    report(kube, "n2", {"llm": "ModelDownloaded"})
    eventually(lambda: status(kube, "llm").get("copies") == {"available": 2, "total": 3, "failed": 0}, "n2 done")
    set_ready(kube, "n2", False)
    eventually(lambda: status(kube, "llm").get("nodeStatus", {}).get("n2") == "NodeNotReady", "n2 NotReady")
    assert status(kube, "llm")["copies"] == {"available": 1, "total": 3, "failed": 0}
    assert entries_of(kube, "n2") == [entry]  # a NotReady member keeps its entry (and files)
    eventually(lambda: any(e["reason"] == "CopyLost" and "n2" in e["message"]
                           for e in kube.list(EVENTS, "default")["items"]), "CopyLost event")
    set_ready(kube, "n2", True)

    # A deleted node: its LocalModelNode goes, and it leaves the status (kserve#6159).
    kube.delete(NODES, "n1")
    eventually(lambda: kube.get_or_none(LOCAL_MODEL_NODES, "n1") is None, "n1's LocalModelNode deleted")
    eventually(lambda: status(kube, "llm").get("copies") == {"available": 1, "total": 2, "failed": 0}, "total 2")
    assert "n1" not in status(kube, "llm")["nodeStatus"]

    # A node that leaves the group loses the entry and its label.
    kube.patch(NODES, "n2", {"metadata": {"labels": {"kserve/localmodel": None}}})
    eventually(lambda: entries_of(kube, "n2") == [], "entry removed from n2")
    assert not kube.get(LOCAL_MODEL_NODES, "n2")["metadata"].get("labels")  # nor in the group's watch
    report(kube, "n2", {})
    eventually(lambda: label not in kube.get(NODES, "n2")["metadata"]["labels"], "n2 label removed")
    eventually(lambda: status(kube, "llm").get("nodeStatus") == {"sick": "NodeNotReady"}, "only sick left")

    # Deletion: entries leave every node, the finalizer goes.
    kube.patch(NODES, "n2", {"metadata": {"labels": {"kserve/localmodel": "worker"}}})
    eventually(lambda: entries_of(kube, "n2") == [entry], "n2 back")
    kube.delete(LOCAL_MODEL_CACHES, "llm")
    eventually(lambda: kube.get_or_none(LOCAL_MODEL_CACHES, "llm") is None, "cache deleted")
    assert entries_of(kube, "n2") == []


def test_delete_cache_whose_group_is_gone(cluster: Cluster, kube: Kube, coordinator_factory: Any) -> None:
    """kserve#6154: KServe's cache stays Terminating when its node group was deleted first."""
    make_node(kube, "n1", **{"kserve/localmodel": "worker"})
    make_group(kube, "workers")
    coordinator_factory(cluster)
    make_cache(kube, "c", URI, ["workers"])
    eventually(lambda: entries_of(kube, "n1") == [{"modelName": "c", "sourceModelUri": URI, "nodeGroup": "workers"}],
               "entry")
    kube.delete(LOCAL_MODEL_NODE_GROUPS, "workers")

    def groups_condition() -> dict[str, Any]:
        conds = status(kube, "c").get("conditions") or []
        return next((c for c in conds if c["type"] == "NodeGroupsFound"), {})

    eventually(lambda: groups_condition().get("status") == "False", "NodeGroupsFound=False")
    assert groups_condition()["message"] == "node group(s) not found: workers"
    kube.delete(LOCAL_MODEL_CACHES, "c")
    eventually(lambda: kube.get_or_none(LOCAL_MODEL_CACHES, "c") is None, "cache deleted without its group")
    assert entries_of(kube, "n1") == []


def test_namespace_cache_entries_and_status_key(cluster: Cluster, kube: Kube, coordinator_factory: Any) -> None:
    make_namespace(kube, "team")
    make_node(kube, "n1", **{"kserve/localmodel": "worker"})
    make_group(kube, "workers")
    coordinator_factory(cluster)
    make_cache(kube, "same", URI, ["workers"])
    make_cache(kube, "same", URI, ["workers"], namespace="team")
    eventually(lambda: len(entries_of(kube, "n1") or []) == 2, "two entries, one per cache")
    assert {"modelName": "same", "sourceModelUri": URI, "namespace": "team", "nodeGroup": "workers"} in \
        entries_of(kube, "n1")
    report(kube, "n1", {"team/same": "ModelDownloaded", "same": "ModelDownloading"})
    eventually(lambda: status(kube, "same", "team").get("nodeStatus") == {"n1": "NodeDownloaded"}, "ns status")
    eventually(lambda: status(kube, "same").get("nodeStatus") == {"n1": "NodeDownloading"}, "cluster status")
    kube.delete(LOCAL_MODEL_NAMESPACE_CACHES, "same", "team")
    eventually(lambda: kube.get_or_none(LOCAL_MODEL_NAMESPACE_CACHES, "same", "team") is None, "ns cache gone")
    assert entries_of(kube, "n1") == [{"modelName": "same", "sourceModelUri": URI, "nodeGroup": "workers"}]


def test_services_labels_status_and_volumes_with_mutate_isvc(cluster: Cluster, kube: Kube,
                                                             coordinator_factory: Any) -> None:
    """--mutate-isvc: KServe's defaulter applied continuously, also after admission (a service
    created before its cache picks it up; this rolls out running services, hence off by default)."""
    for ns in ("a", "b"):
        make_namespace(kube, ns)
    make_node(kube, "n1", **{"kserve/localmodel": "worker"})
    make_group(kube, "workers")
    coordinator_factory(cluster, mutate_isvc=True)
    make_cache(kube, "llm", "s3://models/llm/", ["workers"])
    make_isvc(kube, "svc", "a", "s3://models/llm/sub")
    make_isvc(kube, "other", "a", "s3://models/other")
    make_isvc(kube, "optout", "b", "s3://models/llm", annotations={"serving.kserve.io/disable-localmodel": "true"})

    def labelled(name: str, ns: str) -> dict[str, Any]:
        return kube.get(INFERENCE_SERVICES, name, ns)["metadata"]

    eventually(lambda: (labelled("svc", "a").get("labels") or {}).get("internal.serving.kserve.io/localmodel")
               == "llm", "ISVC labelled")
    ann = labelled("svc", "a")["annotations"]
    assert ann["internal.serving.kserve.io/localmodel-sourceuri"] == "s3://models/llm/"
    assert ann["internal.serving.kserve.io/localmodel-pvc-name"] == "llm-workers"
    eventually(lambda: status(kube, "llm").get("inferenceServices") == [{"namespace": "a", "name": "svc"}],
               "service listed")
    eventually(lambda: kube.get_or_none(PERSISTENT_VOLUMES, "llm-workers-a") is not None, "serving PV")
    pv = kube.get(PERSISTENT_VOLUMES, "llm-workers-a")
    assert pv["spec"]["local"] == {"path": "/models"}
    assert pv["spec"]["nodeAffinity"]["required"]["nodeSelectorTerms"][0]["matchExpressions"][0]["key"] == \
        "kserve/localmodel"
    eventually(lambda: kube.get_or_none(PERSISTENT_VOLUME_CLAIMS, "llm-workers", "a") is not None, "serving PVC")
    assert kube.get(PERSISTENT_VOLUME_CLAIMS, "llm-workers", "a")["spec"]["volumeName"] == "llm-workers-a"
    assert "labels" not in labelled("other", "a") or \
        "internal.serving.kserve.io/localmodel" not in labelled("other", "a")["labels"]
    assert "internal.serving.kserve.io/localmodel" not in (labelled("optout", "b").get("labels") or {})
    assert kube.get_or_none(PERSISTENT_VOLUME_CLAIMS, "llm-workers", "b") is None

    # The service goes: volumes and status entry go.
    kube.delete(INFERENCE_SERVICES, "svc", "a")
    eventually(lambda: kube.get_or_none(PERSISTENT_VOLUME_CLAIMS, "llm-workers", "a") is None, "PVC removed")
    eventually(lambda: kube.get_or_none(PERSISTENT_VOLUMES, "llm-workers-a") is None, "PV removed")
    eventually(lambda: "inferenceServices" not in status(kube, "llm"), "status emptied")

    # A service created before its cache picks the cache up; deleting the cache takes the volumes.
    make_isvc(kube, "early", "b", "s3://models/late")
    make_cache(kube, "late", "s3://models/late", ["workers"])
    eventually(lambda: kube.get_or_none(PERSISTENT_VOLUME_CLAIMS, "late-workers", "b") is not None, "late PVC")
    kube.delete(INFERENCE_SERVICES, "early", "b")
    kube.delete(LOCAL_MODEL_CACHES, "late")
    eventually(lambda: kube.get_or_none(LOCAL_MODEL_CACHES, "late") is None, "late cache deleted")
    eventually(lambda: kube.get_or_none(PERSISTENT_VOLUMES, "late-workers-b") is None, "late PV removed")


def test_no_writes_once_converged(cluster: Cluster, kube: Kube, coordinator_factory: Any) -> None:
    from coordinator import metrics

    make_node(kube, "n1", **{"kserve/localmodel": "worker"})
    make_group(kube, "workers")
    make_cache(kube, "c", URI, ["workers"])
    c = coordinator_factory(cluster)
    eventually(lambda: status(kube, "c").get("copies", {}).get("total") == 1, "converged")

    def writes() -> float:
        return sum(s.value for m in metrics.WRITES.collect() for s in m.samples if s.name.endswith("_total"))

    quiet = {"n": writes(), "since": time.monotonic()}

    def settled() -> bool:  # no write for a second: every event of the start-up has been handled
        now = writes()
        if now != quiet["n"]:
            quiet.update(n=now, since=time.monotonic())
        return time.monotonic() - quiet["since"] > 1.0

    eventually(settled, "writes settle")
    def reconciles() -> float:
        return sum(s.value for m in metrics.RECONCILES.collect() for s in m.samples if s.name.endswith("_total"))

    before, ran = writes(), reconciles()
    rv = kube.get(LOCAL_MODEL_CACHES, "c")["metadata"]["resourceVersion"]
    # Force reconciles of everything: nothing changed, so nothing may be written.
    for ctl in c.manager.controllers:
        for key in {"LocalModelCache": ["c"], "node": ["n1"]}.get(ctl.name, []):
            ctl.queue.add(key)
    eventually(lambda: reconciles() >= ran + 2, "forced reconciles ran")
    time.sleep(0.3)
    assert writes() == before
    assert kube.get(LOCAL_MODEL_CACHES, "c")["metadata"]["resourceVersion"] == rv


def test_runs_without_kserve_service_crds(cluster: Cluster, coordinator_factory: Any) -> None:
    without_service_crds(cluster)
    kube = Kube(load_api_client(str(cluster.kubeconfig)))
    make_node(kube, "n1", **{"kserve/localmodel": "worker"})
    make_group(kube, "workers")
    c = coordinator_factory(cluster)
    assert c.view.isvcs is None and c.view.llmisvcs is None
    make_cache(kube, "c", URI, ["workers"])
    wait_until(lambda: (kube.get(LOCAL_MODEL_CACHES, "c").get("status") or {}).get("copies", {}).get("total") == 1,
               timeout=30, what="status without ISVC CRD")


def test_kserve_labels_services_when_mutation_is_off(cluster: Cluster, kube: Kube, coordinator_factory: Any) -> None:
    """With --no-mutate-isvc (KServe's webhook labels services), services are left alone but still
    listed and given volumes, in the group their nodegroup annotation names."""
    make_namespace(kube, "a")
    make_node(kube, "n1", **{"kserve/localmodel": "worker"})
    make_group(kube, "workers")
    make_group(kube, "spare", label_value="spare")
    coordinator_factory(cluster, mutate_isvc=False)
    make_cache(kube, "llm", "s3://models/llm", ["workers", "spare"])
    make_isvc(kube, "plain", "a", "s3://models/llm")  # not labelled: not ours to touch
    make_isvc(kube, "svc", "a", "s3://models/llm", annotations={"serving.kserve.io/nodegroup": "spare"},
              labels={"internal.serving.kserve.io/localmodel": "llm"})
    eventually(lambda: status(kube, "llm").get("inferenceServices") == [{"namespace": "a", "name": "svc"}],
               "labelled service listed")
    eventually(lambda: kube.get_or_none(PERSISTENT_VOLUME_CLAIMS, "llm-spare", "a") is not None, "PVC in spare")
    assert kube.get_or_none(PERSISTENT_VOLUME_CLAIMS, "llm-workers", "a") is None
    assert kube.get(PERSISTENT_VOLUMES, "llm-spare-a")["spec"]["nodeAffinity"]["required"]["nodeSelectorTerms"][0][
        "matchExpressions"][0]["values"] == ["spare"]
    time.sleep(0.5)
    assert "labels" not in kube.get(INFERENCE_SERVICES, "plain", "a")["metadata"]
