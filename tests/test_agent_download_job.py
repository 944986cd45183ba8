"""KServe's ``localModelDownloadJob`` ClusterStorageContainers, for a URI none of our sources reads: the
agent runs the container as KServe's agent does (a Job per model on that node, args ``[uri,
/mnt/models]``, the model's folder of the node root mounted there), on the real control plane: the
Job controller makes its pod, the scheduler binds it to the node; the test plays the kubelet (it
writes what the container would and reports the pod's end). The model is then reported like any
other: Downloading, Downloaded with a manifest, or an Error naming the Job."""

from __future__ import annotations

import os
from pathlib import Path
from typing import Any

import pytest

from modelcache.kube.client import CLUSTER_STORAGE_CONTAINERS, PODS, SECRETS
from modelcache.store import NodeStore
from modelcache.uri import storage_key
from tests.agent_util import (
    CRED_NS,
    apply_agent_daemonset,
    create_node,
    create_secret,
    entry,
    kube_for,
    node_status,
    start_agent,
    wait_states,
)
from tests.helpers import wait_until

pytestmark = pytest.mark.timeout(240)
JOBS_NS = "modelcache-jobs"


def _container(kube: Any) -> None:
    kube.create(CLUSTER_STORAGE_CONTAINERS, {
        "apiVersion": "serving.kserve.io/v1alpha1", "kind": "ClusterStorageContainer",
        "metadata": {"name": "private-downloader"},
        "spec": {"workloadType": "localModelDownloadJob",
                 "supportedUriFormats": [{"prefix": "private://"}, {"regex": "^corp\\+[a-z]+://"}],
                 "container": {"name": "downloader", "image": "registry.example.com/downloader:1",
                               "env": [{"name": "MIRROR", "value": "eu"}]}}})
    # An init-container one for the same prefix: not a download Job, never used by the agent.
    kube.create(CLUSTER_STORAGE_CONTAINERS, {
        "apiVersion": "serving.kserve.io/v1alpha1", "kind": "ClusterStorageContainer",
        "metadata": {"name": "a-init"},
        "spec": {"supportedUriFormats": [{"prefix": "private://"}],
                 "container": {"name": "init", "image": "registry.example.com/init:1"}}})


def _job_pod(kube: Any, model: str, agent: Any) -> dict[str, Any]:
    found: list[dict[str, Any]] = []

    def bound() -> bool:
        pods = kube.list(PODS, JOBS_NS, label_selector=f"model={model},node=gpu-1")["items"]
        found[:] = [p for p in pods if p["spec"].get("nodeName") == "gpu-1" and
                    p.get("status", {}).get("phase") not in ("Succeeded", "Failed")]
        return bool(found)

    try:
        wait_until(bound, timeout=60, what=f"the download Job's pod of {model}, bound to gpu-1 by the scheduler")
    except TimeoutError as exc:
        raise AssertionError(f"{exc}\nagent log:\n{agent.log()[-3000:]}") from None
    return found[0]


def _kubelet_ends(kube: Any, pod: dict[str, Any], exit_code: int) -> None:
    """What the kubelet reports when the container ends."""
    name = pod["metadata"]["name"]
    c = pod["spec"]["containers"][0]["name"]
    terminated = {"exitCode": exit_code, "reason": "Completed" if exit_code == 0 else "Error"}
    kube.patch_status(PODS, name, {"status": {
        "phase": "Succeeded" if exit_code == 0 else "Failed",
        "containerStatuses": [{"name": c, "image": "x", "imageID": "", "ready": False, "restartCount": 0,
                               "state": {"terminated": terminated}}]}}, JOBS_NS)


