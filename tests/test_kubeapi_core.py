"""Write semantics of the kubeapi test server, driven by the official client: CRUD of the core
kinds we use, resourceVersion and optimistic concurrency, generation, the status subresource,
selectors, pagination, finalizers, namespaces and garbage collection through ownerReferences."""

from __future__ import annotations

import base64
import copy
import threading
from typing import Any

import pytest
from kubernetes import client
from kubernetes.client.rest import ApiException

from tests.kubeapi_helpers import GROUP, VERSION, api_error, examples


@pytest.fixture
def apis(kubeapi):
    with kubeapi.api_client() as api_client:
        yield (client.CoreV1Api(api_client), client.CustomObjectsApi(api_client),
               client.CoordinationV1Api(api_client))


def _meta(name: str, **kw: Any) -> dict[str, Any]:
    return {"name": name, **kw}


# (kind, namespaced, body, method suffix, a field we patch, patched value read back)
CORE_KINDS = [
    ("node", False, {"metadata": _meta("n1"), "spec": {"podCIDR": "10.0.0.0/24"}}),
    ("persistent_volume", False, {"metadata": _meta("pv1"), "spec": {
        "capacity": {"storage": "1Gi"}, "accessModes": ["ReadWriteOnce"], "local": {"path": "/models"}}}),
    ("namespace", False, {"metadata": _meta("team-a")}),
    ("pod", True, {"metadata": _meta("p1"), "spec": {"containers": [{"name": "c", "image": "busybox"}]}}),
    ("persistent_volume_claim", True, {"metadata": _meta("pvc1"), "spec": {
        "accessModes": ["ReadWriteOnce"], "resources": {"requests": {"storage": "1Gi"}}}}),
    ("secret", True, {"metadata": _meta("s1"), "data": {"k": base64.b64encode(b"v").decode()}}),
    ("service_account", True, {"metadata": _meta("sa1")}),
    ("config_map", True, {"metadata": _meta("cm1"), "data": {"a": "1"}}),
    ("event", True, {"metadata": _meta("ev1"), "involvedObject": {"kind": "Pod", "name": "p1", "namespace": "default"},
                     "reason": "Pulled", "message": "pulled", "type": "Normal"}),
]


@pytest.mark.parametrize(("kind", "namespaced", "body"), CORE_KINDS, ids=[k[0] for k in CORE_KINDS])
def test_core_kind_crud(apis, kind, namespaced, body):
    core = apis[0]
    args = ("default",) if namespaced else ()
    scope = "namespaced_" if namespaced else ""
    name = body["metadata"]["name"]
    created = getattr(core, f"create_{scope}{kind}")(*args, copy.deepcopy(body))
    assert created.metadata.uid and created.metadata.resource_version and created.metadata.creation_timestamp
    got = getattr(core, f"read_{scope}{kind}")(name, *args)
    assert got.metadata.uid == created.metadata.uid
    listed = getattr(core, f"list_{scope}{kind}")(*args)
    assert name in [i.metadata.name for i in listed.items]
    assert int(listed.metadata.resource_version) >= int(created.metadata.resource_version)
    # strategic merge patch (what CoreV1Api sends for a dict body) keeps what it doesn't mention
    patched = getattr(core, f"patch_{scope}{kind}")(name, *args, {"metadata": {"labels": {"x": "1"}}})
    assert patched.metadata.labels == {"x": "1"}
    assert int(patched.metadata.resource_version) > int(created.metadata.resource_version)
    # PUT of the current object, with one annotation added
    patched.metadata.annotations = {"note": "put"}
    replaced = getattr(core, f"replace_{scope}{kind}")(name, *args, patched)
    assert replaced.metadata.annotations == {"note": "put"} and replaced.metadata.labels == {"x": "1"}
    getattr(core, f"delete_{scope}{kind}")(name, *args)
    with pytest.raises(ApiException) as err:
        getattr(core, f"read_{scope}{kind}")(name, *args)
    assert err.value.status == 404 and api_error(err.value)["reason"] == "NotFound"


