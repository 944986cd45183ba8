"""Our node agent under KServe's own local-model controller (half of a switch: KServe's node agent
replaced, its controller kept), on the real control plane with KServe's LocalModel* CRDs.

KServe's controller (cmd/localmodel, built by tests/kserve) writes the LocalModelNode specs from
the caches and aggregates the agents' reports into the cache status; our agent, as deploy/'s
ServiceAccount, downloads what the spec lists, reports KServe's states and removes what leaves
the spec. No KServe download Job is involved: that is what KServe's node agent would create.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest

from modelcache.kube.client import LOCAL_MODEL_CACHES, LOCAL_MODEL_NODES, Kube
from modelcache.sources.uri import storage_key
from tests.agent_util import model_files, start_agent, wait_states
from tests.coordinator_util import make_cache, make_group
from tests.fixtures.cluster import Cluster
from tests.helpers import wait_until
from tests.kserve import controller as kserve

pytestmark = pytest.mark.timeout(300)


@pytest.fixture
def kserve_local_model(cluster: Cluster, tmp_path: Path) -> Any:
    kserve.require_binary(kserve.LOCAL_MODEL)
    crds = kserve.docs_of(kserve.LOCALMODEL_CRDS)
    kserve.apply(cluster, crds)  # a KServe install's CRDs (the reset puts ours back)
    kserve.wait_established(cluster, crds)
    kserve.install(cluster, components=(kserve.LOCAL_MODEL,))
    proc = kserve.start(cluster, tmp_path / "kserve", kserve.LOCAL_MODEL)
    yield proc
    proc.stop()


def cache_status(kube: Kube, name: str) -> dict[str, Any]:
    return dict((kube.get_or_none(LOCAL_MODEL_CACHES, name) or {}).get("status") or {})


def test_our_agent_downloads_what_kserves_controller_assigns_and_kserve_counts_the_copy(
    cluster: Cluster, kserve_local_model: Any, nginx: Any, tmp_path: Path
) -> None:
    kube = cluster.kube()
    cluster.register_node("n1", {"kserve/localmodel": "worker"})
    make_group(kube, "workers")
    nginx.write("iris/model.joblib", 2 << 20)
    uri = nginx.url("iris/model.joblib")
    root = tmp_path / "root"
    agent = start_agent(cluster.agent_kubeconfig, "n1", root, tmp_path)
    try:
        make_cache(kube, "iris", uri, ["workers"])  # through KServe's cache validator
        try:
            wait_until(lambda: kube.get_or_none(LOCAL_MODEL_NODES, "n1") is not None, timeout=60,
                       what="LocalModelNode n1 written by KServe's controller")
        except TimeoutError as exc:
            raise AssertionError(f"{exc}\nKServe's log:\n{kserve_local_model.log()[-4000:]}") from None
        (entry,) = kube.get(LOCAL_MODEL_NODES, "n1")["spec"]["localModels"]
        assert entry["modelName"] == "iris" and entry["sourceModelUri"] == uri

        wait_states(kube, "n1", {"iris": "ModelDownloaded"}, agent=agent)
        assert model_files(root, storage_key(uri)) == {"model.joblib": 2 << 20}
        try:
            wait_until(lambda: cache_status(kube, "iris").get("nodeStatus") == {"n1": "NodeDownloaded"}, timeout=60,
                       what="KServe's cache status: downloaded on n1")
        except TimeoutError as exc:
            raise AssertionError(f"{exc}; status: {cache_status(kube, 'iris')}\nKServe's log:\n"
                                 f"{kserve_local_model.log()[-4000:]}") from None
        assert cache_status(kube, "iris")["copies"]["available"] == 1

        # The cache deleted: KServe's controller takes the model off the node, our agent removes it.
        kube.delete(LOCAL_MODEL_CACHES, "iris")
        wait_until(lambda: kube.get_or_none(LOCAL_MODEL_CACHES, "iris") is None, timeout=60,
                   what="cache deleted (KServe's finalizer released)")
        wait_until(lambda: not (root / "models" / storage_key(uri)).exists(), timeout=60,
                   what="model removed from the node by our agent")
        wait_until(lambda: "iris" not in ((kube.get(LOCAL_MODEL_NODES, "n1").get("status") or {}).get(
            "modelStatus") or {}), timeout=30, what="model dropped from the node's status")
    finally:
        agent.stop()
    assert kserve_local_model.alive(), kserve_local_model.log()[-3000:]
