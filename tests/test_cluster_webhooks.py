"""deploy/'s webhooks called by the real API server, and placement honoured by the real scheduler.

The coordinator runs as its ServiceAccount with its webhook server on 127.0.0.1; deploy/'s
webhook configurations are registered as shipped except for `clientConfig`, which points at that
port by `url` with the coordinator's certificate as `caBundle` (there is no kube-proxy to route the
Service). Pods are created with kubectl, as a user or KServe's controller would.
"""

from __future__ import annotations

import json
from typing import Any

import pytest

from coordinator.nodelabels import model_label
from modelcache.kube.client import EVENTS, NODES, PERSISTENT_VOLUME_CLAIMS, PERSISTENT_VOLUMES, PODS, Kube
from tests.coordinator_util import (
    make_cache,
    make_group,
    make_isvc,
    make_namespace,
    make_node,
    register_webhooks,
    report,
)
from tests.fixtures.cluster import Cluster
from tests.helpers import wait_until

pytestmark = pytest.mark.timeout(240)

URI = "s3://models/llm"
GROUP_LABEL = {"kserve/localmodel": "worker"}


def predictor_pod(name: str) -> dict[str, Any]:
    """A predictor pod as KServe's controller creates it for an InferenceService of a cached model."""
    return {"apiVersion": "v1", "kind": "Pod",
            "metadata": {"name": name, "namespace": "team", "labels": {
                "serving.kserve.io/inferenceservice": "svc", "internal.serving.kserve.io/localmodel": "llm"},
                "annotations": {"internal.serving.kserve.io/storage-initializer-sourceuri": URI + "/v1"}},
            "spec": {"containers": [{"name": "kserve-container", "image": "kserve/sklearnserver:latest",
                                     "env": [{"name": "STORAGE_URI", "value": URI + "/v1"}]}]}}


def create_pod(cluster: Cluster, body: dict[str, Any]) -> None:
    cluster.kubectl("create", "-f", "-", input=json.dumps(body))


def get_pod(kube: Kube, name: str) -> dict[str, Any]:
    return kube.get(PODS, name, "team")


def unschedulable_reason(kube: Kube, name: str) -> str:
    """The scheduler's FailedScheduling event for the pod (what `kubectl describe pod` shows)."""
    events = [e for e in kube.list(EVENTS, "team")["items"]
              if e["involvedObject"].get("name") == name and e.get("reason") == "FailedScheduling"]
    return events[-1]["message"] if events else ""


