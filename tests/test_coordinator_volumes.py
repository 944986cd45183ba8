"""Serving volumes on the real control plane, with the PV controller and admission plugins that a
test API server lacked: PVs pre-bound to their claim (a rival claim cannot take one; a group PVC
spec without a class still binds where a default StorageClass exists), refusals by a namespace's
ResourceQuota reported on the cache and as Events, and names too long for label values."""

from __future__ import annotations

from typing import Any

import pytest

import coordinator.caches
from modelcache.kube.client import (
    EVENTS,
    LOCAL_MODEL_CACHES,
    LOCAL_MODEL_NODE_GROUPS,
    PERSISTENT_VOLUME_CLAIMS,
    PERSISTENT_VOLUMES,
    Kube,
    Resource,
)
from tests.coordinator_util import GROUP_LABEL, make_cache, make_isvc, make_namespace, make_node, register_webhooks
from tests.fixtures.cluster import Cluster
from tests.helpers import wait_until
from tests.test_coordinator_webhooks import cache_obj, review

pytestmark = pytest.mark.timeout(180)

STORAGE_CLASSES = Resource("storage.k8s.io", "v1", "storageclasses", "StorageClass", False)
RESOURCE_QUOTAS = Resource("", "v1", "resourcequotas", "ResourceQuota", True, "core", "resource_quota",
                           "V1ResourceQuota")


def group(kube: Kube, name: str, claim_class: str | None = "local-storage", size: str = "10Gi") -> None:
    claim: dict[str, Any] = {"accessModes": ["ReadWriteOnce"], "resources": {"requests": {"storage": size}}}
    if claim_class is not None:
        claim["storageClassName"] = claim_class
    kube.create(LOCAL_MODEL_NODE_GROUPS, {"metadata": {"name": name}, "spec": {
        "storageLimit": size,
        "persistentVolumeSpec": {
            "accessModes": ["ReadWriteOnce"], "capacity": {"storage": size}, "local": {"path": "/models"},
            "persistentVolumeReclaimPolicy": "Delete", "storageClassName": "local-storage",
            "nodeAffinity": {"required": {"nodeSelectorTerms": [
                {"matchExpressions": [{"key": GROUP_LABEL, "operator": "In", "values": ["worker"]}]}]}}},
        "persistentVolumeClaimSpec": claim}})


@pytest.fixture
def kube(cluster: Cluster) -> Kube:
    k = cluster.kube()
    make_node(k, "n1", **{GROUP_LABEL: "worker"})
    return k


def phase(kube: Kube, res: Resource, name: str, ns: str | None = None) -> str | None:
    obj = kube.get_or_none(res, name, ns)
    return None if obj is None else (obj.get("status") or {}).get("phase")


def test_serving_pvs_are_pre_bound_and_bind_under_a_default_storage_class(cluster: Cluster, kube: Kube,
                                                                           coordinator_factory: Any) -> None:
    # A default class: the DefaultStorageClass admission plugin gives it to any claim naming none.
    kube.create(STORAGE_CLASSES, {"metadata": {"name": "standard", "annotations": {
        "storageclass.kubernetes.io/is-default-class": "true"}}, "provisioner": "example.com/none"})
    group(kube, "workers", claim_class=None)
    make_namespace(kube, "team")
    make_namespace(kube, "rival")
    # A Pending claim of the PV's class and size, there first: the PV must not be its to take.
    kube.create(PERSISTENT_VOLUME_CLAIMS, {"metadata": {"name": "grabby"}, "spec": {
        "accessModes": ["ReadWriteOnce"], "storageClassName": "local-storage",
        "resources": {"requests": {"storage": "10Gi"}}}}, "rival")
    make_cache(kube, "llm", "s3://models/llm", ["workers"])
    register_webhooks(cluster, coordinator_factory(cluster))  # services are labelled at admission
    make_isvc(kube, "svc", "team", "s3://models/llm")
    wait_until(lambda: phase(kube, PERSISTENT_VOLUME_CLAIMS, "llm-workers", "team") == "Bound", timeout=60,
               what="the serving PVC bound by the PV controller")
    pv = kube.get(PERSISTENT_VOLUMES, "llm-workers-team")
    assert pv["spec"]["claimRef"]["namespace"] == "team" and pv["spec"]["claimRef"]["name"] == "llm-workers"
    assert kube.get(PERSISTENT_VOLUME_CLAIMS, "llm-workers", "team")["spec"]["storageClassName"] == "local-storage"
    assert phase(kube, PERSISTENT_VOLUME_CLAIMS, "grabby", "rival") == "Pending"


