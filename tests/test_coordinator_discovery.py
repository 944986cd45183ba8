"""Service CRDs installed after the coordinator started are noticed and tracked without a restart."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import yaml
from kubernetes import client

from coordinator.view import llm_resource
from modelcache.kube.client import (
    INFERENCE_SERVICES,
    LOCAL_MODEL_CACHES,
    PERSISTENT_VOLUME_CLAIMS,
    Kube,
    load_api_client,
)
from tests.coordinator_util import (
    make_cache,
    make_group,
    make_isvc,
    make_namespace,
    make_node,
    register_webhooks,
    without_service_crds,
)
from tests.fixtures.cluster import Cluster
from tests.helpers import REPO, wait_until
from tests.test_coordinator_llmisvc import llm_crd
from tests.test_coordinator_webhooks import review

LABEL = "internal.serving.kserve.io/localmodel"


def test_service_crds_installed_later_are_tracked_without_restart(cluster: Cluster, coordinator_factory: Any,
                                                                  tmp_path: Path) -> None:
    without_service_crds(cluster)  # KServe's service CRDs not installed yet
    kube = Kube(load_api_client(str(cluster.kubeconfig)))
    make_namespace(kube, "team")
    make_node(kube, "n1", **{"kserve/localmodel": "worker"})
    make_group(kube, "workers")
    make_cache(kube, "llm", "s3://models/llm", ["workers"])
    c = coordinator_factory(cluster, discovery_interval=0.5)
    register_webhooks(cluster, c)
    assert c.view.isvcs is None and c.view.llmisvcs is None
    wait_until(lambda: (kube.get(LOCAL_MODEL_CACHES, "llm").get("status") or {}).get("copies") is not None,
               timeout=30, what="cache reconciled before the CRDs exist")
    old = kube.get(LOCAL_MODEL_CACHES, "llm")
    delete = {"operation": "DELETE", "name": "llm", "oldObject": old}
    assert review(c, "/validate-localmodelcaches", delete)["allowed"]  # no service kinds: nothing uses it

    ext = client.ApiextensionsV1Api(cluster.api_client())
    isvc_crd = yaml.safe_load((REPO / "tests" / "cluster" / "crds" /
                               "serving.kserve.io_inferenceservices.yaml").read_text())
    ext.create_custom_resource_definition(isvc_crd)
    ext.create_custom_resource_definition(llm_crd("v1alpha2"))
    wait_until(lambda: c.view.isvcs is not None and c.view.llmisvcs is not None, timeout=30,
               what="service kinds discovered")
    assert c.view.llm_resource is not None and c.view.llm_resource.version == "v1alpha2"

    make_isvc(kube, "svc", "team", "s3://models/llm/v1")
    llm = llm_resource("v1alpha2")
    kube.create(llm, {"metadata": {"name": "chat", "namespace": "team"},
                      "spec": {"model": {"uri": "s3://models/llm", "name": "llm"}}}, "team")
    # Labelled at admission (the API server calls /mutate-services for the kinds installed later),
    # listed by the cache controller through informers that did not exist at start.
    wait_until(lambda: (kube.get(INFERENCE_SERVICES, "svc", "team")["metadata"].get("labels") or {}).get(LABEL)
               == "llm", timeout=30, what="ISVC labelled")
    wait_until(lambda: (kube.get(llm, "chat", "team")["metadata"].get("labels") or {}).get(LABEL) == "llm",
               timeout=30, what="LLMISVC labelled")

    def listed() -> bool:
        st = kube.get(LOCAL_MODEL_CACHES, "llm").get("status") or {}
        return st.get("inferenceServices") == [{"namespace": "team", "name": "svc"}] and \
            st.get("llmInferenceServices") == [{"namespace": "team", "name": "chat"}]

    wait_until(listed, timeout=30, what="services listed in the cache status")
    wait_until(lambda: kube.get_or_none(PERSISTENT_VOLUME_CLAIMS, "llm-workers", "team") is not None, timeout=30,
               what="serving PVC")
    # The validating webhook's lookups see the new kinds too: the cache is in use now.
    wait_until(lambda: not review(c, "/validate-localmodelcaches", delete)["allowed"], timeout=30,
               what="cache delete denied while services use it")
    assert review(c, "/validate-localmodelcaches", delete)["status"]["message"].startswith(
        "LocalModelCache llm is being used by ")