def test_api_server_calls_the_webhooks_and_the_scheduler_places_on_a_downloaded_copy(
    cluster: Cluster, coordinator_factory: Any
) -> None:
    kube = cluster.kube()
    for name in ("n1", "n2"):
        make_node(kube, name, **GROUP_LABEL)
    make_node(kube, "outside")
    make_group(kube, "workers")
    make_namespace(kube, "team")
    coord = coordinator_factory(cluster, pod_rewrite=True)
    register_webhooks(cluster, coord)

    # The cache validator is called by the API server: a cache is accepted, a second one with the
    # same URI refused with KServe's message.
    make_cache(kube, "llm", URI, ["workers"])
    dup = cluster.kubectl("apply", "-f", "-", check=False, input=json.dumps({
        "apiVersion": "serving.kserve.io/v1alpha1", "kind": "LocalModelCache", "metadata": {"name": "llm2"},
        "spec": {"sourceModelUri": URI, "modelSize": "1Mi", "nodeGroups": ["workers"]}}))
    assert dup.returncode != 0
    assert "admission webhook" in dup.stderr and f"LocalModelCache llm has the same StorageURI {URI}" in dup.stderr

    # The service that uses the cache: the coordinator creates its serving PV and PVC, and the real
    # PV controller binds them.
    make_isvc(kube, "svc", "team", URI + "/v1")
    wait_until(lambda: (kube.get_or_none(PERSISTENT_VOLUME_CLAIMS, "llm-workers", "team") or {}).get(
        "status", {}).get("phase") == "Bound", timeout=60, what="serving PVC bound by the PV controller")
    pvc = kube.get(PERSISTENT_VOLUME_CLAIMS, "llm-workers", "team")
    pv = kube.get(PERSISTENT_VOLUMES, pvc["spec"]["volumeName"])
    assert pv["status"]["phase"] == "Bound" and pv["spec"]["claimRef"]["name"] == "llm-workers"

    # No node has the model yet: the pod mutator (called by the API server) pins the pod to nodes
    # with a downloaded copy, so the real scheduler leaves it Pending and says why.
    create_pod(cluster, predictor_pod("svc-predictor-1"))
    pod = get_pod(kube, "svc-predictor-1")
    terms = pod["spec"]["affinity"]["nodeAffinity"]["requiredDuringSchedulingIgnoredDuringExecution"][
        "nodeSelectorTerms"]
    label = model_label(URI)
    assert {"key": label, "operator": "Exists"} in terms[0]["matchExpressions"]
    assert any(v.get("persistentVolumeClaim", {}).get("claimName") == "llm-workers" for v in pod["spec"]["volumes"])
    wait_until(lambda: "node affinity" in unschedulable_reason(kube, "svc-predictor-1"), timeout=60,
               what="FailedScheduling event naming the node affinity")

    def unschedulable() -> bool:  # the condition is written apart from the event
        cond = [c for c in get_pod(kube, "svc-predictor-1")["status"].get("conditions", [])
                if c["type"] == "PodScheduled"]
        return bool(cond) and cond[0]["status"] == "False" and cond[0]["reason"] == "Unschedulable"

    wait_until(unschedulable, timeout=30, what="PodScheduled=False Unschedulable")
    assert not get_pod(kube, "svc-predictor-1")["spec"].get("nodeName")

    # n2's agent reports the model: the coordinator labels n2, and the scheduler binds the waiting
    # pod there, never to n1 (still downloading) or outside the group.
    report(kube, "n1", {"llm": "ModelDownloading"})
    report(kube, "n2", {"llm": "ModelDownloaded"})
    wait_until(lambda: kube.get(NODES, "n2")["metadata"]["labels"].get(label) == "true", timeout=60,
               what="n2 labelled downloaded")
    try:
        wait_until(lambda: get_pod(kube, "svc-predictor-1")["spec"].get("nodeName") == "n2", timeout=120,
                   what="pending pod bound to n2 once its copy is downloaded")
    except TimeoutError as exc:
        raise AssertionError(f"{exc}; scheduler says: {unschedulable_reason(kube, 'svc-predictor-1')}; "
                             f"n2 labels: {kube.get(NODES, 'n2')['metadata']['labels']}") from None
    for i in range(2, 5):
        create_pod(cluster, predictor_pod(f"svc-predictor-{i}"))
    for i in range(2, 5):
        wait_until(lambda i=i: get_pod(kube, f"svc-predictor-{i}")["spec"].get("nodeName") is not None, timeout=60,
                   what=f"pod {i} bound")
        assert get_pod(kube, f"svc-predictor-{i}")["spec"]["nodeName"] == "n2"
    assert label not in kube.get(NODES, "n1")["metadata"]["labels"]


def test_pods_of_other_workloads_are_not_sent_to_the_webhook(cluster: Cluster, coordinator_factory: Any) -> None:
    """The objectSelector keeps ordinary pods away from the coordinator (and it being down)."""
    kube = cluster.kube()
    make_node(kube, "n1", **GROUP_LABEL)
    make_namespace(kube, "team")
    coord = coordinator_factory(cluster)
    register_webhooks(cluster, coord)
    coord.stop()  # even with the coordinator down, a plain pod is created and scheduled
    create_pod(cluster, {"apiVersion": "v1", "kind": "Pod", "metadata": {"name": "plain", "namespace": "team"},
                         "spec": {"containers": [{"name": "c", "image": "busybox"}]}})
    wait_until(lambda: get_pod(kube, "plain")["spec"].get("nodeName") == "n1", timeout=60, what="plain pod bound")
    assert not get_pod(kube, "plain")["spec"].get("affinity")


