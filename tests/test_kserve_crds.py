"""KServe's own LocalModel* CRDs applied over ours, and ours applied back, on the real API server.

A user switching between KServe's local model cache and modelcache (or upgrading a KServe install
that still carries its CRDs) replaces one schema by the other under live objects. KServe's CRDs
are read from its module in the Go module cache (the release tests/kserve/go.mod pins) and
applied as KServe's install does (`kubectl apply --server-side`); ours as deploy/ is applied. The
agent and the coordinator keep running across both switches. What KServe's schema loses (it
prunes the status fields and printer columns only we have) is listed in docs/kserve-compat.md.
"""

from __future__ import annotations

import time
from pathlib import Path
from typing import Any

import pytest
import yaml

from modelcache.kube.client import LOCAL_MODEL_CACHES, LOCAL_MODEL_NODES, Kube
from modelcache.sources.uri import storage_key
from tests.agent_util import create_node, entry, model_files, start_agent, wait_states
from tests.coordinator_util import entries_of, make_cache, make_group
from tests.fixtures.cluster import Cluster
from tests.helpers import REPO, wait_until
from tests.kserve import controller as kserve

pytestmark = pytest.mark.timeout(300)

D = "ModelDownloaded"
KSERVE_CRDS = (kserve.LOCALMODEL_CRDS, "config/crd/full/clusterstoragecontainer")
#: Status fields of ours that KServe's schema does not have (pruned while it is installed).
OUR_NODE_STATUS = {"modelDetails", "capacity", "modelCounts", "observedGeneration", "lastUpdated"}


def crd(cluster: Cluster, plural: str) -> dict[str, Any]:
    out = cluster.kubectl("get", "crd", f"{plural}.serving.kserve.io", "-o", "json").stdout
    return dict(yaml.safe_load(out))


def status_fields(cluster: Cluster, plural: str) -> set[str]:
    (version,) = crd(cluster, plural)["spec"]["versions"]
    return set(version["schema"]["openAPIV3Schema"]["properties"]["status"].get("properties") or {})


def columns(cluster: Cluster, plural: str) -> list[str]:
    (version,) = crd(cluster, plural)["spec"]["versions"]
    return [c["name"] for c in version.get("additionalPrinterColumns") or []]


def apply_files(cluster: Cluster, *paths: Path) -> None:
    """`kubectl apply --server-side` of the CRD files, as each project's install instructions say."""
    files = [f for p in paths for f in (sorted(p.glob("serving.kserve.io_*.yaml")) if p.is_dir() else [p])]
    cluster.kubectl("apply", "--server-side", *(a for f in files for a in ("-f", str(f))))
    cluster.kubectl("wait", "--for", "condition=Established", "--timeout", "60s", "crd", "--all")


def node_status(kube: Kube) -> dict[str, Any]:
    return dict(kube.get(LOCAL_MODEL_NODES, "n1").get("status") or {})


def cache_status(kube: Kube, name: str) -> dict[str, Any]:
    return dict(kube.get(LOCAL_MODEL_CACHES, name).get("status") or {})


