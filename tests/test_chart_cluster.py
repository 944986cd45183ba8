"""The Helm chart's life on the real control plane with real nodes (kubelets and containerd):
`helm install` runs the agents and coordinators as pods, a cache fills both nodes from S3, `helm
upgrade` with a changed value and a new image tag rolls every pod over and no model is downloaded
again, `helm rollback` goes back to the first revision (again without a download), and `helm
uninstall` removes every object of the release while the CRDs, and so every cache, stay."""

from __future__ import annotations

import json
import subprocess
from collections.abc import Iterator
from datetime import datetime
from pathlib import Path
from typing import Any

import pytest
import yaml

from tests.cluster.images import podman_archive
from tests.fixtures.image import Image
from tests.fixtures.ops import Helm
from tests.fixtures.realnodes import NodeCluster, start_real_nodes
from tests.helpers import REPO, wait_until

pytestmark = [pytest.mark.xdist_group("realnodes"), pytest.mark.timeout(1500)]

CHART = REPO / "charts" / "modelcache"
NS = "modelcache-system"
AGENT = "app.kubernetes.io/name=modelcache-agent"
COORDINATOR = "app.kubernetes.io/name=modelcache-coordinator"
KEY = ("chart-access-key", "chart-secret-key")


@pytest.fixture
def bare_nodes(tmp_path: Path, image: Image) -> Iterator[NodeCluster]:
    """Real nodes on a control plane with nothing of ours (the shared one has deploy/'s namespaces
    and RBAC applied, which Helm would refuse to take over)."""
    run = start_real_nodes(tmp_path / "nodes", image, baseline=False)
    try:
        yield NodeCluster(run, tmp_path)
    finally:
        run.stop()


def pods(cluster: NodeCluster, selector: str) -> list[dict[str, Any]]:
    return list(json.loads(cluster.kubectl("get", "pods", "-n", NS, "-l", selector, "-o", "json").stdout)["items"])


def images_of(cluster: NodeCluster, selector: str) -> set[str]:
    return {c["image"] for p in pods(cluster, selector) for c in p["spec"]["containers"]}


def agent_metric(cluster: NodeCluster, pod: str, name: str) -> float:
    """One sample of an agent pod's /metrics (0 when absent), read inside the pod."""
    script = ("import urllib.request; print(urllib.request.urlopen('http://127.0.0.1:8080/metrics', timeout=5)"
              ".read().decode())")
    text = cluster.kubectl("exec", "-n", NS, pod, "-c", "agent", "--", "python", "-c", script).stdout
    values = [float(line.split()[-1]) for line in text.splitlines() if line.startswith(name)]
    return sum(values)


def model_states(cluster: NodeCluster) -> dict[str, dict[str, Any]]:
    out = {}
    for node in ("node-1", "node-2"):
        got = cluster.kubectl("get", "localmodelnode", node, "-o", "json", check=False)
        details = (json.loads(got.stdout).get("status") or {}).get("modelDetails", {}) if got.returncode == 0 else {}
        out[node] = details.get("llm") or {}
    return out


def settled(cluster: NodeCluster, helm: Helm, revision: int) -> None:
    """The release at ``revision`` deployed, and every pod of it Ready (helm --wait saw them)."""
    history = json.loads(helm("history", "modelcache", "-n", "default", "-o", "json",
                              kubeconfig=cluster.kubeconfig).stdout)
    assert history[-1]["revision"] == revision and history[-1]["status"] == "deployed", history


def when(stamp: str) -> datetime:
    return datetime.fromisoformat(stamp)


def assert_not_downloaded_again(states: dict[str, dict[str, Any]], downloaded_by: datetime) -> None:
    """A new agent that found the copy on disk reports no start and, as the copy's finish, when the
    manifest was written: before the first agents were replaced. A download would start anew."""
    for node, d in states.items():
        assert d["state"] == "ModelDownloaded" and "startedAt" not in d, (node, d)
        assert when(d["finishedAt"]) <= downloaded_by, (node, d, downloaded_by)


