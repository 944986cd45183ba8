"""Our CRDs, served by the kubeapi test server and driven by the official client: KServe-shaped
objects of every kind validate; bad enums, missing fields and a changed sourceModelUri are
rejected with the API's 422 Invalid Status; unknown fields are pruned; defaults apply."""

from __future__ import annotations

import copy
from typing import Any

import pytest
from kubernetes import client
from kubernetes.client.rest import ApiException

from tests.kubeapi_helpers import GROUP, PLURALS, VERSION, api_error, examples

NAMESPACED = {"LocalModelNamespaceCache"}


def _create(api: client.CustomObjectsApi, obj: dict[str, Any]) -> dict[str, Any]:
    plural = PLURALS[obj["kind"]]
    if obj["kind"] in NAMESPACED:
        return api.create_namespaced_custom_object(GROUP, VERSION, obj["metadata"]["namespace"], plural, obj)
    return api.create_cluster_custom_object(GROUP, VERSION, plural, obj)


def _invalid(exc: ApiException) -> dict[str, Any]:
    assert exc.status == 422, exc.body
    body = api_error(exc)
    assert body["kind"] == "Status" and body["reason"] == "Invalid" and body["code"] == 422
    return body


@pytest.fixture
def crd_api(kubeapi):
    with kubeapi.api_client() as api_client:
        yield client.CustomObjectsApi(api_client)


def test_discovery_lists_every_kind_with_kserve_scope_and_subresources(kubeapi):
    with kubeapi.api_client() as api_client:
        resources = client.CustomObjectsApi(api_client).get_api_resources(GROUP, VERSION).resources
    by_name = {r.name: r for r in resources}
    assert {n: by_name[n].namespaced for n in PLURALS.values()} == {
        "localmodelcaches": False, "localmodelnamespacecaches": True, "localmodelnodes": False,
        "localmodelnodegroups": False, "clusterstoragecontainers": False}
    assert {n for n in by_name if n.endswith("/status")} == {
        "localmodelcaches/status", "localmodelnamespacecaches/status", "localmodelnodes/status"}
    assert {by_name[p].kind for p in PLURALS.values()} == set(PLURALS)


@pytest.mark.parametrize("kind", sorted(PLURALS))
def test_example_of_every_kind_validates_and_round_trips(crd_api, kind):
    obj = examples()[kind]
    created = _create(crd_api, obj)
    assert created["spec"] == {**obj["spec"], **({"workloadType": "initContainer"}
                                                 if kind == "ClusterStorageContainer" else {})}
    meta = created["metadata"]
    assert meta["uid"] and meta["creationTimestamp"] and meta["generation"] == 1 and int(meta["resourceVersion"])


def test_all_examples_together(crd_api):
    for obj in examples().values():
        _create(crd_api, obj)
    got = crd_api.list_cluster_custom_object(GROUP, VERSION, "localmodelnodes")
    assert [i["metadata"]["name"] for i in got["items"]] == ["node-1"]


def test_missing_required_fields_are_rejected(crd_api):
    obj = copy.deepcopy(examples()["LocalModelCache"])
    del obj["spec"]["modelSize"]
    del obj["spec"]["nodeGroups"]
    with pytest.raises(ApiException) as err:
        _create(crd_api, obj)
    body = _invalid(err.value)
    assert body["message"] == ('LocalModelCache.serving.kserve.io "meta-llama3-8b-instruct" is invalid: '
                               "[spec.modelSize: Required value, spec.nodeGroups: Required value]")
    assert [(c["field"], c["reason"]) for c in body["details"]["causes"]] == [
        ("spec.modelSize", "FieldValueRequired"), ("spec.nodeGroups", "FieldValueRequired")]

    node = copy.deepcopy(examples()["LocalModelNode"])
    del node["spec"]["localModels"][1]["sourceModelUri"]
    with pytest.raises(ApiException) as err:
        _create(crd_api, node)
    assert _invalid(err.value)["details"]["causes"][0]["field"] == "spec.localModels[1].sourceModelUri"

    group = copy.deepcopy(examples()["LocalModelNodeGroup"])
    del group["spec"]["persistentVolumeSpec"]
    with pytest.raises(ApiException) as err:
        _create(crd_api, group)
    assert "spec.persistentVolumeSpec: Required value" in _invalid(err.value)["message"]


