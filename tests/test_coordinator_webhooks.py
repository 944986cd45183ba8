"""Coordinator webhooks over real HTTPS with AdmissionReview v1 bodies, and its health/metrics."""

from __future__ import annotations

import base64
import json
import ssl
import uuid
from typing import Any

import pytest
import requests

from coordinator.certs import generate_self_signed
from coordinator.nodelabels import model_label
from modelcache.kube.client import INFERENCE_SERVICES, LOCAL_MODEL_CACHES, Kube, load_api_client
from modelcache.sources.uri import storage_key
from tests.coordinator_util import make_cache, make_group, make_isvc, make_namespace, make_node
from tests.fixtures.cluster import Cluster
from tests.helpers import wait_until

URI = "s3://models/llm"


@pytest.fixture
def kube(cluster: Cluster) -> Kube:
    return Kube(load_api_client(str(cluster.kubeconfig)))


@pytest.fixture
def hooks(cluster: Cluster, kube: Kube, coordinator_factory: Any) -> Any:
    make_node(kube, "n1", **{"kserve/localmodel": "worker"})
    make_group(kube, "workers")
    make_namespace(kube, "team")
    return coordinator_factory(cluster, pod_rewrite=True)


def review(c: Any, path: str, request: dict[str, Any]) -> dict[str, Any]:
    body = {"apiVersion": "admission.k8s.io/v1", "kind": "AdmissionReview",
            "request": {"uid": str(uuid.uuid4()), **request}}
    url = f"https://127.0.0.1:{c.cfg.webhook_port}{path}"
    resp = requests.post(url, json=body, verify=str(c.cfg.webhook_cert_dir / "tls.crt"), timeout=10)
    assert resp.status_code == 200, resp.text
    out = resp.json()
    assert out["apiVersion"] == "admission.k8s.io/v1" and out["kind"] == "AdmissionReview"
    assert out["response"]["uid"] == body["request"]["uid"]
    return out["response"]


def cache_obj(name: str, uri: str, groups: list[str], ns: str | None = None) -> dict[str, Any]:
    meta: dict[str, Any] = {"name": name}
    if ns:
        meta["namespace"] = ns
    return {"apiVersion": "serving.kserve.io/v1alpha1", "kind": "LocalModelNamespaceCache" if ns else "LocalModelCache",
            "metadata": meta, "spec": {"sourceModelUri": uri, "modelSize": "1Gi", "nodeGroups": groups}}


def test_cache_validation(hooks: Any, kube: Kube) -> None:
    make_cache(kube, "llm", URI, ["workers"])
    cluster, ns_path = "/validate-localmodelcaches", "/validate-localmodelnamespacecaches"
    dup = review(hooks, cluster, {"operation": "CREATE", "object": cache_obj("llm2", URI, ["workers"])})
    assert dup["allowed"] is False
    assert dup["status"]["message"] == f"LocalModelCache llm has the same StorageURI {URI}"
    assert review(hooks, cluster, {"operation": "CREATE", "object": cache_obj("llm2", URI + "/", ["workers"])})[
        "allowed"]  # string equality, as KServe
    # Re-validating the existing object itself (an update) is not a duplicate of itself.
    same = cache_obj("llm", URI, ["workers"])
    assert review(hooks, cluster, {"operation": "UPDATE", "object": same, "oldObject": same})["allowed"]
    moved = review(hooks, cluster, {"operation": "UPDATE", "object": cache_obj("llm", "s3://x", ["workers"]),
                                    "oldObject": same})
    assert not moved["allowed"] and moved["status"]["message"] == "StorageUri is immutable"
    nogroup = review(hooks, ns_path, {"operation": "CREATE", "namespace": "team",
                                      "object": cache_obj("c", URI, ["nope"], "team")})
    assert not nogroup["allowed"] and nogroup["status"]["message"].startswith("NodeGroup nope not found")
    # Namespace caches have no unique-URI rule.
    assert review(hooks, ns_path, {"operation": "CREATE", "namespace": "team",
                                   "object": cache_obj("c", URI, ["workers"], "team")})["allowed"]

    # Delete is refused while a service uses the cache, allowed once it is gone.
    make_isvc(kube, "svc", "team", URI + "/v1", labels={"internal.serving.kserve.io/localmodel": "llm"})  # as admitted
    old = kube.get(LOCAL_MODEL_CACHES, "llm")
    denied = review(hooks, cluster, {"operation": "DELETE", "name": "llm", "oldObject": old})
    assert not denied["allowed"]
    assert denied["status"]["message"] == "LocalModelCache llm is being used by InferenceService team/svc"
    kube.delete(INFERENCE_SERVICES, "svc", "team")
    assert review(hooks, cluster, {"operation": "DELETE", "name": "llm", "oldObject": old})["allowed"]


