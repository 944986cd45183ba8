"""What nodes do to us (issue 24, item 6), on real nodes with deploy/ installed as pods: a node
cordoned and drained, a kubelet stopped and started again, an agent pod deleted mid-download, a
DaemonSet rolling update to a new image tag. The behaviour each shows is in docs/operations.md
("What nodes do")."""

from __future__ import annotations

import json
import subprocess
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
import yaml

from modelcache.uri import storage_key
from tests.cluster.images import podman_archive
from tests.counting_relay import CountingRelay
from tests.deploy_util import image_overlay
from tests.fixtures.image import Image
from tests.fixtures.realnodes import NodeCluster
from tests.helpers import free_port, wait_until
from tests.node_util import safetensors

pytestmark = [pytest.mark.xdist_group("realnodes"), pytest.mark.timeout(900)]
NS = "modelcache-system"
AGENTS = "app.kubernetes.io/name=modelcache-agent"
URI = "s3://models/llm"


class Moto:
    def __init__(self, host: str) -> None:
        from moto.server import ThreadedMotoServer

        self.port = free_port()
        self.server = ThreadedMotoServer(ip_address=host, port=self.port, verbose=False)
        self.server.start()
        self.relay = CountingRelay(host, (host, self.port))
        import boto3

        self.s3 = boto3.client("s3", endpoint_url=f"http://{host}:{self.port}", region_name="us-east-1",
                               aws_access_key_id="k", aws_secret_access_key="s")

    def close(self) -> None:
        self.relay.close()
        self.server.stop()


@pytest.fixture
def installed(real_nodes: NodeCluster, image: Image, tmp_path: Path) -> Iterator[tuple[NodeCluster, Moto]]:
    """deploy/ as pods, a node group of both nodes, S3 credentials for a moto server behind a relay."""
    real_nodes.kubectl("apply", "--server-side", "--force-conflicts", "-k",
                       str(image_overlay(tmp_path / "overlay", image.ref)))
    for what in ("daemonset/modelcache-agent", "deployment/modelcache-coordinator"):
        real_nodes.kubectl("rollout", "status", "-n", NS, what, "--timeout=300s", timeout=330)
    moto = Moto(real_nodes.host_ip)
    secret = {"apiVersion": "v1", "kind": "Secret", "metadata": {
        "name": "s3", "namespace": "modelcache-credentials", "annotations": {
            "serving.kserve.io/s3-endpoint": moto.relay.endpoint, "serving.kserve.io/s3-usehttps": "0",
            "serving.kserve.io/s3-region": "us-east-1"}},
        "stringData": {"AWS_ACCESS_KEY_ID": "k", "AWS_SECRET_ACCESS_KEY": "s"}}
    account = {"apiVersion": "v1", "kind": "ServiceAccount",
               "metadata": {"name": "s3", "namespace": "modelcache-credentials"}, "secrets": [{"name": "s3"}]}
    group = {"apiVersion": "serving.kserve.io/v1alpha1", "kind": "LocalModelNodeGroup",
             "metadata": {"name": "workers"}, "spec": {"storageLimit": "4Gi", "persistentVolumeSpec": {
                 "accessModes": ["ReadWriteOnce"], "capacity": {"storage": "4Gi"}, "local": {"path": "/models"},
                 "storageClassName": "local-storage", "nodeAffinity": {"required": {"nodeSelectorTerms": [
                     {"matchExpressions": [{"key": "kserve/localmodel", "operator": "In", "values": ["worker"]}]}]}}},
                 "persistentVolumeClaimSpec": {"accessModes": ["ReadWriteOnce"], "storageClassName": "local-storage",
                                               "resources": {"requests": {"storage": "4Gi"}}}}}
    real_nodes.kubectl("apply", "-f", "-", input=yaml.safe_dump_all([secret, account, group]))
    try:
        yield real_nodes, moto
    finally:
        moto.close()


def put_model(moto: Moto, shards: int, shard_mib: int) -> int:
    moto.s3.create_bucket(Bucket="models")
    size = 0
    for i in range(shards):
        data = safetensors({f"w{i}": ("F32", [shard_mib * 256, 1024])}, fill=i + 1)
        moto.s3.put_object(Bucket="models", Key=f"llm/model-{i + 1:05d}-of-{shards:05d}.safetensors", Body=data)
        size += len(data)
    return size


def cache(cluster: NodeCluster, size: int) -> None:
    cluster.kubectl("apply", "-f", "-", input=yaml.safe_dump({
        "apiVersion": "serving.kserve.io/v1alpha1", "kind": "LocalModelCache", "metadata": {"name": "llm"},
        "spec": {"sourceModelUri": URI, "modelSize": f"{(size >> 20) + 1}Mi", "nodeGroups": ["workers"],
                 "serviceAccountName": "s3"}}))


def state(cluster: NodeCluster, node: str) -> str:
    out = cluster.kubectl("get", "localmodelnode", node, "-o", "json", check=False)
    if out.returncode != 0:
        return ""
    value = ((json.loads(out.stdout).get("status") or {}).get("modelStatus") or {}).get("llm", "")
    return str(value if isinstance(value, str) else value.get("state", ""))


def downloaded(cluster: NodeCluster, nodes: tuple[str, ...] = ("node-1", "node-2"), timeout: float = 300) -> None:
    for node in nodes:
        wait_until(lambda node=node: state(cluster, node) == "ModelDownloaded", timeout=timeout,  # type: ignore[misc]
                   what=f"the model downloaded on {node}")


def agent_pod(cluster: NodeCluster, node: str) -> dict[str, Any]:
    pods = json.loads(cluster.kubectl("get", "pods", "-n", NS, "-l", AGENTS, "-o", "json").stdout)["items"]
    (pod,) = [p for p in pods if p["spec"]["nodeName"] == node and not p["metadata"].get("deletionTimestamp")]
    return dict(pod)


