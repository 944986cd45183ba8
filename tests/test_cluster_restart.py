"""An API server restart in the middle of the work: the agent (a process, as its ServiceAccount) and
the coordinator (as its ServiceAccount) lose every watch and connection and carry on."""

from __future__ import annotations

from typing import Any

import pytest

from modelcache.kube.client import LOCAL_MODEL_CACHES, NODES
from modelcache.sources.uri import storage_key
from tests.agent_util import model_files, node_status, start_agent
from tests.coordinator_util import make_cache, make_group, make_node
from tests.fixtures.cluster import Cluster
from tests.helpers import wait_until

pytestmark = pytest.mark.timeout(300)


def test_agent_and_coordinator_survive_an_api_server_restart(cluster: Cluster, coordinator_factory: Any, nginx: Any,
                                                             fault_proxy: Any, tmp_path: Any) -> None:
    kube = cluster.kube()
    make_node(kube, "node-a", **{"kserve/localmodel": "worker"})
    make_group(kube, "workers")
    coordinator_factory(cluster)
    nginx.write("r/model.bin", 4 << 20)
    nginx.write("s/model.bin", 1 << 20)
    fault_proxy.set_rate_limit(500_000)  # ~8 s: the restart lands mid-download
    slow, later = fault_proxy.url("r/model.bin"), nginx.url("s/model.bin")
    make_cache(kube, "slow", slow, ["workers"])
    root = tmp_path / "root"
    agent = start_agent(cluster.agent_kubeconfig, "node-a", root, tmp_path)
    try:
        def under_way() -> bool:
            d = node_status(kube, "node-a").get("modelDetails", {}).get("slow", {})
            return d.get("state") == "ModelDownloading" and (d.get("bytesDone") or 0) > 0

        wait_until(under_way, timeout=60, what="download under way")
        cluster.cp.restart_apiserver()
        fault_proxy.set_rate_limit(None)

        # The download finishes and is reported; the coordinator sees it and labels the node.
        def cache_available(name: str) -> bool:
            copies = (kube.get(LOCAL_MODEL_CACHES, name).get("status") or {}).get("copies") or {}
            return copies.get("available") == 1

        wait_until(lambda: cache_available("slow"), timeout=120, what=f"slow available after the restart\n"
                   f"{agent.log()[-3000:]}")
        assert model_files(root, storage_key(slow)) == {"model.bin": 4 << 20}
        # Both still watch: a cache created after the restart is reconciled, downloaded and reported.
        make_cache(kube, "later", later, ["workers"])
        wait_until(lambda: cache_available("later"), timeout=120, what="a cache created after the restart")
        labels = kube.get(NODES, "node-a")["metadata"]["labels"]
        assert all(labels.get(f"downloaded.modelcache.io/{storage_key(u)}") == "true" for u in (slow, later))
    finally:
        fault_proxy.set_rate_limit(None)
        agent.stop()
