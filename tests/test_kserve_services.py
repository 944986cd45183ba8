"""Service labels with KServe's own controller (built from its module, tests/kserve) beside ours:
set at admission only, so a running service is never rolled out by a cache appearing; with
KServe's ``localModel.enabled: false`` (its shipped default, whose defaulter strips the cache label
from every service it admits) our defaulter, called after KServe's, still labels it; and a custom
container predictor (its URI in the ``STORAGE_URI`` env of ``kserve-container``) keeps the labels
KServe's defaulter set, across create and update, and its pods mount the cache."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest

from modelcache.kube.client import INFERENCE_SERVICES, LOCAL_MODEL_CACHES, PODS
from modelcache.kube.migrate import DEPLOYMENTS
from modelcache.sources.uri import storage_key
from tests.coordinator_util import make_cache, make_group, make_namespace, register_webhooks
from tests.fixtures.cluster import Cluster
from tests.helpers import wait_until
from tests.kserve import controller as kserve

pytestmark = pytest.mark.timeout(300)
NS = "team"
LABEL = "internal.serving.kserve.io/localmodel"


def _isvc(cluster: Cluster, name: str, uri: str) -> None:
    cluster.kubectl("apply", "-f", "-", input=(
        f"apiVersion: serving.kserve.io/v1beta1\nkind: InferenceService\nmetadata: {{name: {name}, namespace: {NS}}}\n"
        f"spec: {{predictor: {{model: {{modelFormat: {{name: sklearn}}, storageUri: '{uri}'}}}}}}\n"))


def test_labels_at_admission_with_local_model_disabled_and_no_rollout_later(
    cluster: Cluster, coordinator_factory: Any, tmp_path: Path
) -> None:
    kserve.require_binary()
    kserve.install(cluster, local_model=False)
    mgr = kserve.start(cluster, tmp_path / "kserve")
    try:
        kube = cluster.kube()
        cluster.register_node("n1", {"kserve/localmodel": "worker"})
        make_group(kube, "workers")
        make_namespace(kube, NS)
        coord = coordinator_factory(cluster)
        register_webhooks(cluster, coord)
        make_cache(kube, "iris", "s3://models/iris", ["workers"])

        _isvc(cluster, "iris", "s3://models/iris")  # KServe's defaulter strips, ours (after it) labels
        assert kube.get(INFERENCE_SERVICES, "iris", NS)["metadata"]["labels"][LABEL] == "iris"

        _isvc(cluster, "early", "s3://models/early")  # no cache yet: not labelled
        wait_until(lambda: kube.get_or_none(DEPLOYMENTS, "early-predictor", NS) is not None, timeout=120,
                   what="KServe's predictor Deployment of the running service")
        deployment = kube.get(DEPLOYMENTS, "early-predictor", NS)
        make_cache(kube, "early", "s3://models/early", ["workers"])
        wait_until(lambda: (kube.get(LOCAL_MODEL_CACHES, "early").get("status") or {}).get("copies") is not None,
                   timeout=30, what="the new cache reconciled")
        # The running service and its Deployment are untouched: no new pod template, no rollout.
        assert LABEL not in (kube.get(INFERENCE_SERVICES, "early", NS)["metadata"].get("labels") or {})
        now = kube.get(DEPLOYMENTS, "early-predictor", NS)
        assert now["metadata"]["generation"] == deployment["metadata"]["generation"]
        assert now["spec"]["template"] == deployment["spec"]["template"]
    finally:
        mgr.stop()


CUSTOM = """apiVersion: serving.kserve.io/v1beta1
kind: InferenceService
metadata: {{name: vllm, namespace: {ns}}}
spec:
  predictor:
    containers:
    - name: kserve-container
      image: vllm/vllm-openai:v0.9.2
      args: [--model, /mnt/models, --max-model-len, "{max_len}"]
      env: [{{name: STORAGE_URI, value: '{uri}'}}]