def inodes(cluster: NodeCluster, node: str) -> dict[str, int]:
    folder = cluster.node(node).host_path("/models") / "models" / storage_key(URI)
    return {p.name: p.stat().st_ino for p in folder.iterdir()}


def test_an_agent_pod_deleted_mid_download_resumes(installed: tuple[NodeCluster, Moto]) -> None:
    cluster, moto = installed
    size = put_model(moto, shards=4, shard_mib=64)
    cache(cluster, size)
    first = agent_pod(cluster, "node-1")["metadata"]["name"]
    wait_until(lambda: moto.relay.bytes_from_origin > size // 8, timeout=300, what="the download under way")
    cluster.kubectl("delete", "pod", "-n", NS, first, "--wait=false")
    downloaded(cluster)
    assert agent_pod(cluster, "node-1")["metadata"]["name"] != first  # the DaemonSet's new pod finished it
    # Resumed, not started over: both nodes together read less than twice the model plus what the
    # deleted pod had in flight (its unfinished chunks are fetched again).
    assert moto.relay.bytes_from_origin < 2.5 * size, (moto.relay.bytes_from_origin, size)


def test_drain_keeps_models_and_the_agent(installed: tuple[NodeCluster, Moto]) -> None:
    cluster, moto = installed
    size = put_model(moto, shards=2, shard_mib=4)
    cache(cluster, size)
    downloaded(cluster)
    before = inodes(cluster, "node-1")
    agent = agent_pod(cluster, "node-1")["metadata"]["name"]
    moto.relay.reset()
    cluster.kubectl("drain", "node-1", "--ignore-daemonsets", "--delete-emptydir-data", "--timeout=180s",
                    timeout=200)
    # The coordinator replica on node-1 was evicted (the PDB kept one serving the webhooks); the
    # agent (a DaemonSet pod) stays, and so do the node's models.
    coordinators = json.loads(cluster.kubectl("get", "pods", "-n", NS, "-l",
                                              "app.kubernetes.io/name=modelcache-coordinator", "-o", "json").stdout)
    assert all(p["spec"].get("nodeName") != "node-1" for p in coordinators["items"]
               if not p["metadata"].get("deletionTimestamp"))
    assert agent_pod(cluster, "node-1")["metadata"]["name"] == agent
    assert inodes(cluster, "node-1") == before and state(cluster, "node-1") == "ModelDownloaded"
    cluster.kubectl("uncordon", "node-1")
    assert moto.relay.bytes_from_origin == 0


def test_a_stopped_kubelet_makes_the_node_not_ready_and_its_return_changes_nothing(
        installed: tuple[NodeCluster, Moto]) -> None:
    cluster, moto = installed
    size = put_model(moto, shards=2, shard_mib=4)
    cache(cluster, size)
    downloaded(cluster)
    before = inodes(cluster, "node-2")
    agent = agent_pod(cluster, "node-2")
    node = cluster.node("node-2")
    moto.relay.reset()
    node.stop_kubelet()
    try:
        def ready() -> str:
            out = cluster.kubectl("get", "node", "node-2", "-o",
                                  "jsonpath={.status.conditions[?(@.type=='Ready')].status}")
            return out.stdout

        wait_until(lambda: ready() == "Unknown", timeout=120, what="node-2 NotReady (kubelet stopped posting)")
        # The containers outlive the kubelet: the agent still runs (its cgroup has processes).
        from tests.cluster import cgroups

        assert cgroups.pids(f"{node.cgroup_root}/kubepods")
    finally:
        node.start_kubelet()
    node.wait_ready(180)
    wait_until(lambda: agent_pod(cluster, "node-2")["status"].get("containerStatuses", [{}])[0].get("ready") is True,
               timeout=120, what="the agent Ready again")
    again = agent_pod(cluster, "node-2")
    assert again["metadata"]["uid"] == agent["metadata"]["uid"]  # the same pod, not a new one
    assert again["status"]["containerStatuses"][0]["restartCount"] == 0
    assert inodes(cluster, "node-2") == before and moto.relay.bytes_from_origin == 0


def test_a_rolling_update_to_a_new_image_tag_keeps_the_models(installed: tuple[NodeCluster, Moto],
                                                              image: Image) -> None:
    cluster, moto = installed
    size = put_model(moto, shards=2, shard_mib=4)
    cache(cluster, size)
    downloaded(cluster)
    before = {n: inodes(cluster, n) for n in ("node-1", "node-2")}
    old = {n: agent_pod(cluster, n)["metadata"]["uid"] for n in ("node-1", "node-2")}
    new_ref = image.ref.rsplit(":", 1)[0] + ":rolled"
    image.podman("tag", image.ref, new_ref)
    try:
        for node in cluster.run.nodes:
            node.load([podman_archive(new_ref, image.env)])
        moto.relay.reset()
        cluster.kubectl("set", "image", "-n", NS, "daemonset/modelcache-agent", f"agent={new_ref}",
                        f"prepare-root={new_ref}")
        cluster.kubectl("rollout", "status", "-n", NS, "daemonset/modelcache-agent", "--timeout=300s", timeout=330)
        for n in ("node-1", "node-2"):
            pod = agent_pod(cluster, n)
            assert pod["metadata"]["uid"] != old[n] and pod["spec"]["containers"][0]["image"] == new_ref
        time.sleep(5)
        downloaded(cluster, timeout=60)
        assert {n: inodes(cluster, n) for n in ("node-1", "node-2")} == before  # nothing re-downloaded
        assert moto.relay.bytes_from_origin == 0
    finally:
        subprocess.run(["podman", "rmi", new_ref], env=image.env, capture_output=True)