def test_empty_node_groups_violates_min_items(crd_api):
    obj = copy.deepcopy(examples()["LocalModelNamespaceCache"])
    obj["spec"]["nodeGroups"] = []
    with pytest.raises(ApiException) as err:
        _create(crd_api, obj)
    assert "spec.nodeGroups in body should have at least 1 items" in _invalid(err.value)["message"]


def test_wrong_types_and_bad_quantity_are_rejected(crd_api):
    obj = copy.deepcopy(examples()["LocalModelCache"])
    obj["spec"]["nodeGroups"] = "gpu"
    obj["spec"]["modelSize"] = "ten gigs"
    with pytest.raises(ApiException) as err:
        _create(crd_api, obj)
    msg = _invalid(err.value)["message"]
    assert 'spec.nodeGroups: Invalid value: "string": spec.nodeGroups in body must be of type array' in msg
    assert 'spec.modelSize: Invalid value: "ten gigs": spec.modelSize in body should match' in msg


def test_wrong_status_enums_are_rejected_on_the_status_subresource(crd_api):
    _create(crd_api, examples()["LocalModelCache"])
    _create(crd_api, examples()["LocalModelNode"])
    with pytest.raises(ApiException) as err:
        crd_api.patch_cluster_custom_object_status(GROUP, VERSION, "localmodelcaches", "meta-llama3-8b-instruct",
                                                   {"status": {"nodeStatus": {"node-1": "Downloaded"}}})
    body = _invalid(err.value)
    assert body["details"]["causes"][0] == {
        "reason": "FieldValueNotSupported", "field": "status.nodeStatus.node-1",
        "message": 'Unsupported value: "Downloaded": supported values: "", "NodeNotReady", "NodeDownloadPending", '
                   '"NodeDownloading", "NodeDownloaded", "NodeDownloadError"'}
    with pytest.raises(ApiException) as err:
        crd_api.patch_cluster_custom_object_status(GROUP, VERSION, "localmodelnodes", "node-1",
                                                   {"status": {"modelStatus": {"default/team-bert": "Done"}}})
    assert _invalid(err.value)["details"]["causes"][0]["field"] == "status.modelStatus.default/team-bert"
    ok = crd_api.patch_cluster_custom_object_status(
        GROUP, VERSION, "localmodelnodes", "node-1",
        {"status": {"modelStatus": {"meta-llama3-8b-instruct": "ModelDownloaded", "default/team-bert": ""}}})
    assert ok["status"]["modelStatus"]["meta-llama3-8b-instruct"] == "ModelDownloaded"


def test_source_model_uri_is_immutable(crd_api):
    _create(crd_api, examples()["LocalModelCache"])
    with pytest.raises(ApiException) as err:
        crd_api.patch_cluster_custom_object(GROUP, VERSION, "localmodelcaches", "meta-llama3-8b-instruct",
                                            {"spec": {"sourceModelUri": "hf://meta-llama/other"}})
    body = _invalid(err.value)
    assert body["message"] == ('LocalModelCache.serving.kserve.io "meta-llama3-8b-instruct" is invalid: '
                               'spec.sourceModelUri: Invalid value: "string": StorageUri is immutable')
    # other spec fields stay mutable, and the namespaced cache has the same rule
    out = crd_api.patch_cluster_custom_object(GROUP, VERSION, "localmodelcaches", "meta-llama3-8b-instruct",
                                              {"spec": {"nodeGroups": ["gpu", "cpu"]}})
    assert out["spec"]["nodeGroups"] == ["gpu", "cpu"] and out["metadata"]["generation"] == 2
    ns_cache = _create(crd_api, examples()["LocalModelNamespaceCache"])
    ns_cache["spec"]["sourceModelUri"] = "s3://models/bert"
    with pytest.raises(ApiException) as err:
        crd_api.replace_namespaced_custom_object(GROUP, VERSION, "default", "localmodelnamespacecaches",
                                                 "team-bert", ns_cache)
    assert "StorageUri is immutable" in _invalid(err.value)["message"]


