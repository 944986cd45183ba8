"""deploy/crds against KServe v0.20's CRDs (docs/crds.md), fact by fact (group, version, plural, scope,
status subresource, required fields, enums, the sourceModelUri rule), and through the API test
server the contract fields the examples don't carry: ClusterStorageContainer's `disabled`,
`workloadType` default and required fields, the cache status lists, every required field."""

from __future__ import annotations

import copy
from typing import Any

import pytest
import yaml
from kubernetes import client
from kubernetes.client.rest import ApiException

from tests.helpers import REPO
from tests.kube_examples import GROUP, PLURALS, VERSION, api_error, examples

CRDS = REPO / "deploy" / "crds"

# kind -> (scope, has a status subresource), contracts §1 table.
SCOPES = {
    "LocalModelCache": ("Cluster", True),
    "LocalModelNamespaceCache": ("Namespaced", True),
    "LocalModelNode": ("Cluster", True),
    "LocalModelNodeGroup": ("Cluster", False),
    "ClusterStorageContainer": ("Cluster", False),
}
NODE_STATUS = ["", "NodeNotReady", "NodeDownloadPending", "NodeDownloading", "NodeDownloaded", "NodeDownloadError"]
MODEL_STATUS = ["", "ModelDownloadPending", "ModelDownloading", "ModelDownloaded", "ModelDownloadError"]


def _crds() -> dict[str, dict[str, Any]]:
    out = {}
    for path in sorted(CRDS.glob("*.yaml")):
        for doc in yaml.safe_load_all(path.read_text()):
            if doc and doc.get("kind") == "CustomResourceDefinition":
                out[doc["spec"]["names"]["kind"]] = doc
    return out


def _schema(kind: str) -> dict[str, Any]:
    (version,) = _crds()[kind]["spec"]["versions"]
    return version["schema"]["openAPIV3Schema"]


def _at(schema: dict[str, Any], path: str) -> dict[str, Any]:
    """The sub-schema at a dotted path; ``[]`` steps into items, ``{}`` into additionalProperties."""
    node = schema
    for part in path.split("."):
        if part == "[]":
            node = node["items"]
        elif part == "{}":
            node = node["additionalProperties"]
        else:
            node = node["properties"][part]
    return node


@pytest.mark.parametrize("kind", sorted(SCOPES))
def test_names_scope_version_and_subresources(kind: str) -> None:
    crd = _crds()[kind]
    spec = crd["spec"]
    plural = PLURALS[kind]
    assert crd["metadata"]["name"] == f"{plural}.{GROUP}" and spec["group"] == GROUP
    assert spec["names"]["plural"] == plural and spec["names"]["singular"] == kind.lower()
    assert spec["names"]["listKind"] == f"{kind}List"
    scope, has_status = SCOPES[kind]
    assert spec["scope"] == scope
    (version,) = spec["versions"]
    assert (version["name"], version["served"], version["storage"]) == (VERSION, True, True)
    assert ("status" in (version.get("subresources") or {})) is has_status
    # Nothing on top of the object is required: KServe manifests without status must apply.
    assert not version["schema"]["openAPIV3Schema"].get("required")


@pytest.mark.parametrize("kind", ["LocalModelCache", "LocalModelNamespaceCache"])
def test_cache_spec_and_status(kind: str) -> None:
    s = _schema(kind)
    assert sorted(_at(s, "spec")["required"]) == ["modelSize", "nodeGroups", "sourceModelUri"]
    uri = _at(s, "spec.sourceModelUri")
    assert uri["type"] == "string"
    assert uri["x-kubernetes-validations"] == [{"rule": "self == oldSelf", "message": "StorageUri is immutable"}]
    assert _at(s, "spec.modelSize").get("x-kubernetes-int-or-string") is True
    groups = _at(s, "spec.nodeGroups")
    assert groups["type"] == "array" and groups["minItems"] == 1 and groups["items"]["type"] == "string"
    assert _at(s, "spec.serviceAccountName")["type"] == "string"
    assert _at(s, "spec.storage.key")["type"] == "string"
    assert _at(s, "spec.storage.parameters.{}")["type"] == "string"
    assert _at(s, "status.nodeStatus.{}")["enum"] == NODE_STATUS
    assert sorted(_at(s, "status.copies")["properties"]) == ["available", "failed", "total"]
    for field in ("inferenceServices", "llmInferenceServices"):
        assert sorted(_at(s, f"status.{field}.[]")["properties"]) == ["name", "namespace"]


def test_local_model_node() -> None:
    s = _schema("LocalModelNode")
    assert _at(s, "spec")["required"] == ["localModels"]
    entry = _at(s, "spec.localModels.[]")
    assert sorted(entry["required"]) == ["modelName", "sourceModelUri"]
    assert {"namespace", "nodeGroup", "serviceAccountName", "storage"} <= set(entry["properties"])
    assert _at(s, "status.modelStatus.{}")["enum"] == MODEL_STATUS