def test_lease_crud_with_micro_time(apis):
    leases = apis[2]
    body = client.V1Lease(metadata=client.V1ObjectMeta(name="modelcache-coordinator"),
                          spec=client.V1LeaseSpec(holder_identity="a", lease_duration_seconds=15,
                                                  renew_time="2026-01-01T00:00:00.123456Z"))
    created = leases.create_namespaced_lease("kube-system", body)
    assert created.spec.holder_identity == "a" and created.spec.renew_time.microsecond == 123456
    created.spec.holder_identity = "b"
    updated = leases.replace_namespaced_lease("modelcache-coordinator", "kube-system", created)
    assert updated.spec.holder_identity == "b"
    # a second writer holding the old version loses: this is what leader election relies on
    created.spec.holder_identity = "c"
    with pytest.raises(ApiException) as err:
        leases.replace_namespaced_lease("modelcache-coordinator", "kube-system", created)
    assert err.value.status == 409 and api_error(err.value)["reason"] == "Conflict"


def test_errors_have_kubernetes_status_shape(apis):
    core = apis[0]
    core.create_namespaced_config_map("default", {"metadata": {"name": "a"}})
    with pytest.raises(ApiException) as err:
        core.create_namespaced_config_map("default", {"metadata": {"name": "a"}})
    assert err.value.status == 409
    assert api_error(err.value) == {
        "kind": "Status", "apiVersion": "v1", "metadata": {}, "status": "Failure", "reason": "AlreadyExists",
        "message": 'configmaps "a" already exists', "details": {"name": "a", "kind": "configmaps"}, "code": 409}
    with pytest.raises(ApiException) as err:
        core.read_namespaced_config_map("missing", "default")
    assert api_error(err.value)["message"] == 'configmaps "missing" not found'
    with pytest.raises(ApiException) as err:
        core.create_namespaced_config_map("nowhere", {"metadata": {"name": "a"}})
    assert err.value.status == 404 and api_error(err.value)["message"] == 'namespaces "nowhere" not found'
    with pytest.raises(ApiException) as err:
        core.create_namespaced_config_map("default", {"metadata": {"name": "Bad_Name"}})
    assert err.value.status == 422


def test_stale_put_conflicts_and_resource_version_is_global(apis):
    core, crd, _ = apis
    cm = core.create_namespaced_config_map("default", {"metadata": {"name": "a"}, "data": {"v": "1"}})
    other = core.create_namespaced_config_map("default", {"metadata": {"name": "b"}})
    assert int(other.metadata.resource_version) == int(cm.metadata.resource_version) + 1
    cm.data = {"v": "2"}
    fresh = core.replace_namespaced_config_map("a", "default", cm)
    cm.data = {"v": "3"}
    with pytest.raises(ApiException) as err:
        core.replace_namespaced_config_map("a", "default", cm)  # cm still carries the old resourceVersion
    assert err.value.status == 409 and "the object has been modified" in api_error(err.value)["message"]
    assert core.read_namespaced_config_map("a", "default").data == {"v": "2"}
    # a merge patch that carries a stale resourceVersion is a precondition, and conflicts too
    with pytest.raises(ApiException) as err:
        stale = {"metadata": {"resourceVersion": cm.metadata.resource_version}, "data": {"v": "4"}}
        core.patch_namespaced_config_map("a", "default", stale, _content_type="application/merge-patch+json")
    assert err.value.status == 409
    # custom resources require a resourceVersion on PUT
    cache = crd.create_cluster_custom_object(GROUP, VERSION, "localmodelcaches", examples()["LocalModelCache"])
    del cache["metadata"]["resourceVersion"]
    with pytest.raises(ApiException) as err:
        crd.replace_cluster_custom_object(GROUP, VERSION, "localmodelcaches", cache["metadata"]["name"], cache)
    assert err.value.status == 422 and "metadata.resourceVersion" in api_error(err.value)["message"]
    assert fresh.metadata.resource_version


def test_no_op_write_keeps_resource_version(apis):
    crd = apis[1]
    obj = crd.create_cluster_custom_object(GROUP, VERSION, "localmodelcaches", examples()["LocalModelCache"])
    same = crd.patch_cluster_custom_object(GROUP, VERSION, "localmodelcaches", obj["metadata"]["name"],
                                           {"spec": {"modelSize": obj["spec"]["modelSize"]}})
    assert same["metadata"]["resourceVersion"] == obj["metadata"]["resourceVersion"]