def llm_workload_pod(name: str, service: str) -> dict[str, Any]:
    """A pod of an LLMInferenceService's workload Deployment, labelled as KServe's controller does
    (llmisvc/workload_single_node.go): no cache label, no source annotation of its own."""
    return {"apiVersion": "v1", "kind": "Pod",
            "metadata": {"name": name, "namespace": "team", "labels": {
                "app.kubernetes.io/part-of": "llminferenceservice", "app.kubernetes.io/name": service,
                "app.kubernetes.io/component": "llminferenceservice-workload", "kserve.io/component": "workload"}},
            "spec": {"containers": [{"name": "main", "image": "vllm/vllm-openai:latest"}]}}


def test_llm_inference_service_pods_are_placed_on_a_downloaded_copy(
    cluster: Cluster, coordinator_factory: Any, tmp_path: Any
) -> None:
    """The pod webhook's objectSelector matched only InferenceService pods: an LLMInferenceService's
    pods of a cached model could land on a node whose copy is missing."""
    import yaml

    from coordinator.view import llm_resource
    from tests.test_coordinator_llmisvc import llm_crd

    crd = tmp_path / "llmisvc.yaml"
    crd.write_text(yaml.safe_dump(llm_crd("v1alpha1")))
    cluster.kubectl("apply", "-f", str(crd))
    cluster.kubectl("wait", "--for", "condition=Established", "crd/llminferenceservices.serving.kserve.io")
    kube = cluster.kube()
    for name in ("n1", "n2"):
        make_node(kube, name, **GROUP_LABEL)
    make_group(kube, "workers")
    make_namespace(kube, "team")
    coord = coordinator_factory(cluster)
    register_webhooks(cluster, coord)
    make_cache(kube, "llm", URI, ["workers"])
    res = llm_resource("v1alpha1")
    kube.create(res, {"metadata": {"name": "chat", "namespace": "team"},
                      "spec": {"model": {"uri": URI + "/v1", "name": "llm"}}}, "team")
    kube.create(res, {"metadata": {"name": "other", "namespace": "team"},
                      "spec": {"model": {"uri": "s3://elsewhere/m", "name": "m"}}}, "team")
    wait_until(lambda: (kube.get(res, "chat", "team")["metadata"].get("labels") or {})
               .get("internal.serving.kserve.io/localmodel") == "llm", timeout=30, what="LLMISVC labelled")
    report(kube, "n2", {"llm": "ModelDownloaded"})
    wait_until(lambda: model_label(URI) in kube.get(NODES, "n2")["metadata"]["labels"], timeout=30,
               what="n2 labelled downloaded")

    create_pod(cluster, llm_workload_pod("chat-kserve-1", "chat"))
    terms = get_pod(kube, "chat-kserve-1")["spec"]["affinity"]["nodeAffinity"][
        "requiredDuringSchedulingIgnoredDuringExecution"]["nodeSelectorTerms"]
    assert {"key": model_label(URI), "operator": "Exists"} in terms[0]["matchExpressions"]
    wait_until(lambda: get_pod(kube, "chat-kserve-1")["spec"].get("nodeName") == "n2", timeout=60,
               what="the LLM pod bound to the node with the copy")
    # A service of no cache: admitted unchanged.
    create_pod(cluster, llm_workload_pod("other-kserve-1", "other"))
    assert not get_pod(kube, "other-kserve-1")["spec"].get("affinity")


