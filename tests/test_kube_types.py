"""Typed CRD objects: exact KServe field names, round-trips that keep unknown keys."""

from __future__ import annotations

import copy

import pytest

from modelcache.kube import types as t

CACHE = {
    "apiVersion": "serving.kserve.io/v1alpha1",
    "kind": "LocalModelCache",
    "metadata": {"name": "llama3-8b", "resourceVersion": "7", "generation": 2},
    "spec": {
        "sourceModelUri": "hf://meta-llama/meta-llama-3-8b",
        "modelSize": "16Gi",
        "nodeGroups": ["gpu-a100", "gpu-h100"],
        "serviceAccountName": "hf-sa",
        "storage": {"key": "localhf", "parameters": {"type": "hf"}},
    },
    "status": {
        "nodeStatus": {"node-a": "NodeDownloaded", "node-b": "NodeDownloadError", "node-c": ""},
        "copies": {"available": 1, "total": 3, "failed": 1},
        "inferenceServices": [{"namespace": "team", "name": "chat"}],
    },
}

NODE = {
    "apiVersion": "serving.kserve.io/v1alpha1",
    "kind": "LocalModelNode",
    "metadata": {"name": "node-a"},
    "spec": {
        "localModels": [
            {"modelName": "llama3-8b", "sourceModelUri": "hf://meta-llama/meta-llama-3-8b", "nodeGroup": "gpu-a100"},
            {"modelName": "bert", "sourceModelUri": "s3://models/bert/", "namespace": "team",
             "serviceAccountName": "s3"},
        ]
    },
    "status": {
        "modelStatus": {"llama3-8b": "ModelDownloading", "team/bert": "ModelDownloaded"},
        "modelDetails": {
            "llama3-8b": {"state": "ModelDownloading", "bytesDone": 1024, "bytesTotal": 4096, "rate": 512,
                          "startedAt": "2026-11-30T00:00:00Z", "resolvedRevision": "abc123"},
        },
        "capacity": {"totalBytes": 10, "freeBytes": 4, "free": "4"},
        "futureField": {"x": 1},
    },
}

GROUP = {
    "apiVersion": "serving.kserve.io/v1alpha1",
    "kind": "LocalModelNodeGroup",
    "metadata": {"name": "gpu-a100"},
    "spec": {
        "storageLimit": "1.7T",
        "persistentVolumeSpec": {
            "accessModes": ["ReadWriteOnce"], "capacity": {"storage": "1700G"}, "local": {"path": "/models"},
            "nodeAffinity": {"required": {"nodeSelectorTerms": [
                {"matchExpressions": [{"key": "gpu", "operator": "In", "values": ["a100"]}]}]}},
        },
        "persistentVolumeClaimSpec": {
            "accessModes": ["ReadWriteOnce"], "resources": {"requests": {"storage": "1700G"}},
        },
    },
}

CONTAINER = {
    "apiVersion": "serving.kserve.io/v1alpha1",
    "kind": "ClusterStorageContainer",
    "metadata": {"name": "default"},
    "spec": {
        "container": {"name": "storage-initializer", "image": "kserve/storage-initializer:latest"},
        "supportedUriFormats": [{"prefix": "gs://"}, {"regex": "https?://(.+)/(.+)"}],
        "supportsMultiModelDownload": True,
    },
    "disabled": False,
}


@pytest.mark.parametrize("raw", [CACHE, NODE, GROUP, CONTAINER], ids=lambda r: r["kind"])
def test_round_trip_is_exact(raw: dict) -> None:
    before = copy.deepcopy(raw)
    obj = t.from_object(raw)
    assert obj.to_dict() == raw
    assert raw == before  # decoding never mutates the input


def test_cache_fields_are_typed() -> None:
    cache = t.LocalModelCache.from_dict(CACHE)
    assert cache.name == "llama3-8b" and cache.generation == 2 and cache.resource_version == "7"
    assert cache.spec.source_model_uri == "hf://meta-llama/meta-llama-3-8b"
    assert cache.spec.node_groups[0] == "gpu-a100"
    assert cache.spec.storage is not None and cache.spec.storage.parameters == {"type": "hf"}
    assert cache.status.copies == t.ModelCopies(available=1, total=3, failed=1)
    assert cache.status.inference_services == [t.NamespacedName("team", "chat")]
    assert cache.status.node_status["node-b"] == t.NODE_DOWNLOAD_ERROR
    assert cache.status_key == "llama3-8b"


