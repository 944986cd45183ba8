"""The model root's host path, named once (the DaemonSet's hostroot volume): while a node group's PV
names another directory than the agent's Pod, the agent deletes nothing and says why. Real control
plane, the agent as its ServiceAccount with deploy/'s env, its Pod an object no kubelet runs: the
mismatch is between two API objects (docs/test-cluster.md, "API-only Nodes and why"). That the
agent reads the path from its own Pod, so changing the volume alone keeps a mounted model, runs on
real nodes: tests/test_realnodes_events.py::
test_a_fresh_host_folder_an_agent_pod_deleted_mid_download_a_mounting_pod."""

from __future__ import annotations

import copy
import time
from pathlib import Path
from typing import Any

import pytest

from modelcache.kube.client import EVENTS, LOCAL_MODEL_NODE_GROUPS, PODS, SERVICE_ACCOUNTS, Kube
from modelcache.sources.uri import storage_key
from tests.agent_util import (
    create_group,
    create_node,
    entry,
    kube_for,
    model_files,
    node_status,
    set_entries,
    start_agent,
    wait_states,
)
from tests.deploy_util import find, render
from tests.fixtures.cluster import Cluster
from tests.helpers import wait_until

pytestmark = pytest.mark.timeout(180)

D = "ModelDownloaded"
NS = "modelcache-system"


@pytest.fixture
def kube(cluster: Cluster) -> Kube:
    cluster.register_node("node-a", {"kserve/localmodel": "worker"})
    return kube_for(cluster)


def agent_pod(kube: Kube, node: str, host_dir: Path) -> tuple[str, dict[str, str]]:
    """The agent's Pod as the DaemonSet controller makes it from deploy/'s template, with the host
    path changed the documented way (the hostroot volume only). No container runtime here: the
    agent process runs on this host, so the volume is mounted at its own path. Returns the pod's
    name and the agent container's env as the kubelet resolves it."""
    ds = find(render(), "DaemonSet", "modelcache-agent")
    spec = copy.deepcopy(ds["spec"]["template"]["spec"])
    for volume in spec["volumes"]:
        if volume["name"] == "hostroot":
            volume["hostPath"]["path"] = str(host_dir)
    for container in spec["initContainers"] + spec["containers"]:
        for mount in container.get("volumeMounts") or []:
            if mount["name"] == "hostroot":
                mount["mountPath"] = str(host_dir)
    spec["nodeName"] = node
    name = f"modelcache-agent-{node}"
    wait_until(lambda: kube.get_or_none(SERVICE_ACCOUNTS, "modelcache-agent", NS) is not None, timeout=30,
               what="the agent's ServiceAccount")
    kube.create(PODS, {"metadata": {"name": name, "namespace": NS, "labels": ds["spec"]["template"]["metadata"][
        "labels"]}, "spec": spec}, NS)
    fields = {"spec.nodeName": node, "metadata.name": name, "metadata.namespace": NS, "status.podIP": "127.0.0.1"}
    (agent,) = [c for c in spec["containers"] if c["name"] == "agent"]
    env = {e["name"]: e.get("value") or fields[e["valueFrom"]["fieldRef"]["fieldPath"]] for e in agent["env"]}
    env["MODELCACHE_ROOT"] = str(host_dir)
    return name, env


def events(kube: Kube, reason: str) -> list[dict[str, Any]]:
    return [e for e in kube.list(EVENTS, "default").get("items") or [] if e.get("reason") == reason]