def test_generation_bumps_on_spec_changes_only(apis):
    crd = apis[1]
    name = "meta-llama3-8b-instruct"
    obj = crd.create_cluster_custom_object(GROUP, VERSION, "localmodelcaches", examples()["LocalModelCache"])
    assert obj["metadata"]["generation"] == 1
    labeled = crd.patch_cluster_custom_object(GROUP, VERSION, "localmodelcaches", name,
                                              {"metadata": {"labels": {"a": "b"}, "annotations": {"c": "d"}}})
    assert labeled["metadata"]["generation"] == 1
    status = crd.patch_cluster_custom_object_status(GROUP, VERSION, "localmodelcaches", name,
                                                    {"status": {"copies": {"available": 1, "total": 2}}})
    assert status["metadata"]["generation"] == 1
    assert int(status["metadata"]["resourceVersion"]) > int(labeled["metadata"]["resourceVersion"])
    spec = crd.patch_cluster_custom_object(GROUP, VERSION, "localmodelcaches", name, {"spec": {"modelSize": "11Gi"}})
    assert spec["metadata"]["generation"] == 2


def test_status_subresource_separation(apis):
    crd = apis[1]
    name = "meta-llama3-8b-instruct"
    body = copy.deepcopy(examples()["LocalModelCache"])
    body["status"] = {"copies": {"available": 9}}
    obj = crd.create_cluster_custom_object(GROUP, VERSION, "localmodelcaches", body)
    assert "status" not in obj  # status is ignored on create when the subresource exists
    # the main endpoint ignores status
    obj = crd.patch_cluster_custom_object(GROUP, VERSION, "localmodelcaches", name,
                                          {"spec": {"modelSize": "1Gi"}, "status": {"copies": {"total": 5}}})
    assert obj["spec"]["modelSize"] == "1Gi" and "status" not in obj
    # the status endpoint ignores spec and metadata
    obj = crd.patch_cluster_custom_object_status(GROUP, VERSION, "localmodelcaches", name, {
        "spec": {"modelSize": "2Gi"}, "metadata": {"labels": {"x": "y"}},
        "status": {"nodeStatus": {"n1": "NodeDownloaded"}, "copies": {"available": 1, "total": 1, "failed": 0}}})
    assert obj["spec"]["modelSize"] == "1Gi" and not obj["metadata"].get("labels")
    assert obj["status"]["nodeStatus"] == {"n1": "NodeDownloaded"}
    # PUT on /status with a changed spec: only status lands
    obj["spec"]["nodeGroups"] = ["other"]
    obj["status"]["copies"]["failed"] = 1
    put = crd.replace_cluster_custom_object_status(GROUP, VERSION, "localmodelcaches", name, obj)
    assert put["spec"]["nodeGroups"] == ["gpu"] and put["status"]["copies"]["failed"] == 1
    assert crd.get_cluster_custom_object_status(GROUP, VERSION, "localmodelcaches", name)["status"] == put["status"]
    # core kinds too: a pod's status survives a spec update and is set through /status
    core = apis[0]
    pod = core.create_namespaced_pod("default", {"metadata": {"name": "p"}, "spec": {
        "containers": [{"name": "c", "image": "i"}]}, "status": {"phase": "Running"}})
    assert pod.status.phase == "Pending"
    pod = core.patch_namespaced_pod_status("p", "default", {"status": {"phase": "Running"}})
    assert pod.status.phase == "Running"
    pod = core.patch_namespaced_pod("p", "default", {"metadata": {"labels": {"a": "b"}}, "status": {"phase": "Failed"}})
    assert pod.status.phase == "Running"