def test_unknown_fields_are_pruned_and_preserved_where_the_schema_says(crd_api):
    obj = copy.deepcopy(examples()["LocalModelNodeGroup"])
    obj["spec"]["bogus"] = 1
    obj["spec"]["persistentVolumeSpec"]["mountOptions"] = ["noatime"]  # embedded core/v1 spec: preserved
    obj["metadata"]["notAMetaField"] = "x"
    obj["topLevelJunk"] = True
    created = _create(crd_api, obj)
    assert "bogus" not in created["spec"] and "topLevelJunk" not in created
    assert "notAMetaField" not in created["metadata"]
    assert created["spec"]["persistentVolumeSpec"]["mountOptions"] == ["noatime"]


def test_our_status_additions_validate(crd_api):
    _create(crd_api, examples()["LocalModelNode"])
    status = {
        "modelStatus": {"meta-llama3-8b-instruct": "ModelDownloading"},
        "modelDetails": {"meta-llama3-8b-instruct": {
            "state": "ModelDownloading", "storageKey": "0123456789abcdef", "bytesDone": 1024, "bytesTotal": 4096,
            "rate": 512, "resolvedRevision": "abc123", "message": "2 of 4 files", "startedAt": "2026-01-01T00:00:00Z"}},
        "capacity": {"totalBytes": 10, "freeBytes": 4, "reservedBytes": 3, "free": "4"},
        "modelCounts": {"downloaded": 0, "downloading": 1, "pending": 1, "failed": 0, "total": 2},
    }
    out = crd_api.patch_cluster_custom_object_status(GROUP, VERSION, "localmodelnodes", "node-1", {"status": status})
    assert out["status"] == status
    with pytest.raises(ApiException) as err:
        crd_api.patch_cluster_custom_object_status(GROUP, VERSION, "localmodelnodes", "node-1", {
            "status": {"capacity": {"freeBytes": -1}}})
    assert _invalid(err.value)["details"]["causes"][0]["field"] == "status.capacity.freeBytes"


def test_node_group_has_no_status_subresource(crd_api):
    _create(crd_api, examples()["LocalModelNodeGroup"])
    with pytest.raises(ApiException) as err:
        crd_api.get_cluster_custom_object_status(GROUP, VERSION, "localmodelnodegroups", "gpu")
    assert err.value.status == 404
    # without the subresource, status is written through the main endpoint and bumps generation
    out = crd_api.patch_cluster_custom_object(GROUP, VERSION, "localmodelnodegroups", "gpu",
                                              {"status": {"used": "1Gi"}})
    assert out["status"] == {"used": "1Gi"} and out["metadata"]["generation"] == 2


def test_field_validation_strict_rejects_unknown_fields(crd_api):
    obj = copy.deepcopy(examples()["LocalModelCache"])
    obj["spec"]["bogus"] = 1
    with pytest.raises(ApiException) as err:
        crd_api.create_cluster_custom_object(GROUP, VERSION, "localmodelcaches", obj, field_validation="Strict")
    assert err.value.status == 400
    assert api_error(err.value)["message"] == (
        'LocalModelCache in version "v1alpha1" cannot be handled as a LocalModelCache: strict decoding error: '
        'unknown field "spec.bogus"')
    # the default (Warn) and Ignore store the pruned object
    created = crd_api.create_cluster_custom_object(GROUP, VERSION, "localmodelcaches", obj, field_validation="Ignore")
    assert "bogus" not in created["spec"]