def apply(pod: dict[str, Any], resp: dict[str, Any]) -> dict[str, Any]:
    """Apply the webhook's JSONPatch (spec-level add/remove ops) as the API server would."""
    assert resp["allowed"] is True
    if "patch" not in resp:
        return pod
    assert resp["patchType"] == "JSONPatch"
    out = json.loads(json.dumps(pod))
    for op in json.loads(base64.b64decode(resp["patch"])):
        _, spec, key = op["path"].split("/")
        assert spec == "spec"
        if op["op"] == "remove":
            del out["spec"][key]
        else:
            assert op["op"] == "add"
            out["spec"][key] = op["value"]
    return out


def serving_pod(labels: dict[str, str], annotations: dict[str, str]) -> dict[str, Any]:
    return {"apiVersion": "v1", "kind": "Pod", "metadata": {"generateName": "svc-predictor-", "namespace": "team",
                                                            "labels": labels, "annotations": annotations},
            "spec": {"initContainers": [{"name": "storage-initializer", "image": "kserve/storage-initializer"}],
                     "containers": [{"name": "kserve-container", "image": "runtime",
                                     "env": [{"name": "STORAGE_URI", "value": URI + "/v1"}]}]}}


def test_pod_placement_and_rewrite(hooks: Any, kube: Kube) -> None:
    make_cache(kube, "llm", URI, ["workers"])
    label = model_label(URI)
    labels = {"serving.kserve.io/inferenceservice": "svc", "internal.serving.kserve.io/localmodel": "llm"}
    by_label = serving_pod(labels,
                           {"internal.serving.kserve.io/storage-initializer-sourceuri": URI + "/v1",
                            "internal.serving.kserve.io/localmodel-pvc-name": "llm-workers"})
    pod = apply(by_label, review(hooks, "/mutate-pods", {"operation": "CREATE", "namespace": "team",
                                                         "object": by_label}))
    terms = pod["spec"]["affinity"]["nodeAffinity"]["requiredDuringSchedulingIgnoredDuringExecution"][
        "nodeSelectorTerms"]
    assert terms == [{"matchExpressions": [{"key": label, "operator": "Exists"}]}]
    assert pod["spec"]["volumes"] == [{"name": "kserve-pvc-source",
                                       "persistentVolumeClaim": {"claimName": "llm-workers", "readOnly": True}}]
    assert pod["spec"]["containers"][0]["volumeMounts"] == [
        {"name": "kserve-pvc-source", "mountPath": "/mnt/models", "subPath": f"models/{storage_key(URI)}/v1",
         "readOnly": True}]
    assert "initContainers" not in pod["spec"]
    # Reinvocation: nothing more to do.
    again = review(hooks, "/mutate-pods", {"operation": "CREATE", "namespace": "team", "object": pod})
    assert again["allowed"] and "patch" not in again

    # No label: matched by URI (KServe's rule), the PVC named after the cache's first group.
    by_uri = serving_pod({"serving.kserve.io/inferenceservice": "svc"},
                         {"internal.serving.kserve.io/storage-initializer-sourceuri": URI + "/"})
    pod = apply(by_uri, review(hooks, "/mutate-pods", {"operation": "CREATE", "namespace": "team", "object": by_uri}))
    assert pod["spec"]["volumes"][0]["persistentVolumeClaim"]["claimName"] == "llm-workers"
    assert pod["spec"]["containers"][0]["volumeMounts"][0]["subPath"] == f"models/{storage_key(URI)}"

    # Not a cached model, or opted out: admitted unchanged.
    other = serving_pod({}, {"internal.serving.kserve.io/storage-initializer-sourceuri": "s3://models/other"})
    assert "patch" not in review(hooks, "/mutate-pods", {"operation": "CREATE", "namespace": "team", "object": other})
    opted = serving_pod({}, {"internal.serving.kserve.io/storage-initializer-sourceuri": URI,
                             "serving.kserve.io/disable-localmodel": "true"})
    assert "patch" not in review(hooks, "/mutate-pods", {"operation": "CREATE", "namespace": "team", "object": opted})