def test_node_group_and_storage_container() -> None:
    g = _schema("LocalModelNodeGroup")
    assert sorted(_at(g, "spec")["required"]) == ["persistentVolumeClaimSpec", "persistentVolumeSpec", "storageLimit"]
    assert {"used", "available"} <= set(_at(g, "status")["properties"])
    c = _schema("ClusterStorageContainer")
    assert _at(c, "disabled")["type"] == "boolean"  # top level, not in spec
    assert sorted(_at(c, "spec")["required"]) == ["container", "supportedUriFormats"]
    assert sorted(_at(c, "spec.supportedUriFormats.[]")["properties"]) == ["prefix", "regex"]
    assert _at(c, "spec.workloadType")["default"] == "initContainer"
    assert _at(c, "spec.supportsMultiModelDownload")["type"] == "boolean"
    assert _at(c, "spec.supportsMultiModelDownload")["default"] is False  # KServe dereferences it


# -- through the API test server -------------------------------------------------------------


@pytest.fixture
def crd_api(cluster):
    with cluster.api_client() as api_client:
        yield client.CustomObjectsApi(api_client)


def _create(api: client.CustomObjectsApi, obj: dict[str, Any]) -> dict[str, Any]:
    plural = PLURALS[obj["kind"]]
    if obj["kind"] == "LocalModelNamespaceCache":
        return api.create_namespaced_custom_object(GROUP, VERSION, obj["metadata"]["namespace"], plural, obj)
    return api.create_cluster_custom_object(GROUP, VERSION, plural, obj)


def _rejected(api: client.CustomObjectsApi, obj: dict[str, Any]) -> str:
    with pytest.raises(ApiException) as err:
        _create(api, obj)
    assert err.value.status == 422, err.value.body
    body = api_error(err.value)
    assert body["reason"] == "Invalid"
    return body["message"]


def test_storage_container_fields_default_and_required(crd_api: client.CustomObjectsApi) -> None:
    base = examples()["ClusterStorageContainer"]
    job = copy.deepcopy(base)
    job["metadata"]["name"] = "downloader"
    job["disabled"] = True
    job["spec"]["workloadType"] = "localModelDownloadJob"
    got = _create(crd_api, job)
    assert got["disabled"] is True and got["spec"]["workloadType"] == "localModelDownloadJob"
    plain = copy.deepcopy(base)
    plain["spec"].pop("workloadType", None)
    plain["spec"].pop("supportsMultiModelDownload", None)
    got = _create(crd_api, plain)
    assert got["spec"]["workloadType"] == "initContainer" and got["spec"]["supportsMultiModelDownload"] is False
    for field in ("container", "supportedUriFormats"):
        bad = copy.deepcopy(base)
        bad["metadata"]["name"] = f"no-{field.lower()}"
        del bad["spec"][field]
        assert f"spec.{field}: Required value" in _rejected(crd_api, bad)


def test_every_required_field_is_enforced(crd_api: client.CustomObjectsApi) -> None:
    ex = examples()
    cases = [
        ("LocalModelNamespaceCache", ["spec", "sourceModelUri"], "spec.sourceModelUri: Required value"),
        ("LocalModelNode", ["spec", "localModels"], "spec.localModels: Required value"),
        ("LocalModelNodeGroup", ["spec", "storageLimit"], "spec.storageLimit: Required value"),
        ("LocalModelNodeGroup", ["spec", "persistentVolumeClaimSpec"], "spec.persistentVolumeClaimSpec: Required"),
    ]
    for kind, path, message in cases:
        obj = copy.deepcopy(ex[kind])
        parent = obj
        for step in path[:-1]:
            parent = parent[step]
        del parent[path[-1]]
        assert message in _rejected(crd_api, obj), (kind, path)
    node = copy.deepcopy(ex["LocalModelNode"])
    del node["spec"]["localModels"][0]["modelName"]
    assert "spec.localModels[0].modelName: Required value" in _rejected(crd_api, node)


def test_cache_status_lists_survive_pruning(crd_api: client.CustomObjectsApi) -> None:
    cache = _create(crd_api, examples()["LocalModelCache"])
    status = {
        "nodeStatus": {"node-1": "NodeDownloading"},
        "copies": {"available": 0, "total": 1, "failed": 0},
        "inferenceServices": [{"namespace": "default", "name": "llama"}],
        "llmInferenceServices": [{"namespace": "default", "name": "llama-llm"}],
    }
    got = crd_api.patch_cluster_custom_object_status(
        GROUP, VERSION, "localmodelcaches", cache["metadata"]["name"], {"status": status}
    )
    assert got["status"] == status
