"""What nodes do to us (issue 24, item 6), on real nodes with deploy/ installed as pods: a fresh
node whose host folder does not exist yet, an agent pod deleted mid-download, a node cordoned and
drained, a kubelet stopped and started again, a DaemonSet rolling update to a new image tag. The
behaviour each shows is in docs/operations.md ("What nodes do"). Last, a model removed while a
serving pod mounts it waits for that pod until its kubelet has stopped it (item 9: this was a
process-based test that deleted the pod with grace 0 "as its kubelet would").

There is no KServe in these clusters, so the S3 Secret's keys are spelled as KServe's code
defaults read them (realnodes_util.s3_credentials)."""

from __future__ import annotations

import subprocess
import time
import urllib.request
from pathlib import Path
from typing import Any

import pytest

from modelcache.sources.uri import storage_key
from tests.cluster import cgroups
from tests.cluster.images import static_image
from tests.fixtures.image import Image
from tests.fixtures.realnodes import NodeCluster
from tests.helpers import unique, wait_until
from tests.realnodes_util import (
    AGENT_PODS,
    install,
    local_volume,
    model_cache,
    model_states,
    node_group,
    origin_for_pods,
    s3_credentials,
    served_files,
    sha256_files,
    wait_downloaded,
)

pytestmark = [pytest.mark.xdist_group("realnodes"), pytest.mark.timeout(900)]
NS = "modelcache-system"
CREDENTIALS_NS = "modelcache-credentials"
NODES = ("node-1", "node-2")



def agent_pod(cluster: NodeCluster, node: str) -> dict[str, Any]:
    """The agent pod on ``node`` (not one being deleted)."""
    items = cluster.get(f"/api/v1/namespaces/{NS}/pods?labelSelector={AGENT_PODS}")["items"]
    (pod,) = [p for p in items if p["spec"].get("nodeName") == node and not p["metadata"].get("deletionTimestamp")]
    return dict(pod)


def agent_ready(cluster: NodeCluster, node: str) -> bool:
    try:
        pod = agent_pod(cluster, node)
    except ValueError:
        return False
    return any(c["type"] == "Ready" and c["status"] == "True" for c in pod["status"].get("conditions", []))


def cache_node_status(cluster: NodeCluster, name: str) -> dict[str, str]:
    status = cluster.get(f"/apis/serving.kserve.io/v1alpha1/localmodelcaches/{name}").get("status") or {}
    return dict(status.get("nodeStatus") or {})


def inodes(folder: Path) -> dict[str, tuple[int, int]]:
    """{file: (inode, mtime)}: the same files, not rewritten or downloaded again."""
    return {p.name: (p.stat().st_ino, p.stat().st_mtime_ns) for p in folder.iterdir()}