"""


def test_a_custom_container_service_keeps_kserves_labels_and_its_pods_mount_the_cache(
    cluster: Cluster, coordinator_factory: Any, tmp_path: Path
) -> None:
    """H1 of the v0.20 audit: KServe's defaulter reads a custom predictor's URI from the STORAGE_URI
    env of kserve-container and labels the service; ours (called after it) used to read no URI,
    compute "no match" and remove the four keys, so every pod downloaded from the origin."""
    kserve.require_binary()
    kserve.install(cluster)
    mgr = kserve.start(cluster, tmp_path / "kserve")
    try:
        kube = cluster.kube()
        cluster.register_node("n1", {"kserve/localmodel": "worker"})
        make_group(kube, "workers")
        make_namespace(kube, NS)
        coord = coordinator_factory(cluster)
        register_webhooks(cluster, coord)
        uri = "hf://org/llm"
        make_cache(kube, "llm", uri, ["workers"])
        want_labels = {LABEL: "llm"}
        want_annotations = {"internal.serving.kserve.io/localmodel-sourceuri": uri,
                            "internal.serving.kserve.io/localmodel-pvc-name": "llm-workers"}

        def cache_metadata() -> tuple[dict[str, str], dict[str, str]]:
            meta = kube.get(INFERENCE_SERVICES, "vllm", NS)["metadata"]
            labels = {k: v for k, v in (meta.get("labels") or {}).items() if k.startswith("internal.serving")}
            annotations = {k: v for k, v in (meta.get("annotations") or {}).items() if "localmodel" in k}
            return labels, annotations

        def pods() -> list[dict[str, Any]]:
            return [p for p in kube.list(PODS, NS, label_selector="serving.kserve.io/inferenceservice=vllm")["items"]
                    if not p["metadata"].get("deletionTimestamp")]

        def mounts_the_cache(pod: dict[str, Any]) -> bool:
            volumes = {v["name"]: v for v in pod["spec"].get("volumes") or []}
            claim = (volumes.get("kserve-pvc-source") or {}).get("persistentVolumeClaim") or {}
            (container,) = [c for c in pod["spec"]["containers"] if c["name"] == "kserve-container"]
            mounts = [m for m in container.get("volumeMounts") or [] if m["name"] == "kserve-pvc-source"]
            no_download = not [c for c in pod["spec"].get("initContainers") or [] if c["name"] == "storage-initializer"]
            return (claim.get("claimName") == "llm-workers" and no_download and len(mounts) == 1
                    and mounts[0]["subPath"] == f"models/{storage_key(uri)}/")

        cluster.kubectl("apply", "-f", "-", input=CUSTOM.format(ns=NS, uri=uri, max_len=4096))
        assert cache_metadata() == (want_labels, want_annotations)
        try:
            wait_until(lambda: len(pods()) == 1, timeout=120, what="the custom predictor's pod")
        except TimeoutError as exc:
            raise AssertionError(f"{exc}\nKServe's manager log:\n{mgr.log()[-4000:]}") from None
        first = pods()[0]
        assert mounts_the_cache(first), first["spec"]

        # An update of the service (a new argument: a new pod template, a rollout) keeps the labels,
        # and the new pod mounts the cache too.
        cluster.kubectl("apply", "-f", "-", input=CUSTOM.format(ns=NS, uri=uri, max_len=8192))
        assert cache_metadata() == (want_labels, want_annotations)
        wait_until(lambda: any(p["metadata"]["name"] != first["metadata"]["name"] for p in pods()), timeout=120,
                   what="the updated predictor's new pod")
        new = [p for p in pods() if p["metadata"]["name"] != first["metadata"]["name"]]
        assert new and all(mounts_the_cache(p) for p in new), new[0]["spec"]
        assert "--max-model-len" in new[0]["spec"]["containers"][0]["args"]
        assert "8192" in new[0]["spec"]["containers"][0]["args"]
    finally:
        mgr.stop()