def test_namespace_cache_status_key_and_kind() -> None:
    raw = {**copy.deepcopy(CACHE), "kind": "LocalModelNamespaceCache"}
    raw["metadata"]["namespace"] = "team"
    cache = t.from_object(raw)
    assert isinstance(cache, t.LocalModelNamespaceCache)
    assert cache.status_key == "team/llama3-8b"
    assert cache.FINALIZER == "localmodelnamespacecache.kserve.io/finalizer"
    assert cache.to_dict()["kind"] == "LocalModelNamespaceCache"


def test_node_entries_status_keys_and_details() -> None:
    node = t.LocalModelNode.from_dict(NODE)
    assert [m.status_key for m in node.spec.local_models] == ["llama3-8b", "team/bert"]
    assert node.find("bert", "team") is node.spec.local_models[1]
    assert node.find("bert") is None
    detail = node.status.model_details["llama3-8b"]
    assert (detail.bytes_done, detail.bytes_total, detail.rate) == (1024, 4096, 512)
    assert node.status.extra == {"futureField": {"x": 1}}
    counts = t.ModelCounts.of(node.status.model_status)
    assert (counts.downloading, counts.downloaded, counts.total) == (1, 1, 2)


def test_building_objects_uses_kserve_names() -> None:
    node = t.LocalModelNode(metadata={"name": "n1"})
    node.spec.local_models.append(t.LocalModelInfo(model_name="m", source_model_uri="gs://b/m", node_group="g"))
    node.status.model_status["m"] = t.MODEL_DOWNLOAD_PENDING
    node.status.model_details["m"] = t.ModelDetail(state=t.MODEL_DOWNLOAD_PENDING, bytes_total=0)
    assert node.to_dict() == {
        "apiVersion": "serving.kserve.io/v1alpha1",
        "kind": "LocalModelNode",
        "metadata": {"name": "n1"},
        "spec": {"localModels": [{"modelName": "m", "sourceModelUri": "gs://b/m", "nodeGroup": "g"}]},
        "status": {
            "modelStatus": {"m": "ModelDownloadPending"},
            "modelDetails": {"m": {"state": "ModelDownloadPending", "bytesTotal": 0}},
        },
    }
    # An empty spec still carries its required list; an empty status is left out.
    assert t.LocalModelNode(metadata={"name": "n2"}).to_dict()["spec"] == {"localModels": []}
    assert "status" not in t.LocalModelNode(metadata={"name": "n2"}).to_dict()


def test_group_membership_terms_and_container_defaults() -> None:
    group = t.LocalModelNodeGroup.from_dict(GROUP)
    assert group.spec.node_selector_terms[0]["matchExpressions"][0]["values"] == ["a100"]
    assert t.LocalModelNodeGroup(metadata={"name": "x"}).spec.node_selector_terms == []
    csc = t.ClusterStorageContainer.from_dict(CONTAINER)
    assert csc.spec.effective_workload_type == t.WORKLOAD_INIT_CONTAINER
    assert csc.spec.supported_uri_formats[1].regex == "https?://(.+)/(.+)"
    assert csc.disabled is False


def test_enums_are_kserve_spellings() -> None:
    assert t.MODEL_STATES == ("", "ModelDownloadPending", "ModelDownloading", "ModelDownloaded", "ModelDownloadError")
    assert t.NODE_STATES == (
        "", "NodeNotReady", "NodeDownloadPending", "NodeDownloading", "NodeDownloaded", "NodeDownloadError",
    )
    assert t.NODE_STATE_FOR_MODEL_STATE[t.MODEL_DOWNLOADED] == t.NODE_DOWNLOADED
    assert t.status_key("m", "ns") == "ns/m" and t.status_key("m") == "m"
