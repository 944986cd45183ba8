"""What the coordinator and agent cost the API server and keep in memory, on the real control plane:
informers stream their lists from the watch cache (no etcd read, one object at a time), keep only
the fields they read (Nodes: name, labels, Ready; no managedFields anywhere), and the agent's pod
list is served from the watch cache too."""

from __future__ import annotations

from typing import Any

import pytest

from agent.hostpath import RootPaths
from agent.inuse import KubeMountChecker
from coordinator.view import node_essentials
from modelcache.kube.client import LOCAL_MODEL_NODES, NODES, Kube
from modelcache.kube.informer import Informer
from tests.coordinator_util import make_node
from tests.fixtures.cluster import Cluster

pytestmark = pytest.mark.timeout(120)


def recording(kube: Kube) -> list[tuple[str, str]]:
    """(method, url) of every request ``kube`` sends from now on."""
    seen: list[tuple[str, str]] = []
    pool = kube.api_client.rest_client.pool_manager
    send = pool.request

    def request(method: str, url: str, *args: Any, **kwargs: Any) -> Any:
        seen.append((method, url))
        return send(method, url, *args, **kwargs)

    pool.request = request
    return seen


def gpu_node(kube: Kube, name: str) -> None:
    make_node(kube, name, **{"kserve/localmodel": "worker"})
    images = [{"names": [f"registry.example.com/runtime-{i}:v1"], "sizeBytes": 10**9} for i in range(50)]
    kube.patch_status(NODES, name, {"status": {"images": images, "capacity": {"nvidia.com/gpu": "8"}}})


def test_nodes_are_streamed_from_the_watch_cache_and_kept_as_name_labels_and_readiness(cluster: Cluster) -> None:
    admin = cluster.kube()
    for n in range(3):
        gpu_node(admin, f"gpu-{n}")
    kube = cluster.kube(cluster.coordinator_kubeconfig)
    seen = recording(kube)
    inf = Informer(kube, NODES, transform=node_essentials, watch_timeout=30).start()
    try:
        assert inf.wait_for_sync(30)
        assert inf.streaming is True
        first = seen[0][1]
        for param in ("watch=true", "sendInitialEvents=true", "resourceVersionMatch=NotOlderThan"):
            assert param in first
        assert not [url for _, url in seen if "watch=" not in url], "no plain list (an etcd read before v1.31)"
        node = inf.store.get_raw("gpu-1")
        assert node is not None
        assert set(node["metadata"]) <= {"name", "uid", "resourceVersion", "labels", "deletionTimestamp"}
        assert node["metadata"]["labels"]["kserve/localmodel"] == "worker"
        assert node["status"] == {"conditions": [{"type": "Ready", "status": "True"}]}
    finally:
        inf.stop()


def test_informers_drop_managed_fields(cluster: Cluster) -> None:
    admin = cluster.kube()
    admin.create(LOCAL_MODEL_NODES, {"metadata": {"name": "n1"}, "spec": {"localModels": []}})
    assert admin.get(LOCAL_MODEL_NODES, "n1")["metadata"].get("managedFields")  # the server keeps them
    inf = Informer(admin, LOCAL_MODEL_NODES, watch_timeout=30).start()
    try:
        assert inf.wait_for_sync(30)
        assert "managedFields" not in (inf.store.get_raw("n1") or {})["metadata"]
    finally:
        inf.stop()


def test_the_agents_pod_list_is_served_from_the_watch_cache(cluster: Cluster) -> None:
    kube = cluster.kube(cluster.agent_kubeconfig)
    seen = recording(kube)
    assert KubeMountChecker(kube, "node-a", RootPaths("/models")).users(["0123456789abcdef"]) == {}
    (url,) = [u for _, u in seen if "/pods" in u]
    assert "resourceVersion=0" in url and "fieldSelector=spec.nodeName%3Dnode-a" in url
