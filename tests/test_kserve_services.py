"""Service labels with KServe's own controller (built from its module, tests/kserve) beside ours:
set at admission only, so a running service is never rolled out by a cache appearing; and with
KServe's ``localModel.enabled: false`` (its shipped default, whose defaulter strips the cache label
from every service it admits) our defaulter, called after KServe's, still labels it."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest

from modelcache.kube.client import INFERENCE_SERVICES, LOCAL_MODEL_CACHES
from modelcache.kube.migrate import DEPLOYMENTS
from tests.coordinator_util import make_cache, make_group, make_namespace, register_webhooks
from tests.fixtures.cluster import Cluster
from tests.helpers import wait_until
from tests.kserve import controller as kserve

pytestmark = pytest.mark.timeout(300)
NS = "team"
LABEL = "internal.serving.kserve.io/localmodel"


def _isvc(cluster: Cluster, name: str, uri: str) -> None:
    cluster.kubectl("apply", "-f", "-", input=(
        f"apiVersion: serving.kserve.io/v1beta1\nkind: InferenceService\nmetadata: {{name: {name}, namespace: {NS}}}\n"
        f"spec: {{predictor: {{model: {{modelFormat: {{name: sklearn}}, storageUri: '{uri}'}}}}}}\n"))


def test_labels_at_admission_with_local_model_disabled_and_no_rollout_later(
    cluster: Cluster, coordinator_factory: Any, tmp_path: Path
) -> None:
    kserve.require_binary()
    kserve.install(cluster, local_model=False)
    mgr = kserve.start(cluster, tmp_path / "kserve")
    try:
        kube = cluster.kube()
        cluster.register_node("n1", {"kserve/localmodel": "worker"})
        make_group(kube, "workers")
        make_namespace(kube, NS)
        coord = coordinator_factory(cluster)
        register_webhooks(cluster, coord)
        make_cache(kube, "iris", "s3://models/iris", ["workers"])

        _isvc(cluster, "iris", "s3://models/iris")  # KServe's defaulter strips, ours (after it) labels
        assert kube.get(INFERENCE_SERVICES, "iris", NS)["metadata"]["labels"][LABEL] == "iris"

        _isvc(cluster, "early", "s3://models/early")  # no cache yet: not labelled
        wait_until(lambda: kube.get_or_none(DEPLOYMENTS, "early-predictor", NS) is not None, timeout=120,
                   what="KServe's predictor Deployment of the running service")
        deployment = kube.get(DEPLOYMENTS, "early-predictor", NS)
        make_cache(kube, "early", "s3://models/early", ["workers"])
        wait_until(lambda: (kube.get(LOCAL_MODEL_CACHES, "early").get("status") or {}).get("copies") is not None,
                   timeout=30, what="the new cache reconciled")
        # The running service and its Deployment are untouched: no new pod template, no rollout.
        assert LABEL not in (kube.get(INFERENCE_SERVICES, "early", NS)["metadata"].get("labels") or {})
        now = kube.get(DEPLOYMENTS, "early-predictor", NS)
        assert now["metadata"]["generation"] == deployment["metadata"]["generation"]
        assert now["spec"]["template"] == deployment["spec"]["template"]
    finally:
        mgr.stop()