def test_a_fresh_host_folder_an_agent_pod_deleted_mid_download_a_mounting_pod(
        real_nodes: NodeCluster, image: Image, tmp_path: Path) -> None:
    """The agents' host folder does not exist on either node (a fresh node): the kubelet makes it
    (hostPath DirectoryOrCreate, root's) and prepare-root hands it to the agent's user. Then the
    agent pod of the one node that holds a model is deleted while the model downloads: the
    DaemonSet's next pod resumes from the journal, it does not start over. Last, the host folder
    was changed in the DaemonSet's volume alone (as deploy/ says): a real serving pod mounting the
    model through the node group's PV keeps it when the cache goes, until its kubelet has stopped
    the pod (this was a process test in tests/test_agent_hostpath.py whose serving pod was an
    object marked Running, never started)."""
    root = "/models/fresh-root"
    for node in NODES:
        assert not real_nodes.node(node).host_path(root).exists()
    earlier_mismatches = {e["metadata"]["uid"] for e in
                          real_nodes.get("/api/v1/events?fieldSelector=reason%3DHostPathMismatch")["items"]}
    install(real_nodes, image.ref, tmp_path / "overlay", host_root=root)
    for node in NODES:
        folder = real_nodes.node(node).host_path(root)
        assert (folder.stat().st_uid, folder.stat().st_gid) == (1000, 1000), node
        assert ((folder / "models").stat().st_uid, folder.stat().st_mode & 0o777) == (1000, 0o755), node

    # 64 MiB at 4 MiB/s: some 16 s of download, a pod deleted half way.
    rate = 4 << 20
    with origin_for_pods(real_nodes, rate=rate) as origin:
        bucket = unique("models")
        uri = f"s3://{bucket}/llm"
        digests = origin.put_model(bucket, "llm", shards=4, shard_bytes=16 << 20)
        size = sum(o["Size"] for o in origin.client().list_objects_v2(Bucket=bucket, Prefix="llm/")["Contents"])
        account = s3_credentials(real_nodes, CREDENTIALS_NS, origin, kserve_config=False)
        first = agent_pod(real_nodes, "node-1")["metadata"]["uid"]
        real_nodes.apply(node_group("first", path=root, nodes=["node-1"]),
              model_cache("llm", uri, ["first"], account))
        wait_until(lambda: origin.relay.bytes_from_origin > size // 2, timeout=300, what="half the model downloaded")
        at_delete = origin.relay.bytes_from_origin
        real_nodes.kubectl("delete", "pod", "-n", NS, agent_pod(real_nodes, "node-1")["metadata"]["name"],
                           "--wait=false")
        wait_downloaded(real_nodes, "llm", ("node-1",))
        assert agent_pod(real_nodes, "node-1")["metadata"]["uid"] != first  # the next pod finished it
        folder = real_nodes.node("node-1").host_path(root) / "models" / storage_key(uri)
        assert sha256_files(folder) == digests
        # Resumed, not started over: started over, the origin would have sent what it sent before
        # the deletion and then the whole model again. Resumed, it sends the model once plus what
        # had arrived but was not yet in the journal when the pod stopped (the journal records
        # progress within a chunk: measured 5 MB of 67 MB here, with 34 MB sent at the deletion).
        total = origin.relay.bytes_from_origin
        assert size <= total < size + at_delete // 2, (total, at_delete, size)

        # KServe's rewrite on the node group's PV (the same folder): a real serving pod on node-1
        # reads the model there. The agent took its host path from its own Pod, so it sees the pod
        # and keeps the model when the cache goes; an agent assuming deploy/'s /models would have
        # deleted it under the pod, or refused every removal with a HostPathMismatch.
        agent = agent_pod(real_nodes, "node-1")["metadata"]["name"]
        log = real_nodes.kubectl("logs", "-n", NS, agent, "-c", "agent").stdout
        assert f"host_path={root}" in log, log[-2000:]
        key = storage_key(uri)
        serve_on_node_1(real_nodes, root, key, digests)
        files = inodes(folder)
        real_nodes.kubectl("delete", "localmodelcache", "llm", "--wait=false")
        wait_until(lambda: kept_for_the_pod(real_nodes), timeout=120, what="node-1's copy reported as kept for the pod")
        time.sleep(3)  # several of the agent's removal re-checks
        assert inodes(folder) == files and sha256_files(folder) == digests
        # node-1's agent's (the node with the model and the pod), not an earlier test's: the real
        # nodes are shared, and CI (ecf0eb5) saw one from node-2's agent of the test before, whose
        # group had gone as it stopped ("/models ... workers: not found").
        mismatches = [e for e in real_nodes.get("/api/v1/events?fieldSelector=reason%3DHostPathMismatch")["items"]
                      if e["metadata"]["uid"] not in earlier_mismatches
                      and (e.get("source") or {}).get("host") == "node-1"]
        assert mismatches == [], [e["message"] for e in mismatches]
        # Once its kubelet has stopped the pod and confirmed the deletion, the model goes.
        real_nodes.kubectl("delete", "pod", "-n", "team", "serve", "--timeout=120s", timeout=150)
        wait_until(lambda: not folder.exists(), timeout=120, what="node-1's copy deleted after the pod")
        manifest = Path(".modelcache") / "manifests" / f"{key}.json"
        assert not (real_nodes.node("node-1").host_path(root) / manifest).exists()
        real_nodes.kubectl("wait", "--for=delete", "localmodelcache/llm", "--timeout=120s", timeout=150)


def test_drain_a_stopped_kubelet_a_rolling_update_and_a_mounting_pod(real_nodes: NodeCluster, image: Image,
                                                                      tmp_path: Path) -> None:
    """A model on both nodes stays, the same files, with not one byte from the origin, through a
    drain of node-1, node-2's kubelet stopped (NotReady; the cache shows NodeNotReady; the
    containers keep running) and started again (the same agent pod, not restarted), and a rolling
    update of the agents to a new image tag (new pods, the models kept, nothing re-downloaded)."""
    install(real_nodes, image.ref, tmp_path / "overlay")
    with origin_for_pods(real_nodes) as origin:
        bucket = unique("models")
        uri = f"s3://{bucket}/llm"
        digests = origin.put_model(bucket, "llm", shards=2, shard_bytes=4 << 20)
        account = s3_credentials(real_nodes, CREDENTIALS_NS, origin, kserve_config=False)
        real_nodes.apply(node_group("workers"), model_cache("llm", uri, ["workers"], account))
        wait_downloaded(real_nodes, "llm")
        folders = {n: real_nodes.node(n).host_path("/models") / "models" / storage_key(uri) for n in NODES}
        assert all(sha256_files(f) == digests for f in folders.values())
        files = {n: inodes(f) for n, f in folders.items()}
        wait_until(lambda: cache_node_status(real_nodes, "llm") == dict.fromkeys(NODES, "NodeDownloaded"),
                   timeout=60, what="the cache's nodeStatus")
        origin.relay.reset()

        # Cordon and drain node-1: the coordinator replica there is evicted (the PDB keeps one
        # serving the webhooks); the agent (a DaemonSet pod) stays, and so does the node's model.
        agent = agent_pod(real_nodes, "node-1")["metadata"]["uid"]
        real_nodes.kubectl("drain", "node-1", "--ignore-daemonsets", "--delete-emptydir-data", "--timeout=180s",
                           timeout=200)
        coordinators = real_nodes.get(f"/api/v1/namespaces/{NS}/pods?labelSelector="
                                       "app.kubernetes.io/name=modelcache-coordinator")["items"]
        assert [p["spec"].get("nodeName") for p in coordinators if not p["metadata"].get("deletionTimestamp")
                and p["spec"].get("nodeName") == "node-1"] == []
        assert agent_pod(real_nodes, "node-1")["metadata"]["uid"] == agent
        assert cache_node_status(real_nodes, "llm")["node-1"] == "NodeDownloaded"
        assert model_states(real_nodes, "node-1")["llm"] == "ModelDownloaded"
        real_nodes.kubectl("uncordon", "node-1")

        # node-2's kubelet stopped: the node goes NotReady (Unknown: no status posted), the cache
        # shows NodeNotReady there, the node keeps its files and its containers keep running.
        node = real_nodes.node("node-2")
        agent2 = agent_pod(real_nodes, "node-2")
        node.stop_kubelet()
        try:
            wait_until(lambda: _ready_condition(real_nodes, "node-2") == "Unknown", timeout=180,
                       what="node-2 NotReady after its kubelet stopped")
            wait_until(lambda: cache_node_status(real_nodes, "llm").get("node-2") == "NodeNotReady", timeout=60,
                       what="the cache's NodeNotReady for node-2")
            assert cache_node_status(real_nodes, "llm")["node-1"] == "NodeDownloaded"
            assert cgroups.pids(f"{node.cgroup_root}/kubepods")  # the agent's processes still run
        finally:
            node.start_kubelet()
        node.wait_ready(180)
        wait_until(lambda: agent_ready(real_nodes, "node-2"), timeout=180, what="node-2's agent Ready again")
        again = agent_pod(real_nodes, "node-2")
        assert again["metadata"]["uid"] == agent2["metadata"]["uid"]  # the same pod ...
        assert again["status"]["containerStatuses"][0]["restartCount"] == 0  # ... never restarted
        wait_until(lambda: cache_node_status(real_nodes, "llm") == dict.fromkeys(NODES, "NodeDownloaded"),
                   timeout=60, what="the cache's nodeStatus back")

        # A rolling update of the agents to a new tag: new pods on both nodes find their models.
        old = {n: agent_pod(real_nodes, n)["metadata"]["uid"] for n in NODES}
        # The new tag is the same image tagged again in each node's containerd, as a registry
        # would serve a release whose layers the node has.
        new_ref = f"{image.ref}-rolled"
        for each in real_nodes.run.nodes:
            subprocess.run([*each.ctr, "images", "tag", "--force", image.ref, new_ref], check=True,
                           capture_output=True)
        real_nodes.kubectl("set", "image", "-n", NS, "daemonset/modelcache-agent", f"agent={new_ref}",
                           f"prepare-root={new_ref}")
        real_nodes.kubectl("rollout", "status", "-n", NS, "daemonset/modelcache-agent", "--timeout=300s",
                           timeout=330)
        for n in NODES:
            pod = agent_pod(real_nodes, n)
            assert pod["metadata"]["uid"] != old[n] and pod["spec"]["containers"][0]["image"] == new_ref
        time.sleep(10)  # a new agent that re-downloads would have begun by now: the origin is counted below
        wait_downloaded(real_nodes, "llm", timeout=60)
        assert {n: inodes(f) for n, f in folders.items()} == files  # the same files throughout
        assert origin.relay.bytes_from_origin == 0 and origin.relay.connections == 0

        # A serving pod on node-1 reads the model through a volume of the node group (KServe's
        # rewrite: the group's local PV, subPath models/<storageKey>); then the cache is deleted.
        # node-2's copy goes at once; node-1's stays while the pod runs (the status names it) and
        # goes once the pod's kubelet has stopped it and confirmed the deletion (no grace 0 here).
        key = storage_key(uri)
        serve_on_node_1(real_nodes, "/models", key, digests)
        real_nodes.kubectl("delete", "localmodelcache", "llm", "--wait=false")
        wait_until(lambda: not folders["node-2"].exists(), timeout=120, what="node-2's copy deleted")
        manifest = Path(".modelcache") / "manifests" / f"{key}.json"
        assert not (real_nodes.node("node-2").host_path("/models") / manifest).exists()

        wait_until(lambda: kept_for_the_pod(real_nodes), timeout=120, what="node-1's copy reported as kept for the pod")
        assert inodes(folders["node-1"]) == files["node-1"]
        ip = agent_pod(real_nodes, "node-1")["status"]["podIP"]
        with urllib.request.urlopen(f"http://{ip}:8080/metrics", timeout=10) as resp:
            assert "modelcache_agent_removals_waiting 1.0" in resp.read().decode()
        real_nodes.kubectl("delete", "pod", "-n", "team", "serve", "--timeout=120s", timeout=150)
        wait_until(lambda: not folders["node-1"].exists(), timeout=120, what="node-1's copy deleted after the pod")
        assert not (real_nodes.node("node-1").host_path("/models") / manifest).exists()
        real_nodes.kubectl("wait", "--for=delete", "localmodelcache/llm", "--timeout=120s", timeout=150)


def serve_on_node_1(cluster: NodeCluster, root: str, key: str, digests: dict[str, str]) -> None:
    """A serving pod ``team/serve`` on node-1 on a volume as KServe rewrites a predictor for a
    node group (its local PV at the agents' host folder ``root``, subPath models/<storageKey>),
    Ready once it has read every file; what it read is the model."""
    cluster.kubectl("create", "namespace", "team")
    cluster.apply(*local_volume("serving-llm", "team", "node-1", root), serving_pod("team", key))
    cluster.kubectl("wait", "-n", "team", "pod/serve", "--for=condition=Ready", "--timeout=180s", timeout=200)
    log = cluster.kubectl("logs", "-n", "team", "serve").stdout
    assert served_files(log) == digests, log


def kept_for_the_pod(cluster: NodeCluster) -> bool:
    """node-1's agent no longer reports llm, and says it keeps the files for team/serve."""
    status = cluster.get("/apis/serving.kserve.io/v1alpha1/localmodelnodes/node-1").get("status") or {}
    message = ((status.get("modelDetails") or {}).get("llm") or {}).get("message") or ""
    return not status.get("modelStatus") and "team/serve" in message


def serving_pod(namespace: str, key: str) -> dict[str, Any]:
    """Our serving container on the claim, placed by the scheduler (the PV's node affinity)."""
    return {"apiVersion": "v1", "kind": "Pod", "metadata": {"name": "serve", "namespace": namespace}, "spec": {
        "containers": [{"name": "kserve-container", "image": static_image("serve").ref,
                        "args": ["--model-name=llm", "--model-dir=/mnt/models", "--digest=sha256"],
                        "readinessProbe": {"httpGet": {"path": "/v2/health/ready", "port": 8080}, "periodSeconds": 1},
                        "volumeMounts": [{"name": "kserve-pvc-source", "mountPath": "/mnt/models",
                                          "subPath": f"models/{key}", "readOnly": True}]}],
        "volumes": [{"name": "kserve-pvc-source", "persistentVolumeClaim": {"claimName": "serving-llm"}}]}}


def _ready_condition(cluster: NodeCluster, node: str) -> str:
    conditions = cluster.get(f"/api/v1/nodes/{node}")["status"].get("conditions") or []
    return next((str(c["status"]) for c in conditions if c["type"] == "Ready"), "")