def test_services_get_the_cache_label_at_admission_and_never_while_running(
    cluster: Cluster, coordinator_factory: Any
) -> None:
    """KServe labels a service for a cache only when the service is admitted; the labels reach the
    pod template, so a cache created later must not change a running service (that would roll it
    out). Continuous re-labelling is opt-in (--mutate-isvc)."""
    from coordinator import metrics
    from modelcache.kube.client import INFERENCE_SERVICES, LOCAL_MODEL_CACHES

    def service_writes() -> float:  # the counter is the test process's: other tests' writes are in it
        return sum(s.value for m in metrics.WRITES.collect() for s in m.samples
                   if s.labels.get("kind") == "InferenceService" and s.name.endswith("_total"))

    written_before = service_writes()
    kube = cluster.kube()
    make_node(kube, "n1", **GROUP_LABEL)
    make_group(kube, "workers")
    make_namespace(kube, "team")
    coord = coordinator_factory(cluster)
    register_webhooks(cluster, coord)
    make_cache(kube, "llm", URI, ["workers"])
    make_isvc(kube, "svc", "team", URI + "/v1")  # admitted with its cache there: labelled by the API call itself
    meta = kube.get(INFERENCE_SERVICES, "svc", "team")["metadata"]
    assert meta["labels"]["internal.serving.kserve.io/localmodel"] == "llm"
    assert meta["annotations"]["internal.serving.kserve.io/localmodel-pvc-name"] == "llm-workers"
    assert meta["annotations"]["internal.serving.kserve.io/localmodel-sourceuri"] == URI

    make_isvc(kube, "early", "team", "s3://models/later")  # running before its cache exists
    before = kube.get(INFERENCE_SERVICES, "early", "team")["metadata"]
    make_cache(kube, "later", "s3://models/later", ["workers"])
    wait_until(lambda: (kube.get(LOCAL_MODEL_CACHES, "later").get("status") or {}).get("copies") is not None,
               timeout=30, what="the new cache reconciled")
    # Nothing writes services after admission: no service writer runs, none was written.
    assert not [ctl.name for ctl in coord.manager.controllers if ctl.name in ("InferenceService",
                                                                             "LLMInferenceService")]
    assert service_writes() == written_before
    after = kube.get(INFERENCE_SERVICES, "early", "team")["metadata"]
    assert after["resourceVersion"] == before["resourceVersion"], "a running service was changed"
    # Its next update is an admission: KServe's rule applies then (as KServe's defaulter does).
    kube.patch(INFERENCE_SERVICES, "early", {"metadata": {"annotations": {"team": "x"}}}, "team")
    assert kube.get(INFERENCE_SERVICES, "early", "team")["metadata"]["labels"][
        "internal.serving.kserve.io/localmodel"] == "later"


def test_a_pod_kserve_does_not_point_at_the_cache_is_not_pinned(cluster: Cluster, coordinator_factory: Any) -> None:
    """KServe mounts the cache only into pods whose service carries the cache label; with
    localModel.enabled false its defaulter strips that label, and its pod mutator then leaves the
    storage initializer in place: the pod downloads the model itself and may run anywhere. Our pod
    webhook (KServe's pod mutator present: no rewrite) pins only the pods that read the cache."""
    kube = cluster.kube()
    make_node(kube, "n1", **GROUP_LABEL)
    make_group(kube, "workers")
    make_namespace(kube, "team")
    coord = coordinator_factory(cluster)  # --pod-rewrite off: KServe's pod mutator does the rewrite
    register_webhooks(cluster, coord)
    make_cache(kube, "llm", URI, ["workers"])

    # As KServe leaves a predictor pod of an unlabelled service: source annotation, no cache label.
    unlabelled = predictor_pod("svc-predictor-plain")
    del unlabelled["metadata"]["labels"]["internal.serving.kserve.io/localmodel"]
    unlabelled["spec"]["initContainers"] = [{"name": "storage-initializer", "image": "kserve/storage-initializer",
                                             "args": [URI + "/v1", "/mnt/models"]}]
    create_pod(cluster, unlabelled)
    assert "affinity" not in get_pod(kube, "svc-predictor-plain")["spec"]
    wait_until(lambda: get_pod(kube, "svc-predictor-plain")["spec"].get("nodeName") == "n1", timeout=60,
               what="the unlabelled pod bound by the scheduler although no node has the model")

    # A labelled one (KServe rewrites it to the cache PVC) is still pinned to a downloaded copy.
    create_pod(cluster, predictor_pod("svc-predictor-cached"))
    terms = get_pod(kube, "svc-predictor-cached")["spec"]["affinity"]["nodeAffinity"][
        "requiredDuringSchedulingIgnoredDuringExecution"]["nodeSelectorTerms"]
    assert {"key": model_label(URI), "operator": "Exists"} in terms[0]["matchExpressions"]
    wait_until(lambda: "node affinity" in unschedulable_reason(kube, "svc-predictor-cached"), timeout=60,
               what="the labelled pod Pending until a node has the model")