def test_a_custom_download_container_runs_as_a_job_on_the_node(cluster, tmp_path: Path) -> None:
    cluster.register_node("gpu-1", {"kserve/localmodel": "worker"})
    kube = kube_for(cluster)
    _container(kube)
    create_secret(kube, "storage-config", {"corp": '{"type": "s3", "access_key_id": "AK1"}'})
    uri, bad_uri = "private://models/llama-7b", "corp+vault://models/broken"
    root = tmp_path / "root"
    create_node(kube, "gpu-1", [entry("llama", uri, storage={"key": "corp"}), entry("broken", bad_uri)])
    apply_agent_daemonset(cluster, str(root))  # deploy/policies/agent-jobs.yaml reads the host path there
    agent = start_agent(cluster.agent_kubeconfig, "gpu-1", root, tmp_path, "--host-path", str(root),
                        "--job-namespace", JOBS_NS)
    try:
        pod = _job_pod(kube, "llama", agent)
        spec = pod["spec"]
        (c,) = spec["containers"]
        key = storage_key(uri)
        assert c["image"] == "registry.example.com/downloader:1" and c["args"] == [uri, "/mnt/models"]
        assert {"name": "MIRROR", "value": "eu"} in c["env"]
        assert {"name": "kserve-pvc-source", "mountPath": "/mnt/models", "subPath": f"models/{key}"} in \
            c["volumeMounts"]
        volumes = {v["name"]: v for v in spec["volumes"]}
        assert volumes["kserve-pvc-source"]["hostPath"] == {"path": str(root), "type": "Directory"}
        assert spec["nodeSelector"] == {"kubernetes.io/hostname": "gpu-1"} and spec["restartPolicy"] == "Never"
        job = pod["metadata"]["labels"]["job-name"]
        assert job.startswith("llama-gpu-1")
        from agent.downloadjob import JOBS

        (owner,) = kube.get(JOBS, job, JOBS_NS)["metadata"]["ownerReferences"]
        assert (owner["kind"], owner["name"]) == ("LocalModelNode", "gpu-1")  # as KServe's Jobs
        # The download's credentials (its storage spec), as environment variables from a Secret of
        # the Job's name: never in the Job itself. Each under a key of its own (a variable such as
        # "<host>:<port>-headers" is no valid Secret key).
        (ref,) = [e["valueFrom"]["secretKeyRef"] for e in c["env"] if e["name"] == "STORAGE_CONFIG"]
        assert ref["name"] == job and ref["key"] in (kube.get(SECRETS, job, JOBS_NS).get("data") or {})
        assert "envFrom" not in c and spec["automountServiceAccountToken"] is False
        assert "AK1" not in str(pod)
        assert node_status(kube, "gpu-1")["modelStatus"]["llama"] == "ModelDownloading"

        # The container writes the model into its /mnt/models, the folder of the node root.
        folder = root / "models" / key
        (folder / "weights").mkdir(parents=True)
        (folder / "config.json").write_bytes(b"{}")
        (folder / "weights" / "w.bin").write_bytes(os.urandom(100_000))
        _kubelet_ends(kube, pod, 0)
        status = wait_states(kube, "gpu-1", {"llama": "ModelDownloaded"}, agent=agent)
        assert status["modelDetails"]["llama"]["bytesTotal"] == 100_002
        store = NodeStore.at(root)
        assert store.is_present(key) and store.verify(key) == []  # checked like any other model from now on

        # A pod that fails: the model is an Error naming the Job (KServe: failed > 0).
        bad = _job_pod(kube, "broken", agent)
        _kubelet_ends(kube, bad, 1)
        status = wait_states(kube, "gpu-1", {"broken": "ModelDownloadError"}, agent=agent)
        message = status["modelDetails"]["broken"]["message"]
        assert "download Job modelcache-jobs/broken-gpu-1" in message and "private-downloader" in message
    finally:
        agent.stop()
    assert "AK1" not in agent.log()


def test_without_a_matching_container_an_unknown_scheme_is_an_error_until_one_appears(cluster, tmp_path: Path) -> None:
    cluster.register_node("gpu-1", {"kserve/localmodel": "worker"})
    kube = kube_for(cluster)
    create_node(kube, "gpu-1", [entry("m", "private://models/m")])
    apply_agent_daemonset(cluster, str(tmp_path / "root"))
    agent = start_agent(cluster.agent_kubeconfig, "gpu-1", tmp_path / "root", tmp_path, "--host-path",
                        str(tmp_path / "root"), "--job-namespace", JOBS_NS)
    try:
        status = wait_states(kube, "gpu-1", {"m": "ModelDownloadError"}, agent=agent)
        assert "unknown scheme" in status["modelDetails"]["m"]["message"]
        # A container created after the entry reads it now: its Job starts without an edit.
        _container(kube)
        _job_pod(kube, "m", agent)
        wait_states(kube, "gpu-1", {"m": "ModelDownloading"}, agent=agent)
    finally:
        agent.stop()
    assert CRED_NS  # the credentials namespace is deploy/'s
