"""Protocol-level behaviour of the kubeapi test server: discovery through the official client,
/version, OpenAPI, error bodies on unknown paths, and kept-alive connections surviving errors."""

from __future__ import annotations

import http.client
import json

import pytest
from kubernetes import client


def test_discovery_through_the_official_client(kubeapi):
    with kubeapi.api_client() as api_client:
        assert client.VersionApi(api_client).get_code().git_version.startswith("v1.")
        assert client.CoreApi(api_client).get_api_versions().versions == ["v1"]
        groups = {g.name: g for g in client.ApisApi(api_client).get_api_versions().groups}
        for name in ("serving.kserve.io", "coordination.k8s.io", "apiextensions.k8s.io", "apps",
                     "rbac.authorization.k8s.io"):
            assert name in groups
        # v1beta1 (InferenceService, from the extra CRDs) outranks v1alpha1, as in Kubernetes
        assert groups["serving.kserve.io"].preferred_version.version == "v1beta1"
        core = {r.name for r in client.CoreV1Api(api_client).get_api_resources().resources}
        assert {"pods", "pods/status", "nodes", "persistentvolumes", "persistentvolumeclaims", "namespaces",
                "secrets", "serviceaccounts", "configmaps", "events"} <= core
        leases = client.CoordinationV1Api(api_client).get_api_resources().resources
        assert [(r.name, r.namespaced) for r in leases] == [("leases", True)]


def _conn(kubeapi) -> http.client.HTTPConnection:
    return http.client.HTTPConnection("127.0.0.1", kubeapi.port, timeout=10)


def test_errors_keep_the_connection_usable(kubeapi):
    conn = _conn(kubeapi)
    body = json.dumps({"metadata": {"name": "x"}})
    conn.request("POST", "/apis/nowhere.example.com/v1/things", body=body,
                 headers={"Content-Type": "application/json"})
    resp = conn.getresponse()
    status = json.loads(resp.read())
    assert resp.status == 404 and status["kind"] == "Status" and status["reason"] == "NotFound"
    conn.request("POST", "/api/v1/namespaces/default/configmaps", body="{not json",
                 headers={"Content-Type": "application/json"})
    resp = conn.getresponse()
    assert resp.status == 400 and json.loads(resp.read())["reason"] == "BadRequest"
    conn.request("GET", "/version")  # same connection
    resp = conn.getresponse()
    assert resp.status == 200 and json.loads(resp.read())["major"] == "1"
    conn.close()


def test_openapi_v2_is_served_for_kubectl(kubeapi):
    conn = _conn(kubeapi)
    conn.request("GET", "/openapi/v2", headers={"Accept": "application/json"})
    resp = conn.getresponse()
    doc = json.loads(resp.read())
    assert resp.status == 200 and doc["swagger"] == "2.0" and doc["definitions"] == {}
    patch = doc["paths"]["/apis/serving.kserve.io/v1alpha1/localmodelcaches/{name}"]["patch"]
    assert patch["x-kubernetes-group-version-kind"] == {"group": "serving.kserve.io", "kind": "LocalModelCache",
                                                        "version": "v1alpha1"}
    assert {p["name"] for p in patch["parameters"]} == {"dryRun", "fieldManager", "fieldValidation"}
    assert "/api/v1/namespaces/{namespace}/pods/{name}" in doc["paths"]
    conn.request("GET", "/openapi/v2", headers={"Accept": "application/com.github.proto-openapi.spec.v2@v1.0+protobuf"})
    resp = conn.getresponse()
    data = resp.read()
    assert resp.status == 200 and resp.getheader("Content-Type").endswith("+protobuf") and data.startswith(b"\n\x032.0")
    conn.close()


def test_crd_lifecycle_adds_and_removes_endpoints(kubeapi_factory):
    api = kubeapi_factory(crd_dirs=())
    crd = {
        "apiVersion": "apiextensions.k8s.io/v1", "kind": "CustomResourceDefinition",
        "metadata": {"name": "widgets.example.com"},
        "spec": {"group": "example.com", "scope": "Namespaced",
                 "names": {"kind": "Widget", "plural": "widgets", "singular": "widget"},
                 "versions": [{"name": "v1", "served": True, "storage": True, "schema": {"openAPIV3Schema": {
                     "type": "object", "properties": {"spec": {"type": "object", "properties": {
                         "size": {"type": "integer"}}}}}}}]}}
    with api.api_client() as api_client:
        ext = client.ApiextensionsV1Api(api_client)
        custom = client.CustomObjectsApi(api_client)
        created = ext.create_custom_resource_definition(crd)
        assert {c.type for c in created.status.conditions} == {"Established", "NamesAccepted"}
        custom.create_namespaced_custom_object("example.com", "v1", "default", "widgets", {
            "apiVersion": "example.com/v1", "kind": "Widget", "metadata": {"name": "w"}, "spec": {"size": 3}})
        ext.delete_custom_resource_definition("widgets.example.com")
        with pytest.raises(client.ApiException) as err:
            custom.list_namespaced_custom_object("example.com", "v1", "default", "widgets")
        assert err.value.status == 404


def test_legacy_watch_path_streams_chunked_events(kubeapi):
    with kubeapi.api_client() as api_client:
        client.CoreV1Api(api_client).create_namespaced_config_map("default", {"metadata": {"name": "w"}})
    conn = _conn(kubeapi)
    conn.request("GET", "/api/v1/watch/namespaces/default/configmaps?timeoutSeconds=1")
    resp = conn.getresponse()
    assert resp.status == 200 and resp.getheader("Transfer-Encoding") == "chunked"
    events = [json.loads(line) for line in resp.read().splitlines() if line.strip()]
    assert [(e["type"], e["object"]["metadata"]["name"]) for e in events] == [("ADDED", "w")]
    conn.close()
