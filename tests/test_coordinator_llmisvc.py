"""LLMInferenceServices: found at whichever version the cluster serves, matched on spec.model.uri."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import yaml

from coordinator.view import llm_resource
from modelcache.kube.client import LOCAL_MODEL_CACHES, PERSISTENT_VOLUME_CLAIMS, Kube, load_api_client
from tests.coordinator_util import make_cache, make_group, make_namespace, make_node, register_webhooks
from tests.fixtures.cluster import Cluster
from tests.helpers import wait_until


def llm_crd(version: str) -> dict[str, Any]:
    return {"apiVersion": "apiextensions.k8s.io/v1", "kind": "CustomResourceDefinition",
            "metadata": {"name": "llminferenceservices.serving.kserve.io"},
            "spec": {"group": "serving.kserve.io", "scope": "Namespaced",
                     "names": {"kind": "LLMInferenceService", "listKind": "LLMInferenceServiceList",
                               "plural": "llminferenceservices", "singular": "llminferenceservice"},
                     "versions": [{"name": version, "served": True, "storage": True, "subresources": {"status": {}},
                                   "schema": {"openAPIV3Schema": {"type": "object",
                                                                  "x-kubernetes-preserve-unknown-fields": True}}}]}}


def test_llm_services_listed_and_given_volumes(cluster: Cluster, coordinator_factory: Any, tmp_path: Path) -> None:
    crd = tmp_path / "llmisvc.yaml"
    crd.write_text(yaml.safe_dump(llm_crd("v1alpha1")))
    cluster.kubectl("apply", "-f", str(crd))
    cluster.kubectl("wait", "--for", "condition=Established", "crd/llminferenceservices.serving.kserve.io")
    kube = Kube(load_api_client(str(cluster.kubeconfig)))
    make_namespace(kube, "llm")
    make_node(kube, "n1", **{"kserve/localmodel": "worker"})
    make_group(kube, "workers")
    c = coordinator_factory(cluster)
    register_webhooks(cluster, c)  # labelled at admission, as KServe's LLMISVC defaulter does
    assert c.view.llm_resource is not None and c.view.llm_resource.version == "v1alpha1"
    res = llm_resource("v1alpha1")
    make_cache(kube, "qwen", "hf://Qwen/Qwen2-0.5B", ["workers"])
    kube.create(res, {"metadata": {"name": "chat", "namespace": "llm"},
                      "spec": {"model": {"uri": "hf://Qwen/Qwen2-0.5B", "name": "qwen"}}}, "llm")
    wait_until(lambda: (kube.get(res, "chat", "llm")["metadata"].get("labels") or {})
               .get("internal.serving.kserve.io/localmodel") == "qwen", timeout=30, what="LLMISVC labelled")
    wait_until(lambda: (kube.get(LOCAL_MODEL_CACHES, "qwen").get("status") or {}).get("llmInferenceServices")
               == [{"namespace": "llm", "name": "chat"}], timeout=30, what="listed in llmInferenceServices")
    assert "inferenceServices" not in kube.get(LOCAL_MODEL_CACHES, "qwen")["status"]
    wait_until(lambda: kube.get_or_none(PERSISTENT_VOLUME_CLAIMS, "qwen-workers", "llm") is not None, timeout=30,
               what="serving PVC for the LLM service")