def test_patch_flavours(apis):
    core, crd, _ = apis
    cm = {"metadata": {"name": "p"}, "data": {"a": "1", "b": "2"}}
    core.create_namespaced_config_map("default", cm)
    out = core.patch_namespaced_config_map("p", "default", [
        {"op": "test", "path": "/data/a", "value": "1"}, {"op": "replace", "path": "/data/a", "value": "9"},
        {"op": "remove", "path": "/data/b"}, {"op": "add", "path": "/metadata/labels", "value": {"l": "v"}}])
    assert out.data == {"a": "9"} and out.metadata.labels == {"l": "v"}
    with pytest.raises(ApiException) as err:
        core.patch_namespaced_config_map("p", "default", [{"op": "test", "path": "/data/a", "value": "1"}])
    assert err.value.status == 422
    # strategic merge: lists of containers merge by name
    core.create_namespaced_pod("default", {"metadata": {"name": "sm"}, "spec": {"containers": [
        {"name": "a", "image": "a:1"}, {"name": "b", "image": "b:1"}]}})
    pod = core.patch_namespaced_pod("sm", "default", {"spec": {"containers": [{"name": "b", "image": "b:2"}]}})
    assert [(c.name, c.image) for c in pod.spec.containers] == [("a", "a:1"), ("b", "b:2")]
    # custom resources don't take strategic merge patches, exactly like the real server
    crd.create_cluster_custom_object(GROUP, VERSION, "localmodelcaches", examples()["LocalModelCache"])
    with pytest.raises(ApiException) as err:
        crd.patch_cluster_custom_object(GROUP, VERSION, "localmodelcaches", "meta-llama3-8b-instruct",
                                        {"spec": {"modelSize": "1"}},
                                        _content_type="application/strategic-merge-patch+json")
    assert err.value.status == 415
    # JSON patch on a custom resource's list
    crd.patch_cluster_custom_object(GROUP, VERSION, "localmodelcaches", "meta-llama3-8b-instruct",
                                    [{"op": "add", "path": "/spec/nodeGroups/-", "value": "cpu"}],
                                    _content_type="application/json-patch+json")
    got = crd.get_cluster_custom_object(GROUP, VERSION, "localmodelcaches", "meta-llama3-8b-instruct")
    assert got["spec"]["nodeGroups"] == ["gpu", "cpu"]


def test_label_and_field_selectors(apis):
    core = apis[0]
    specs = {"a": {"app": "x", "tier": "gpu"}, "b": {"app": "y", "tier": "cpu"}, "c": {"app": "x"}, "d": {}}
    for name, labels in specs.items():
        node = "n1" if name in "ab" else "n2"
        core.create_namespaced_pod("default", {"metadata": {"name": name, "labels": labels}, "spec": {
            "nodeName": node, "containers": [{"name": "c", "image": "i"}]}})
    core.create_namespace({"metadata": {"name": "other"}})
    core.create_namespaced_pod("other", {"metadata": {"name": "a", "labels": {"app": "x"}}, "spec": {
        "containers": [{"name": "c", "image": "i"}]}})

    def names(**kw: Any) -> list[str]:
        return sorted(p.metadata.name for p in core.list_namespaced_pod("default", **kw).items)

    assert names(label_selector="app=x") == ["a", "c"]
    assert names(label_selector="app==x,tier") == ["a"]
    assert names(label_selector="app!=x") == ["b", "d"]
    assert names(label_selector="app in (x, y),!tier") == ["c"]
    assert names(label_selector="tier notin (gpu)") == ["b", "c", "d"]
    assert names(label_selector="tier") == ["a", "b"]
    assert names(label_selector="!app") == ["d"]
    assert names(field_selector="metadata.name=b") == ["b"]
    assert names(field_selector="spec.nodeName=n1,metadata.name!=a") == ["b"]
    assert names(field_selector="spec.nodeName=n2", label_selector="app=x") == ["c"]
    everywhere = core.list_pod_for_all_namespaces(field_selector="metadata.namespace=other")
    assert [(p.metadata.namespace, p.metadata.name) for p in everywhere.items] == [("other", "a")]
    assert len(core.list_pod_for_all_namespaces(label_selector="app=x").items) == 3
    with pytest.raises(ApiException) as err:
        names(field_selector="spec.bogus=1")
    assert err.value.status == 400 and "field label not supported" in api_error(err.value)["message"]
    with pytest.raises(ApiException) as err:
        names(label_selector="app in x")
    assert err.value.status == 400


def test_pagination_with_limit_and_continue(apis):
    core = apis[0]
    for i in range(5):
        core.create_namespaced_config_map("default", {"metadata": {"name": f"cm-{i}"}})
    seen, token = [], None
    while True:
        page = core.list_namespaced_config_map("default", limit=2, _continue=token)
        seen += [i.metadata.name for i in page.items]
        assert len(page.items) <= 2
        token = page.metadata._continue
        if not token:
            break
    assert seen == [f"cm-{i}" for i in range(5)]


def test_generate_name_and_secret_string_data(apis):
    core = apis[0]
    pod = core.create_namespaced_pod("default", {"metadata": {"generateName": "llama-node-1"}, "spec": {
        "containers": [{"name": "c", "image": "i"}]}})
    assert pod.metadata.name.startswith("llama-node-1") and len(pod.metadata.name) == len("llama-node-1") + 5
    secret = core.create_namespaced_secret("default", {"metadata": {"name": "s"}, "stringData": {"k": "v"}})
    assert secret.data == {"k": base64.b64encode(b"v").decode()}


