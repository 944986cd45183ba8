"""KServe's model-cache e2e (its test/e2e local-model test, v0.20) on our pieces: the coordinator (leader-elected,
webhooks on), three agent processes as three nodes with three roots, the kube test server and
nginx serving a real file."""

from __future__ import annotations

import base64
import json
import uuid
from typing import Any

import requests

from coordinator.nodelabels import model_label
from modelcache.kube.client import (
    INFERENCE_SERVICES,
    LEASES,
    LOCAL_MODEL_CACHES,
    LOCAL_MODEL_NODES,
    NODES,
    PERSISTENT_VOLUME_CLAIMS,
    PERSISTENT_VOLUMES,
    Kube,
    load_api_client,
)
from modelcache.sources.uri import storage_key
from tests.agent_util import model_files, start_agent
from tests.coordinator_util import make_cache, make_group, make_isvc, make_namespace, make_node, register_webhooks
from tests.fixtures.cluster import Cluster
from tests.helpers import wait_until

WORKERS = ("node-1", "node-2", "node-3")
SIZE = 3 << 20


def test_model_cache_e2e(cluster: Cluster, nginx: Any, coordinator_factory: Any, tmp_path: Any) -> None:
    kube = Kube(load_api_client(str(cluster.kubeconfig)))
    nginx.write("qwen/model.bin", SIZE)
    uri = nginx.url("qwen/model.bin")
    key = storage_key(uri)
    for ns in ("modelcache-system", "kserve", "serving"):
        make_namespace(kube, ns)
    for n in WORKERS:
        make_node(kube, n, **{"kserve/localmodel": "worker"})
    make_node(kube, "control-plane", **{"node-role.kubernetes.io/control-plane": ""})
    make_group(kube, "workers", path="/models")
    roots = {n: tmp_path / f"root-{n}" for n in WORKERS}
    agents = {n: start_agent(cluster.agent_kubeconfig, n, roots[n], tmp_path / "agents", name=n) for n in WORKERS}
    coord = coordinator_factory(cluster, wait=False, leader_election=True, pod_rewrite=True,
                                lease_duration=4.0, renew_deadline=3.0, retry_period=0.5)
    try:
        wait_until(coord.controllers_running.is_set, timeout=30, what="leader's controllers")
        register_webhooks(cluster, coord)  # services labelled at admission, pods placed
        lease = kube.get(LEASES, "modelcache-coordinator", "modelcache-system")
        assert lease["spec"]["holderIdentity"] == coord.cfg.identity

        # A cache -> every member NodeDownloaded, copies {3,3,0}, files on every root.
        make_cache(kube, "qwen", uri, ["workers"])

        def cache_status() -> dict[str, Any]:
            return kube.get(LOCAL_MODEL_CACHES, "qwen").get("status") or {}

        def all_downloaded() -> bool:
            return cache_status().get("nodeStatus") == {n: "NodeDownloaded" for n in WORKERS}

        try:
            wait_until(all_downloaded, timeout=90, what="every member NodeDownloaded")
        except TimeoutError:
            logs = "\n".join(f"--- {n}\n{a.log()[-2000:]}" for n, a in agents.items())
            raise AssertionError(f"status {cache_status()}\n{logs}") from None
        assert cache_status()["copies"] == {"available": 3, "total": 3, "failed": 0}
        for n in WORKERS:
            lmn = kube.get(LOCAL_MODEL_NODES, n)
            assert lmn["status"]["modelStatus"]["qwen"] == "ModelDownloaded"
            assert lmn["spec"]["localModels"] == [{"modelName": "qwen", "sourceModelUri": uri, "nodeGroup": "workers"}]
            assert model_files(roots[n], key) == {"model.bin": SIZE}
        assert kube.get_or_none(LOCAL_MODEL_NODES, "control-plane") is None
        label = model_label(uri)
        wait_until(lambda: all(kube.get(NODES, n)["metadata"]["labels"].get(label) == "true" for n in WORKERS),
                   timeout=30, what="downloaded labels")
        assert label not in kube.get(NODES, "control-plane")["metadata"]["labels"]

        # A service -> labelled, listed, serving PV/PVC made.
        make_isvc(kube, "qwen-svc", "serving", uri)
        wait_until(lambda: cache_status().get("inferenceServices") == [{"namespace": "serving", "name": "qwen-svc"}],
                   timeout=30, what="service listed")
        wait_until(lambda: kube.get_or_none(PERSISTENT_VOLUME_CLAIMS, "qwen-workers", "serving") is not None,
                   timeout=30, what="serving PVC")
        assert kube.get(PERSISTENT_VOLUMES, "qwen-workers-serving")["spec"]["local"] == {"path": "/models"}
        isvc_meta = kube.get(INFERENCE_SERVICES, "qwen-svc", "serving")["metadata"]

        # Its predictor pod is admitted: affinity to nodes that have the model, and the mount.
        pod = {"apiVersion": "v1", "kind": "Pod",
               "metadata": {"generateName": "qwen-svc-predictor-", "namespace": "serving",
                            "labels": {"serving.kserve.io/inferenceservice": "qwen-svc", **isvc_meta["labels"]},
                            "annotations": {"internal.serving.kserve.io/storage-initializer-sourceuri": uri,
                                            **isvc_meta["annotations"]}},
               "spec": {"containers": [{"name": "kserve-container", "image": "runtime"}]}}
        body = {"apiVersion": "admission.k8s.io/v1", "kind": "AdmissionReview",
                "request": {"uid": str(uuid.uuid4()), "operation": "CREATE", "namespace": "serving", "object": pod}}
        resp = requests.post(f"https://127.0.0.1:{coord.cfg.webhook_port}/mutate-pods", json=body,
                             verify=str(coord.cfg.webhook_cert_dir / "tls.crt"), timeout=10).json()["response"]
        assert resp["allowed"] and resp["patchType"] == "JSONPatch"
        ops = {op["path"]: op for op in json.loads(base64.b64decode(resp["patch"]))}
        terms = ops["/spec/affinity"]["value"]["nodeAffinity"]["requiredDuringSchedulingIgnoredDuringExecution"][
            "nodeSelectorTerms"]
        assert terms == [{"matchExpressions": [{"key": label, "operator": "Exists"}]}]
        ready_nodes = [n["metadata"]["name"] for n in kube.list(NODES)["items"]
                       if label in (n["metadata"].get("labels") or {})]
        assert sorted(ready_nodes) == list(WORKERS)
        assert ops["/spec/volumes"]["value"] == [
            {"name": "kserve-pvc-source", "persistentVolumeClaim": {"claimName": "qwen-workers", "readOnly": True}}]
        assert ops["/spec/containers"]["value"][0]["volumeMounts"][0]["subPath"] == f"models/{key}"

        # One node deleted (with its agent): total 2, its LocalModelNode gone.
        agents["node-3"].stop()
        kube.delete(NODES, "node-3")
        wait_until(lambda: kube.get_or_none(LOCAL_MODEL_NODES, "node-3") is None, timeout=30,
                   what="node-3's LocalModelNode deleted")
        wait_until(lambda: cache_status().get("copies") == {"available": 2, "total": 2, "failed": 0}, timeout=30,
                   what="copies {2,2,0}")
        assert set(cache_status()["nodeStatus"]) == {"node-1", "node-2"}

        # Service gone, cache deleted: entries removed, files deleted by the agents, PV/PVC gone.
        kube.delete(INFERENCE_SERVICES, "qwen-svc", "serving")
        kube.delete(LOCAL_MODEL_CACHES, "qwen")
        wait_until(lambda: kube.get_or_none(LOCAL_MODEL_CACHES, "qwen") is None, timeout=20, what="cache deleted")
        for n in ("node-1", "node-2"):
            assert kube.get(LOCAL_MODEL_NODES, n)["spec"].get("localModels", []) == []
        wait_until(lambda: not any((roots[n] / "models" / key).exists() for n in ("node-1", "node-2")),
                   timeout=30, what="files deleted by the agents")
        wait_until(lambda: kube.get_or_none(PERSISTENT_VOLUME_CLAIMS, "qwen-workers", "serving") is None
                   and kube.get_or_none(PERSISTENT_VOLUMES, "qwen-workers-serving") is None, timeout=30,
                   what="serving PV/PVC removed")
        wait_until(lambda: all(label not in kube.get(NODES, n)["metadata"]["labels"] for n in ("node-1", "node-2")),
                   timeout=30, what="labels removed")
    finally:
        for a in agents.values():
            a.stop()