def test_tls_and_health_endpoints(hooks: Any, tmp_path: Any) -> None:
    # A client that does not trust our certificate is refused at the handshake.
    with pytest.raises(requests.exceptions.SSLError):
        requests.post(f"https://127.0.0.1:{hooks.cfg.webhook_port}/mutate-pods", json={}, timeout=5)
    base = f"http://127.0.0.1:{hooks.cfg.port}"
    assert requests.get(f"{base}/healthz", timeout=5).status_code == 200
    wait_until(lambda: requests.get(f"{base}/readyz", timeout=5).status_code == 200, timeout=30, what="readyz")
    requests.post(f"https://127.0.0.1:{hooks.cfg.webhook_port}/validate-localmodelcaches",
                  json={"request": {"uid": "x", "operation": "CONNECT"}},
                  verify=str(hooks.cfg.webhook_cert_dir / "tls.crt"), timeout=5)
    text = requests.get(f"{base}/metrics", timeout=5).text
    assert 'modelcache_coordinator_webhook_requests_total{path="/validate-localmodelcaches",result="allowed"}' in text
    assert "modelcache_coordinator_reconciles_total" in text
    assert requests.get(f"{base}/nope", timeout=5).status_code == 404


def test_self_signed_pair(tmp_path: Any) -> None:
    from cryptography import x509

    cert, key = generate_self_signed(tmp_path / "c", ["svc.ns.svc", "127.0.0.1"])
    parsed = x509.load_pem_x509_certificate(cert.read_bytes())
    sans = parsed.extensions.get_extension_for_class(x509.SubjectAlternativeName).value
    assert sans.get_values_for_type(x509.DNSName) == ["svc.ns.svc"]
    assert [str(ip) for ip in sans.get_values_for_type(x509.IPAddress)] == ["127.0.0.1"]
    assert key.stat().st_mode & 0o777 == 0o600
    ssl.create_default_context().load_cert_chain(cert, key)  # the pair belongs together


def test_rotated_certificate_is_picked_up(tmp_path: Any) -> None:
    import socket
    import time

    from coordinator.certs import ReloadingContext
    from coordinator.httpserve import WebhookServer
    from tests.helpers import free_port

    certs = tmp_path / "certs"
    generate_self_signed(certs, ["127.0.0.1"])
    first = (certs / "tls.crt").read_bytes()
    tls = ReloadingContext(certs, interval=0.1).start()
    server = WebhookServer("127.0.0.1", free_port(), {}, tls.context).start()

    def served_cert() -> bytes:
        ctx = ssl.create_default_context()
        ctx.check_hostname, ctx.verify_mode = False, ssl.CERT_NONE
        with socket.create_connection(("127.0.0.1", server.port), timeout=5) as raw, \
                ctx.wrap_socket(raw, server_hostname="127.0.0.1") as s:
            der = s.getpeercert(binary_form=True)
        return ssl.DER_cert_to_PEM_cert(der).encode()

    try:
        assert served_cert().strip() == first.strip()
        time.sleep(0.05)
        generate_self_signed(certs, ["127.0.0.1"])  # the secret volume is updated in place
        second = (certs / "tls.crt").read_bytes()
        assert second != first
        wait_until(lambda: served_cert().strip() == second.strip(), timeout=10, what="rotated certificate served")
    finally:
        server.stop()
        tls.stop()


def _patched(resp: dict[str, Any]) -> list[dict[str, Any]]:
    return json.loads(base64.b64decode(resp["patch"])) if resp.get("patch") else []