def test_finalizers_and_deletion_timestamp(apis):
    crd = apis[1]
    body = copy.deepcopy(examples()["LocalModelCache"])
    body["metadata"]["finalizers"] = ["localmodel.kserve.io/finalizer"]
    name = body["metadata"]["name"]
    crd.create_cluster_custom_object(GROUP, VERSION, "localmodelcaches", body)
    crd.delete_cluster_custom_object(GROUP, VERSION, "localmodelcaches", name)
    held = crd.get_cluster_custom_object(GROUP, VERSION, "localmodelcaches", name)
    assert held["metadata"]["deletionTimestamp"] and held["metadata"]["finalizers"]
    # deleting again changes nothing; new finalizers can't be added while deleting
    crd.delete_cluster_custom_object(GROUP, VERSION, "localmodelcaches", name)
    again = crd.get_cluster_custom_object(GROUP, VERSION, "localmodelcaches", name)
    assert again["metadata"]["resourceVersion"] == held["metadata"]["resourceVersion"]
    with pytest.raises(ApiException) as err:
        crd.patch_cluster_custom_object(GROUP, VERSION, "localmodelcaches", name,
                                        {"metadata": {"finalizers": ["localmodel.kserve.io/finalizer", "other"]}})
    assert err.value.status == 422 and "no new finalizers" in api_error(err.value)["message"]
    # status writes still work while the finalizer holds the object
    crd.patch_cluster_custom_object_status(GROUP, VERSION, "localmodelcaches", name,
                                           {"status": {"copies": {"total": 0}}})
    crd.patch_cluster_custom_object(GROUP, VERSION, "localmodelcaches", name, {"metadata": {"finalizers": None}})
    with pytest.raises(ApiException) as err:
        crd.get_cluster_custom_object(GROUP, VERSION, "localmodelcaches", name)
    assert err.value.status == 404


def _owner_ref(obj: dict[str, Any]) -> dict[str, Any]:
    return {"apiVersion": obj["apiVersion"], "kind": obj["kind"], "name": obj["metadata"]["name"],
            "uid": obj["metadata"]["uid"], "controller": True, "blockOwnerDeletion": True}


def test_cascading_delete_through_owner_references(apis):
    core, crd, _ = apis
    cache = crd.create_cluster_custom_object(GROUP, VERSION, "localmodelcaches", examples()["LocalModelCache"])
    other = crd.create_cluster_custom_object(GROUP, VERSION, "localmodelnodes", examples()["LocalModelNode"])
    pv_spec = {"capacity": {"storage": "1Gi"}, "accessModes": ["ReadWriteOnce"], "local": {"path": "/models"}}
    core.create_persistent_volume({"metadata": {"name": "owned", "ownerReferences": [_owner_ref(cache)]},
                                   "spec": pv_spec})
    core.create_namespaced_persistent_volume_claim("default", {"metadata": {
        "name": "owned-claim", "ownerReferences": [_owner_ref(cache)]}, "spec": {"accessModes": ["ReadWriteOnce"]}})
    core.create_persistent_volume({"metadata": {"name": "shared", "ownerReferences": [
        _owner_ref(cache), _owner_ref(other)]}, "spec": pv_spec})
    core.create_persistent_volume({"metadata": {"name": "held", "finalizers": ["kubernetes.io/pv-protection"],
                                                "ownerReferences": [_owner_ref(cache)]}, "spec": pv_spec})
    crd.delete_cluster_custom_object(GROUP, VERSION, "localmodelcaches", cache["metadata"]["name"])
    pvs = {pv.metadata.name: pv for pv in core.list_persistent_volume().items}
    assert "owned" not in pvs
    assert core.list_namespaced_persistent_volume_claim("default").items == []
    assert [r.name for r in pvs["shared"].metadata.owner_references] == ["node-1"]  # another owner lives
    assert pvs["held"].metadata.deletion_timestamp is not None


def test_orphan_propagation_keeps_dependents(apis):
    core, crd, _ = apis
    cache = crd.create_cluster_custom_object(GROUP, VERSION, "localmodelcaches", examples()["LocalModelCache"])
    core.create_namespaced_config_map("default", {"metadata": {"name": "dep", "ownerReferences": [_owner_ref(cache)]}})
    crd.delete_cluster_custom_object(GROUP, VERSION, "localmodelcaches", cache["metadata"]["name"],
                                     propagation_policy="Orphan")
    dep = core.read_namespaced_config_map("dep", "default")
    assert not dep.metadata.owner_references


