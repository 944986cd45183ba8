"""KServe's ``localModelDownloadJob`` ClusterStorageContainers, for a URI none of our sources reads,
before any pod runs: on the real control plane with the agent as a process and its Node an API
object, a URI no container matches is an Error until one appears, and then its Job is made
without an edit (the Job controller makes its pod, the scheduler binds it). The Job's pod run by
a kubelet, its end reported: tests/test_realnodes_jobs.py (docs/test-cluster.md, "API-only Nodes
and why")."""

from __future__ import annotations

import os
from pathlib import Path
from typing import Any

import pytest

from modelcache.kube.client import CLUSTER_STORAGE_CONTAINERS, PODS
from modelcache.sources.uri import storage_key
from tests.agent_util import (
    CRED_NS,
    apply_agent_daemonset,
    create_node,
    entry,
    kube_for,
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
        # The folder its pod mounts is the agent's, group-writable for the pod's fsGroup: left to
        # the kubelet it would be root's 0755 (tests/test_realnodes_jobs.py).
        folder = tmp_path / "root" / "models" / storage_key("private://models/m")
        assert folder.stat().st_mode & 0o7777 == 0o775 and folder.stat().st_uid == os.getuid()
    finally:
        agent.stop()
    assert CRED_NS  # the credentials namespace is deploy/'s