def test_service_defaulter_applies_kserves_rule(hooks: Any, kube: Kube) -> None:
    """/mutate-services: KServe's defaulter at admission, for both service kinds."""
    make_cache(kube, "llm", URI, ["workers"])
    isvc = {"kind": "InferenceService", "metadata": {"name": "s", "namespace": "team"},
            "spec": {"predictor": {"model": {"storageUri": URI + "/v1"}}}}
    resp = review(hooks, "/mutate-services", {"operation": "CREATE", "namespace": "team", "object": isvc,
                                              "kind": {"kind": "InferenceService"}})
    assert resp["allowed"] and _patched(resp) == [
        {"op": "add", "path": "/metadata/labels", "value": {"internal.serving.kserve.io/localmodel": "llm"}},
        {"op": "add", "path": "/metadata/annotations", "value": {
            "internal.serving.kserve.io/localmodel-sourceuri": URI,
            "internal.serving.kserve.io/localmodel-pvc-name": "llm-workers"}}]
    llm = {"kind": "LLMInferenceService", "metadata": {"name": "c", "namespace": "team"},
           "spec": {"model": {"uri": URI}}}
    resp = review(hooks, "/mutate-services", {"operation": "CREATE", "namespace": "team", "object": llm,
                                              "kind": {"kind": "LLMInferenceService"}})
    assert {"op": "add", "path": "/metadata/labels", "value": {"internal.serving.kserve.io/localmodel": "llm"}} in \
        _patched(resp)
    # Opted out (or matching no cache): every key of ours removed, others kept.
    optout = {"kind": "InferenceService", "metadata": {
        "name": "s", "namespace": "team", "labels": {"internal.serving.kserve.io/localmodel": "llm", "app": "x"},
        "annotations": {"serving.kserve.io/disable-localmodel": "true",
                        "internal.serving.kserve.io/localmodel-pvc-name": "llm-workers"}},
        "spec": {"predictor": {"model": {"storageUri": URI}}}}
    resp = review(hooks, "/mutate-services", {"operation": "UPDATE", "namespace": "team", "object": optout,
                                              "kind": {"kind": "InferenceService"}})
    assert _patched(resp) == [
        {"op": "remove", "path": "/metadata/labels/internal.serving.kserve.io~1localmodel"},
        {"op": "remove", "path": "/metadata/annotations/internal.serving.kserve.io~1localmodel-pvc-name"}]


def test_service_defaulter_reads_a_custom_container_and_never_strips_what_it_cannot_read(hooks: Any,
                                                                                          kube: Kube) -> None:
    """H1 of the KServe v0.20 audit: a predictor given as containers: carries its URI in the STORAGE_URI
    env of kserve-container (KServe's defaulter reads it there); a service whose URI we cannot read
    keeps the labels KServe's defaulter (called before ours) set."""
    make_cache(kube, "llm", URI, ["workers"])
    labelled = {"labels": {"internal.serving.kserve.io/localmodel": "llm"}, "annotations": {
        "internal.serving.kserve.io/localmodel-sourceuri": URI,
        "internal.serving.kserve.io/localmodel-pvc-name": "llm-workers"}}
    custom = {"kind": "InferenceService", "metadata": {"name": "vllm", "namespace": "team", **labelled},
              "spec": {"predictor": {"containers": [{"name": "kserve-container", "image": "vllm/vllm-openai",
                                                     "env": [{"name": "STORAGE_URI", "value": URI}]}]}}}
    for op in ("CREATE", "UPDATE"):
        resp = review(hooks, "/mutate-services", {"operation": op, "namespace": "team", "object": custom,
                                                  "kind": {"kind": "InferenceService"}})
        assert resp["allowed"] and _patched(resp) == []  # KServe's labels are ours too: nothing to change
    bare = {**custom, "metadata": {"name": "vllm", "namespace": "team"}}
    resp = review(hooks, "/mutate-services", {"operation": "CREATE", "namespace": "team", "object": bare,
                                              "kind": {"kind": "InferenceService"}})
    assert {"op": "add", "path": "/metadata/labels", "value": {"internal.serving.kserve.io/localmodel": "llm"}} in \
        _patched(resp)
    # A URI from a Secret, a storage: spec: nothing we can read, so nothing removed.
    for predictor in ({"containers": [{"name": "kserve-container", "env": [
            {"name": "STORAGE_URI", "valueFrom": {"secretKeyRef": {"name": "s", "key": "uri"}}}]}]},
            {"model": {"modelFormat": {"name": "sklearn"}, "storage": {"key": "k", "path": "iris"}}}):
        unread = {**custom, "spec": {"predictor": predictor}}
        resp = review(hooks, "/mutate-services", {"operation": "UPDATE", "namespace": "team", "object": unread,
                                                  "kind": {"kind": "InferenceService"}})
        assert resp["allowed"] and _patched(resp) == []