def test_helm_install_upgrade_rollback_uninstall_keep_the_models(bare_nodes: NodeCluster, image: Image,
                                                                    helm: Helm, tmp_path: Path,
                                                                    monkeypatch: pytest.MonkeyPatch) -> None:
    from tests.cluster.demo import model_in_s3

    cluster = bare_nodes
    repo, _, tag = image.ref.rpartition(":")
    kube = cluster.kubeconfig
    monkeypatch.setenv("MODELCACHE_DEMO_SHARD_MB", "4")  # the demo's model, small: 4 MiB shards
    server, endpoint, size, _names = model_in_s3(tmp_path / "model", cluster.host_ip)
    try:
        # install: pods Ready on both labelled nodes (helm --wait), as the chart's defaults say.
        helm("install", "modelcache", str(CHART), "-n", "default", "--set", f"image.repository={repo}",
             "--set", f"image.tag={tag}", "--wait", "--timeout", "10m", kubeconfig=kube, timeout=700)
        settled(cluster, helm, 1)
        assert sorted(p["spec"]["nodeName"] for p in pods(cluster, AGENT)) == ["node-1", "node-2"]
        assert images_of(cluster, AGENT) == images_of(cluster, COORDINATOR) == {image.ref}
        labels = json.loads(cluster.kubectl("get", "namespace", NS, "-o", "json").stdout)["metadata"]["labels"]
        assert labels["pod-security.kubernetes.io/enforce"] == "privileged"

        secret = {"apiVersion": "v1", "kind": "Secret", "metadata": {
            "name": "s3", "namespace": "modelcache-credentials", "annotations": {
                "serving.kserve.io/s3-endpoint": endpoint, "serving.kserve.io/s3-usehttps": "0",
                "serving.kserve.io/s3-region": "us-east-1"}},
            "stringData": {"awsAccessKeyID": KEY[0], "awsSecretAccessKey": KEY[1]}}
        account = {"apiVersion": "v1", "kind": "ServiceAccount", "metadata": {
            "name": "models", "namespace": "modelcache-credentials"}, "secrets": [{"name": "s3"}]}
        group = {"apiVersion": "serving.kserve.io/v1alpha1", "kind": "LocalModelNodeGroup",
                 "metadata": {"name": "workers"}, "spec": {
                     "storageLimit": "2Gi", "persistentVolumeSpec": {
                         "accessModes": ["ReadWriteOnce"], "capacity": {"storage": "2Gi"},
                         "local": {"path": "/models"}, "storageClassName": "local-storage",
                         "nodeAffinity": {"required": {"nodeSelectorTerms": [{"matchExpressions": [
                             {"key": "kserve/localmodel", "operator": "In", "values": ["worker"]}]}]}}},
                     "persistentVolumeClaimSpec": {"accessModes": ["ReadWriteOnce"],
                                                   "resources": {"requests": {"storage": "2Gi"}}}}}
        cache = {"apiVersion": "serving.kserve.io/v1alpha1", "kind": "LocalModelCache", "metadata": {"name": "llm"},
                 "spec": {"sourceModelUri": "s3://models/llm", "modelSize": f"{(size >> 20) + 1}Mi",
                          "nodeGroups": ["workers"], "serviceAccountName": "models"}}
        cluster.kubectl("apply", "-f", "-", input=yaml.safe_dump_all([secret, account, group, cache]))

        def downloaded() -> bool:
            return all(d.get("state") == "ModelDownloaded" for d in model_states(cluster).values())

        wait_until(downloaded, timeout=300, what="the model downloaded on both nodes")
        first = model_states(cluster)
        assert all(d["bytesTotal"] == size for d in first.values()), first
        downloaded_by = max(when(d["finishedAt"]) for d in first.values())
        for pod in pods(cluster, AGENT):  # peers auto with the peer token mounted: on (what the upgrade turns off)
            log = cluster.kubectl("logs", "-n", NS, pod["metadata"]["name"], "-c", "agent").stdout
            assert "peer transfer on" in log, log[-2000:]

        # upgrade: a changed value (no peer transfer) and a new image tag (the same image, retagged
        # and loaded into the nodes' containerd): every pod is replaced, no model is fetched again.
        new_ref = f"{repo}:{tag}-next"
        subprocess.run(["podman", "tag", image.ref, new_ref], env=image.env, check=True, capture_output=True)
        archive = podman_archive(new_ref, image.env)
        for node in ("node-1", "node-2"):
            cluster.node(node).load([archive])
        old_agents = {p["metadata"]["name"] for p in pods(cluster, AGENT)}
        helm("upgrade", "modelcache", str(CHART), "-n", "default", "--reuse-values", "--set", f"image.tag={tag}-next",
             "--set", "agent.peers=off", "--wait", "--timeout", "10m", kubeconfig=kube, timeout=700)
        settled(cluster, helm, 2)
        cluster.kubectl("rollout", "status", "-n", NS, "daemonset/modelcache-agent", "--timeout=300s", timeout=330)
        agents = pods(cluster, AGENT)
        assert not old_agents & {p["metadata"]["name"] for p in agents}, "the agents were not replaced"
        assert images_of(cluster, AGENT) == images_of(cluster, COORDINATOR) == {new_ref}
        config = json.loads(cluster.kubectl("get", "configmap", "modelcache-agent", "-n", NS, "-o", "json").stdout)
        assert config["data"]["MODELCACHE_PEERS"] == "off"
        for pod in agents:
            log = cluster.kubectl("logs", "-n", NS, pod["metadata"]["name"], "-c", "agent").stdout
            assert "peer transfer on" not in log, log[-2000:]  # the changed value reached the new pods
        wait_until(downloaded, timeout=120, what="the new agents report the model Downloaded")
        for pod in agents:
            # The new agent process found the copy on disk: it downloaded no byte.
            assert agent_metric(cluster, pod["metadata"]["name"], "modelcache_agent_downloaded_bytes_total") == 0
            assert agent_metric(cluster, pod["metadata"]["name"],
                                'modelcache_agent_models{state="ModelDownloaded"}') == 1
        assert_not_downloaded_again(model_states(cluster), downloaded_by)

        # rollback to revision 1: the first image and peers auto again, still nothing downloaded.
        helm("rollback", "modelcache", "1", "-n", "default", "--wait", "--timeout", "10m", kubeconfig=kube,
             timeout=700)
        settled(cluster, helm, 3)
        cluster.kubectl("rollout", "status", "-n", NS, "daemonset/modelcache-agent", "--timeout=300s", timeout=330)
        assert images_of(cluster, AGENT) == images_of(cluster, COORDINATOR) == {image.ref}
        config = json.loads(cluster.kubectl("get", "configmap", "modelcache-agent", "-n", NS, "-o", "json").stdout)
        assert config["data"]["MODELCACHE_PEERS"] == "auto"
        wait_until(downloaded, timeout=120, what="the rolled-back agents report the model Downloaded")
        for pod in pods(cluster, AGENT):
            assert agent_metric(cluster, pod["metadata"]["name"], "modelcache_agent_downloaded_bytes_total") == 0
        assert_not_downloaded_again(model_states(cluster), downloaded_by)

        # uninstall: every object of the release goes; the CRDs (crds/) and so the cache stay, and
        # the models stay on the nodes' disks.
        helm("uninstall", "modelcache", "-n", "default", "--wait", "--timeout", "5m", kubeconfig=kube, timeout=400)
        for kind, name in (("namespace", NS), ("clusterrole", "modelcache-agent"),
                           ("mutatingwebhookconfiguration", "modelcache-pod-mutator"),
                           ("validatingwebhookconfiguration", "modelcache-cache-validator")):
            wait_until(lambda kind=kind, name=name: cluster.kubectl("get", kind, name, check=False).returncode != 0,
                       timeout=300, what=f"{kind}/{name} deleted")
        assert cluster.kubectl("get", "crd", "localmodelcaches.serving.kserve.io", check=False).returncode == 0
        assert cluster.kubectl("get", "localmodelcache", "llm", check=False).returncode == 0
        assert helm("list", "-A", "-q", kubeconfig=kube).stdout.strip() == ""
        for node in ("node-1", "node-2"):
            models = cluster.node(node).host_path("/models") / "models"
            assert [p for p in models.iterdir() if p.is_dir()], f"{node}: the model left the disk"
    finally:
        server.stop()