def test_namespace_deletion_removes_its_objects(apis):
    core, crd, _ = apis
    core.create_namespace({"metadata": {"name": "gone"}})
    core.create_namespaced_config_map("gone", {"metadata": {"name": "a"}})
    ns_cache = copy.deepcopy(examples()["LocalModelNamespaceCache"])
    ns_cache["metadata"]["namespace"] = "gone"
    crd.create_namespaced_custom_object(GROUP, VERSION, "gone", "localmodelnamespacecaches", ns_cache)
    core.delete_namespace("gone")
    with pytest.raises(ApiException):
        core.read_namespace("gone")
    assert core.list_config_map_for_all_namespaces(field_selector="metadata.namespace=gone").items == []
    assert crd.list_cluster_custom_object(GROUP, VERSION, "localmodelnamespacecaches")["items"] == []


def test_claim_and_pod_specs_are_immutable(apis):
    core = apis[0]
    core.create_namespaced_persistent_volume_claim("default", {"metadata": {"name": "c"}, "spec": {
        "accessModes": ["ReadWriteOnce"], "storageClassName": "local", "resources": {"requests": {"storage": "1Gi"}}}})
    bound = core.patch_namespaced_persistent_volume_claim("c", "default", {"spec": {"volumeName": "pv-1"}})
    assert bound.spec.volume_name == "pv-1"  # binding sets volumeName once
    grown = core.patch_namespaced_persistent_volume_claim("c", "default", {"spec": {"resources": {
        "requests": {"storage": "2Gi"}}}})
    assert grown.spec.resources.requests == {"storage": "2Gi"}
    for change in ({"storageClassName": "other"}, {"volumeName": "pv-2"}):
        with pytest.raises(ApiException) as err:
            core.patch_namespaced_persistent_volume_claim("c", "default", {"spec": change})
        assert err.value.status == 422 and "spec is immutable" in api_error(err.value)["message"]
    core.create_namespaced_pod("default", {"metadata": {"name": "p"}, "spec": {
        "containers": [{"name": "c", "image": "i:1"}]}})
    core.patch_namespaced_pod("p", "default", {"spec": {"containers": [{"name": "c", "image": "i:2"}]}})
    with pytest.raises(ApiException) as err:
        core.patch_namespaced_pod("p", "default", {"spec": {"nodeName": "elsewhere"}})
    assert err.value.status == 422 and "pod updates may not change fields" in api_error(err.value)["message"]


def test_concurrent_read_modify_write_with_conflict_retries(kubeapi):
    """Four writers increment one counter with GET + PUT, retrying on 409: no update is lost."""
    with kubeapi.api_client() as setup:
        client.CoreV1Api(setup).create_namespaced_config_map("default", {"metadata": {"name": "n"},
                                                                         "data": {"v": "0"}})
    def writer() -> None:
        with kubeapi.api_client() as api_client:
            core = client.CoreV1Api(api_client)
            for _ in range(10):
                while True:
                    cm = core.read_namespaced_config_map("n", "default")
                    cm.data["v"] = str(int(cm.data["v"]) + 1)
                    try:
                        core.replace_namespaced_config_map("n", "default", cm)
                        break
                    except ApiException as exc:
                        assert exc.status == 409

    threads = [threading.Thread(target=writer) for _ in range(4)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(60)
    with kubeapi.api_client() as check:
        assert client.CoreV1Api(check).read_namespaced_config_map("n", "default").data == {"v": "40"}


def test_node_keeps_status_on_create_and_status_is_a_subresource(apis):
    core = apis[0]
    ready = {"conditions": [{"type": "Ready", "status": "True"}]}
    node = core.create_node({"metadata": {"name": "gpu-1", "labels": {"kserve/localmodel": "worker"}},
                             "status": ready})
    assert node.status.conditions[0].type == "Ready"  # the kubelet registers nodes with their status
    node = core.patch_node("gpu-1", {"status": {"conditions": [{"type": "Ready", "status": "False"}]}})
    assert node.status.conditions[0].status == "True"
    node = core.patch_node_status("gpu-1", {"status": {"conditions": [{"type": "Ready", "status": "False"}]}})
    assert node.status.conditions[0].status == "False"
    assert [n.metadata.name for n in core.list_node(label_selector="kserve/localmodel=worker").items] == ["gpu-1"]