def test_a_quota_refusal_shows_on_the_cache_and_as_an_event_until_the_quota_allows(
    cluster: Cluster, kube: Kube, coordinator_factory: Any, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setattr(coordinator.caches, "REFUSED_RETRY", 0.5)
    group(kube, "workers")
    make_namespace(kube, "tight")
    kube.create(RESOURCE_QUOTAS, {"metadata": {"name": "storage"}, "spec": {"hard": {"requests.storage": "1Gi"}}},
                "tight")
    make_cache(kube, "llm", "s3://models/llm", ["workers"])
    register_webhooks(cluster, coordinator_factory(cluster))  # services are labelled at admission
    make_isvc(kube, "svc", "tight", "s3://models/llm")

    def condition() -> dict[str, Any]:
        conds = (kube.get(LOCAL_MODEL_CACHES, "llm").get("status") or {}).get("conditions") or []
        return next((c for c in conds if c["type"] == "ServingVolumesCreated"), {})

    wait_until(lambda: condition().get("status") == "False", timeout=30, what="the refusal on the cache status")
    assert condition()["reason"] == "VolumeRefused" and "exceeded quota" in condition()["message"]
    events = [e for e in kube.list(EVENTS, "default").get("items") or []
              if e["reason"] == "VolumeRefused" and e["involvedObject"]["name"] == "llm"]
    assert events and events[0]["type"] == "Warning" and "namespace tight" in events[0]["message"]
    # The quota is raised: the volume is made and the condition says so.
    quota = {"spec": {"hard": {"requests.storage": "100Gi"}}}
    kube.patch(RESOURCE_QUOTAS, "storage", quota, "tight")
    wait_until(lambda: condition().get("status") == "True", timeout=30, what="volumes created after the raise")
    assert kube.get_or_none(PERSISTENT_VOLUME_CLAIMS, "llm-workers", "tight") is not None


def test_names_longer_than_a_label_value(cluster: Cluster, kube: Kube, coordinator_factory: Any) -> None:
    long_group = "workers-" + "g" * 92  # 100 characters: a valid group name, too long for a label value
    group(kube, long_group)
    make_namespace(kube, "team")
    c = coordinator_factory(cluster)
    register_webhooks(cluster, c)  # services are labelled at admission
    # A cache name too long to label services with is refused, saying why.
    name = "c" * 64
    denied = review(c, "/validate-localmodelcaches", {"operation": "CREATE",
                                                       "object": cache_obj(name, "s3://m/x", [long_group])})
    assert not denied["allowed"]
    assert denied["status"]["message"].startswith(f"LocalModelCache name {name} has 64 characters; at most 63")
    assert review(c, "/validate-localmodelcaches", {"operation": "CREATE",
                                                    "object": cache_obj("c" * 63, "s3://m/x", [long_group])})["allowed"]
    # A long group name only reaches our own labels: hashed there, and the volumes are still found.
    make_cache(kube, "llm", "s3://models/llm", [long_group])
    make_isvc(kube, "svc", "team", "s3://models/llm")
    pvc = f"llm-{long_group}"
    wait_until(lambda: kube.get_or_none(PERSISTENT_VOLUME_CLAIMS, pvc, "team") is not None, timeout=30,
               what="the serving PVC")
    labels = kube.get(PERSISTENT_VOLUME_CLAIMS, pvc, "team")["metadata"]["labels"]
    assert len(labels["modelcache.io/node-group"]) <= 63 and labels["modelcache.io/node-group"].startswith("workers-")
    # The cache owns them by name again: its status lists the service, and deleting the service removes them.
    wait_until(lambda: (kube.get(LOCAL_MODEL_CACHES, "llm").get("status") or {}).get("inferenceServices"),
               timeout=30, what="the service listed")
    from modelcache.kube.client import INFERENCE_SERVICES

    kube.delete(INFERENCE_SERVICES, "svc", "team")
    wait_until(lambda: kube.get_or_none(PERSISTENT_VOLUME_CLAIMS, pvc, "team") is None, timeout=30,
               what="the serving PVC deleted with its last user")