def test_kserve_crds_over_ours_and_back_keep_agent_and_coordinator_working(
    cluster: Cluster, coordinator_factory: Any, nginx: Any, tmp_path: Path
) -> None:
    kube = cluster.kube()
    cluster.register_node("n1", {"kserve/localmodel": "worker"})
    make_group(kube, "workers")
    uris = {}
    for name in ("a", "b", "c"):
        nginx.write(f"{name}/model.bin", 1 << 20)
        uris[name] = nginx.url(f"{name}/model.bin")
    root = tmp_path / "root"
    coordinator_factory(cluster)
    agent = start_agent(cluster.agent_kubeconfig, "n1", root, tmp_path)
    try:
        # Our CRDs (the baseline): our status fields and columns are kept.
        make_cache(kube, "a", uris["a"], ["workers"])
        wait_states(kube, "n1", {"a": D}, agent=agent)
        wait_until(lambda: node_status(kube).keys() >= OUR_NODE_STATUS, timeout=30, what="our LMN status fields")
        wait_until(lambda: "conditions" in cache_status(kube, "a"), timeout=30, what="cache conditions")
        assert "Downloaded" in columns(cluster, "localmodelnodes")

        # KServe's CRDs replace ours: same group, kinds and versions, so every object stays and is
        # served; the status fields only we have are pruned from what the API server returns.
        apply_files(cluster, *(kserve.kserve_source() / p for p in KSERVE_CRDS))
        assert status_fields(cluster, "localmodelnodes") == {"modelStatus"}
        assert columns(cluster, "localmodelnodes") == [] and columns(cluster, "localmodelcaches") == []
        assert "conditions" not in status_fields(cluster, "localmodelcaches")
        wait_until(lambda: not (OUR_NODE_STATUS & node_status(kube).keys()), timeout=30,
                   what="our LMN status fields pruned")
        assert node_status(kube)["modelStatus"] == {"a": D}
        assert cache_status(kube, "a")["nodeStatus"] == {"n1": "NodeDownloaded"}

        # ... and both keep working under KServe's schema: a new cache is placed and downloaded, its
        # status aggregated; a deleted one is taken off the node and its finalizer released.
        make_cache(kube, "b", uris["b"], ["workers"])
        wait_states(kube, "n1", {"a": D, "b": D}, agent=agent)
        wait_until(lambda: cache_status(kube, "b").get("nodeStatus") == {"n1": "NodeDownloaded"}, timeout=60,
                   what="cache b status under KServe's schema")
        assert cache_status(kube, "b")["copies"] == {"available": 1, "total": 1, "failed": 0}
        assert model_files(root, storage_key(uris["b"])) == {"model.bin": 1 << 20}
        assert not (OUR_NODE_STATUS & node_status(kube).keys())
        kube.delete(LOCAL_MODEL_CACHES, "a")
        wait_until(lambda: kube.get_or_none(LOCAL_MODEL_CACHES, "a") is None, timeout=60, what="cache a deleted")
        assert [e["modelName"] for e in entries_of(kube, "n1") or []] == ["b"]
        wait_until(lambda: "a" not in (node_status(kube).get("modelStatus") or {}), timeout=30,
                   what="model a dropped from the node's status")

        # Ours back (deploy/crds as `kubectl apply --server-side -k deploy/` applies them): the agent
        # and the coordinator write their fields again, and a third cache works as before.
        apply_files(cluster, REPO / "deploy" / "crds")
        assert OUR_NODE_STATUS - {"lastUpdated"} <= status_fields(cluster, "localmodelnodes")
        assert "Downloaded" in columns(cluster, "localmodelnodes")
        wait_until(lambda: node_status(kube).keys() >= OUR_NODE_STATUS, timeout=30,
                   what="our LMN status fields written again")
        make_cache(kube, "c", uris["c"], ["workers"])
        wait_states(kube, "n1", {"b": D, "c": D}, agent=agent)
        details = node_status(kube)["modelDetails"]
        assert details["c"]["state"] == D and details["c"]["storageKey"] == storage_key(uris["c"])
        wait_until(lambda: "conditions" in cache_status(kube, "c") and "conditions" in cache_status(kube, "b"),
                   timeout=60, what="cache conditions written again")
    finally:
        agent.stop()


def status_patches(cluster: Cluster) -> float:
    """The API server's own count of PATCHes to LocalModelNode status (its /metrics): a write the
    schema prunes to nothing changes no resourceVersion, so only the requests show it."""
    text = cluster.kubectl("get", "--raw", "/metrics").stdout
    total = 0.0
    for line in text.splitlines():
        if line.startswith("apiserver_request_total{") and 'resource="localmodelnodes"' in line \
                and 'subresource="status"' in line and 'verb="PATCH"' in line:
            total += float(line.rsplit(" ", 1)[1])
    return total


def test_at_rest_under_kserve_crds_the_agent_writes_no_status(cluster: Cluster, nginx: Any, own_fs: Path,
                                                              tmp_path: Path) -> None:
    """KServe's schema prunes what the agent writes beyond modelStatus (nodeUID, modelDetails, ...),
    so its status never reads back as written: the agent must still write nothing at rest (it
    remembers what the server kept of its last write), and write its fields again when our CRDs
    return."""
    kube = cluster.kube()
    cluster.register_node("n1", {"kserve/localmodel": "worker"})
    nginx.write("m/model.bin", 1 << 20)
    apply_files(cluster, *(kserve.kserve_source() / p for p in KSERVE_CRDS))
    create_node(kube, "n1", [entry("m", nginx.url("m/model.bin"))])
    # On a file system of its own: free bytes moved by other work on a shared disk are a real
    # change the agent writes (tests/fixtures/filesystems.py), not the rest this test counts.
    root = own_fs / "root"
    agent = start_agent(cluster.agent_kubeconfig, "n1", root, tmp_path)  # --status-interval 0.5
    try:
        wait_states(kube, "n1", {"m": D}, agent=agent)
        time.sleep(2)  # the last progress write settles
        before, rv = status_patches(cluster), kube.get(LOCAL_MODEL_NODES, "n1")["metadata"]["resourceVersion"]
        time.sleep(6)  # 12 status intervals at rest
        assert status_patches(cluster) - before == 0, agent.log()[-2000:]
        assert kube.get(LOCAL_MODEL_NODES, "n1")["metadata"]["resourceVersion"] == rv
        assert node_status(kube) == {"modelStatus": {"m": D}}

        # Ours back: the agent writes its fields again at once (it watches the CRD's schema), then
        # rests again.
        apply_files(cluster, REPO / "deploy" / "crds")
        wait_until(lambda: node_status(kube).keys() >= OUR_NODE_STATUS | {"nodeUID"}, timeout=30,
                   what="our LMN status fields written again")
        time.sleep(2)
        before = status_patches(cluster)
        time.sleep(6)
        assert status_patches(cluster) - before == 0, agent.log()[-2000:]
    finally:
        agent.stop()