def test_a_node_group_naming_another_path_stops_every_removal_until_fixed(cluster: Cluster, kube: Kube,
                                                                         nginx: Any, tmp_path: Path) -> None:
    host = tmp_path / "models"
    nginx.write("b/model.bin", 1 << 20)
    uri = nginx.url("b/model.bin")
    key = storage_key(uri)
    create_group(kube, "workers", "10Gi", "/mnt/models")  # not where the agent's files are
    create_node(kube, "node-a", [entry("b", uri, nodeGroup="workers")])
    _pod, env = agent_pod(kube, "node-a", host)
    agent = start_agent(cluster.agent_kubeconfig, "node-a", host, tmp_path, env=env)
    try:
        wait_states(kube, "node-a", {"b": "ModelDownloadError"}, agent=agent)  # downloaded, not where pods look
        wait_until(lambda: model_files(host, key) == {"model.bin": 1 << 20}, timeout=20, what="the files")
        wait_until(lambda: events(kube, "HostPathMismatch"), timeout=20, what="a HostPathMismatch event")
        (event,) = events(kube, "HostPathMismatch")
        assert event["type"] == "Warning" and event["involvedObject"]["name"] == "node-a"
        assert f"host path {host}" in event["message"] and "workers: /mnt/models" in event["message"]
        # No pod mounts it, but the agent cannot tell which pods would: nothing is deleted.
        set_entries(kube, "node-a", [entry("other", uri + "?x", nodeGroup="workers")])
        wait_until(lambda: "cannot tell which pods mount the models; keeping them" in agent.log(), timeout=20,
                   what="the removal refused")
        time.sleep(1)
        assert model_files(host, key) == {"model.bin": 1 << 20}
        # The group is corrected: the removal goes ahead.
        group = kube.get(LOCAL_MODEL_NODE_GROUPS, "workers")
        group["spec"]["persistentVolumeSpec"]["local"]["path"] = str(host)
        kube.replace(LOCAL_MODEL_NODE_GROUPS, group)
        wait_until(lambda: not (host / "models" / key).exists(), timeout=20, what="the model deleted once paths agree")
        assert "node group PVs name the model root's host path" in agent.log()
    finally:
        agent.stop()


def test_a_model_is_not_reported_downloaded_while_its_group_pv_names_another_path(
        cluster: Cluster, kube: Kube, nginx: Any, tmp_path: Path) -> None:
    """The files are in the agent's root, but the node group's PV sends serving pods elsewhere:
    Downloaded would place pods on an empty folder. The status names both paths and the fix; once
    the group names the root, the model is Downloaded without a download."""
    host = tmp_path / "models"
    nginx.write("c/model.bin", 1 << 20)
    uri = nginx.url("c/model.bin")
    key = storage_key(uri)
    create_group(kube, "workers", "10Gi", "/mnt/models")
    create_node(kube, "node-a", [entry("c", uri, nodeGroup="workers")])
    _pod, env = agent_pod(kube, "node-a", host)
    agent = start_agent(cluster.agent_kubeconfig, "node-a", host, tmp_path, env=env)
    try:
        status = wait_states(kube, "node-a", {"c": "ModelDownloadError"}, agent=agent)
        wait_until(lambda: model_files(host, key) == {"model.bin": 1 << 20}, timeout=20, what="the files")
        message = wait_message(kube, "c", "serving pods would mount an empty folder")
        assert f"downloaded into host path {host} (the agent's root)" in message
        assert "node group workers's PV names /mnt/models" in message
        assert "persistentVolumeSpec.local.path" in message and status["modelStatus"]["c"] != D
        served = nginx.bytes_served("c/model.bin")
        group = kube.get(LOCAL_MODEL_NODE_GROUPS, "workers")
        group["spec"]["persistentVolumeSpec"]["local"]["path"] = str(host)
        kube.replace(LOCAL_MODEL_NODE_GROUPS, group)
        wait_states(kube, "node-a", {"c": D}, agent=agent)
        assert nginx.bytes_served("c/model.bin") == served  # reported, not downloaded again
    finally:
        agent.stop()


def wait_message(kube: Kube, key: str, needle: str) -> str:
    found: list[str] = []

    def has() -> bool:
        found[:] = [((node_status(kube, "node-a").get("modelDetails") or {}).get(key) or {}).get("message") or ""]
        return needle in found[0]

    wait_until(has, timeout=20, what=f"status message with {needle!r}")
    return found[0]
