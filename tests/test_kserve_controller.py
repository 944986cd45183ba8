"""KServe's own controller manager (built from its published module, tests/kserve) beside our
coordinator and agents on the real control plane.

KServe runs as its ServiceAccount with its own RBAC, CRDs, config map (Standard, i.e. raw
deployment, mode; `localModel.enabled: true`) and webhooks; our coordinator and one agent per node
replace KServe's local-model controller and node agent. What a user of both sees: KServe's ISVC
defaulter labels the InferenceService with the LocalModelCache it matches, KServe's controller
makes the predictor Deployment, the real controller-manager its ReplicaSet and Pod, KServe's pod
mutator rewrites the pod to the cache PVC, ours pins it to nodes whose copy is downloaded, and the
real scheduler binds it only once an agent reports the model there.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import pytest

from coordinator.nodelabels import model_label
from modelcache.kube.client import (
    EVENTS,
    INFERENCE_SERVICES,
    LOCAL_MODEL_CACHES,
    NODES,
    PERSISTENT_VOLUME_CLAIMS,
    PERSISTENT_VOLUMES,
    PODS,
    Kube,
)
from modelcache.sources.uri import storage_key
from tests.agent_util import model_files, start_agent, wait_states
from tests.coordinator_util import make_cache, make_group, make_namespace, register_webhooks
from tests.fixtures.cluster import Cluster
from tests.helpers import wait_until
from tests.kserve import controller as kserve

pytestmark = pytest.mark.timeout(300)

GROUP_LABEL = {"kserve/localmodel": "worker"}
NS = "team"


@pytest.fixture
def kserve_manager(cluster: Cluster, tmp_path: Path) -> Any:
    kserve.require_binary()
    kserve.install(cluster)
    mgr = kserve.start(cluster, tmp_path / "kserve")
    yield mgr
    mgr.stop()


def predictor_pods(kube: Kube, isvc: str) -> list[dict[str, Any]]:
    pods = kube.list(PODS, NS, label_selector=f"serving.kserve.io/inferenceservice={isvc}")["items"]
    return [p for p in pods if not p["metadata"].get("deletionTimestamp")]


def owner(cluster: Cluster, kind: str, name: str) -> tuple[str, str]:
    """The controller owner of an object (as `kubectl get -o json` shows it)."""
    meta = json.loads(cluster.kubectl("get", kind, name, "-n", NS, "-o", "json").stdout)["metadata"]
    (ref,) = [r for r in meta.get("ownerReferences") or () if r.get("controller")]
    return ref["kind"], ref["name"]


def scheduler_says(kube: Kube, pod: str) -> str:
    events = [e for e in kube.list(EVENTS, NS)["items"]
              if e["involvedObject"].get("name") == pod and e.get("reason") == "FailedScheduling"]
    return events[-1]["message"] if events else ""


def test_kserve_rewrites_the_predictor_to_the_cache_and_the_scheduler_binds_it_where_our_agent_has_the_model(
    cluster: Cluster, coordinator_factory: Any, kserve_manager: Any, nginx: Any, tmp_path: Path
) -> None:
    kube = cluster.kube()
    for node in ("n1", "n2"):
        cluster.register_node(node, GROUP_LABEL)
    make_group(kube, "workers")
    make_namespace(kube, NS)
    nginx.write("models/iris/model.joblib", 2 << 20)
    uri = nginx.url("models/iris/model.joblib")
    key = storage_key(uri)

    coord = coordinator_factory(cluster)  # pod_rewrite off: the rewrite is KServe's
    register_webhooks(cluster, coord)
    make_cache(kube, "iris", uri, ["workers"])

    # A user creates the InferenceService: KServe's defaulter (called by the API server) finds the
    # cache and labels the service with it.
    cluster.kubectl("apply", "-f", "-", input=(
        f"apiVersion: serving.kserve.io/v1beta1\nkind: InferenceService\nmetadata: {{name: iris, namespace: {NS}}}\n"
        f"spec: {{predictor: {{model: {{modelFormat: {{name: sklearn}}, storageUri: '{uri}'}}}}}}\n"))
    isvc = kube.get(INFERENCE_SERVICES, "iris", NS)
    assert isvc["metadata"]["labels"]["internal.serving.kserve.io/localmodel"] == "iris"
    assert isvc["metadata"]["annotations"]["internal.serving.kserve.io/localmodel-pvc-name"] == "iris-workers"
    assert isvc["metadata"]["annotations"]["internal.serving.kserve.io/localmodel-sourceuri"] == uri

    # Our coordinator makes the serving PV and PVC that KServe's rewrite names; the PV controller binds them.
    wait_until(lambda: (kube.get_or_none(PERSISTENT_VOLUME_CLAIMS, "iris-workers", NS) or {}).get(
        "status", {}).get("phase") == "Bound", timeout=60, what="serving PVC iris-workers bound")
    # Labelled with the cache's storage key: deploy/policies/serving-volumes.yaml (in this cluster's
    # baseline) then admits a pod mounting the claim only read-only under models/<key>, and KServe's
    # rewrite below is such a pod.
    pv = kube.get(PERSISTENT_VOLUMES, f"iris-workers-{NS}")
    assert pv["metadata"]["labels"]["modelcache.io/storage-key"] == key

    # KServe's controller makes the predictor Deployment; the controller-manager its ReplicaSet and
    # Pod. Both mutators ran on the pod: KServe's mounts the cache PVC instead of downloading, ours
    # requires a node with a downloaded copy. No agent runs yet, so the scheduler keeps it Pending.
    def one_pod() -> bool:
        return len(predictor_pods(kube, "iris")) == 1

    try:
        wait_until(one_pod, timeout=120, what="predictor pod created by the Deployment's ReplicaSet")
    except TimeoutError as exc:
        raise AssertionError(f"{exc}\nKServe's manager log:\n{kserve_manager.log()[-6000:]}") from None
    pod = predictor_pods(kube, "iris")[0]
    name = pod["metadata"]["name"]
    rs_kind, rs = owner(cluster, "pod", name)
    assert rs_kind == "ReplicaSet"
    assert owner(cluster, "replicaset", rs) == ("Deployment", "iris-predictor")
    assert owner(cluster, "deployment", "iris-predictor") == ("InferenceService", "iris")
    spec = pod["spec"]
    assert not [c for c in spec.get("initContainers") or [] if c["name"] == "storage-initializer"]
    volumes = {v["name"]: v for v in spec["volumes"]}
    assert volumes["kserve-pvc-source"]["persistentVolumeClaim"]["claimName"] == "iris-workers"
    (container,) = [c for c in spec["containers"] if c["name"] == "kserve-container"]
    (mount,) = [m for m in container["volumeMounts"] if m["name"] == "kserve-pvc-source"]
    assert mount["mountPath"] == "/mnt/models" and mount["subPath"] == f"models/{key}/"  # KServe's trailing /
    terms = spec["affinity"]["nodeAffinity"]["requiredDuringSchedulingIgnoredDuringExecution"]["nodeSelectorTerms"]
    assert all({"key": model_label(uri), "operator": "Exists"} in t["matchExpressions"] for t in terms)
    wait_until(lambda: "node affinity" in scheduler_says(kube, name), timeout=60,
               what="FailedScheduling naming the node affinity")
    assert not kube.get(PODS, name, NS)["spec"].get("nodeName")

    # n2's agent downloads the model and reports it; the coordinator labels n2; the scheduler binds
    # the waiting pod there.
    agent2 = start_agent(cluster.agent_kubeconfig, "n2", tmp_path / "root-n2", tmp_path)
    try:
        wait_states(kube, "n2", {"iris": "ModelDownloaded"}, agent=agent2)
        assert model_files(tmp_path / "root-n2", key) == {"model.joblib": 2 << 20}
        try:
            wait_until(lambda: kube.get(PODS, name, NS)["spec"].get("nodeName") == "n2", timeout=120,
                       what="predictor pod bound to n2")
        except TimeoutError as exc:
            raise AssertionError(f"{exc}; scheduler says: {scheduler_says(kube, name)}; n2 labels: "
                                 f"{kube.get(NODES, 'n2')['metadata']['labels']}") from None
        assert model_label(uri) not in kube.get(NODES, "n1")["metadata"]["labels"]

        # The second node's agent: both copies counted on the cache, as KServe's status reports them.
        agent1 = start_agent(cluster.agent_kubeconfig, "n1", tmp_path / "root-n1", tmp_path)
        try:
            wait_states(kube, "n1", {"iris": "ModelDownloaded"}, agent=agent1)
            wait_until(lambda: (kube.get(LOCAL_MODEL_CACHES, "iris").get("status") or {}).get("nodeStatus") == {
                "n1": "NodeDownloaded", "n2": "NodeDownloaded"}, timeout=60, what="cache status: both copies")
            status = kube.get(LOCAL_MODEL_CACHES, "iris")["status"]
            assert status["copies"]["available"] == 2
            assert status["inferenceServices"] == [{"namespace": NS, "name": "iris"}]
        finally:
            agent1.stop()
    finally:
        agent2.stop()
    assert kserve_manager.alive(), kserve_manager.log()[-3000:]


def test_a_storage_container_without_the_multi_download_flag_gets_kserves_error_not_a_panic(
    cluster: Cluster, kserve_manager: Any
) -> None:
    """KServe's controller dereferences `supportsMultiModelDownload` for services with storageUris;
    our ClusterStorageContainer CRD defaults it to false as KServe's does, so a container that does
    not set it is refused with KServe's message (without the default: a nil-pointer panic in every
    reconcile, and the service never gets a status)."""
    cluster.register_node("n1")
    make_namespace(cluster.kube(), NS)
    cluster.kubectl("apply", "-f", "-", input=(
        "apiVersion: serving.kserve.io/v1alpha1\nkind: ClusterStorageContainer\nmetadata: {name: custom}\n"
        "spec: {container: {name: storage-initializer, image: example/init:1}, supportedUriFormats: [{prefix: 's3://'}]}\n"))
    csc = json.loads(cluster.kubectl("get", "clusterstoragecontainer", "custom", "-o", "json").stdout)
    assert csc["spec"]["supportsMultiModelDownload"] is False
    cluster.kubectl("apply", "-f", "-", input=(
        f"apiVersion: serving.kserve.io/v1beta1\nkind: InferenceService\nmetadata: {{name: multi, namespace: {NS}}}\n"
        "spec: {predictor: {model: {modelFormat: {name: sklearn}}, storageUris: ["
        "{uri: 's3://bucket/a', mountPath: /mnt/models/a}, {uri: 's3://bucket/b', mountPath: /mnt/models/b}]}}\n"))
    kube = cluster.kube()

    def ready_message() -> str:
        conditions = (kube.get(INFERENCE_SERVICES, "multi", NS).get("status") or {}).get("conditions") or []
        return next((c.get("message", "") for c in conditions if c["type"] == "PredictorReady"), "")

    try:
        wait_until(lambda: "does not support multi-model download" in ready_message(), timeout=60,
                   what="KServe's refusal in the service's PredictorReady condition")
    except TimeoutError as exc:
        raise AssertionError(f"{exc}\nKServe's manager log:\n{kserve_manager.log()[-4000:]}") from None
    assert "Observed a panic" not in kserve_manager.log()
