"""Tenants kept apart (security review H3, H4, M4; docs/operations.md, "Threat model"), with two
tenants as the review set them up: each a ServiceAccount with `edit` in its namespace and every verb
on namespace caches and InferenceServices, acting with its own token. deploy/'s coordinator (its
webhooks called by the API server) and an agent run as their ServiceAccounts.

- H3: a namespace cache named another team's Secret key or ServiceAccount, and redirected them to
  the tenant's own endpoint with storage.parameters: the webhook refuses the redirect, the agent
  uses no credential not granted to the cache's namespace.
- H4: the serving claim in a tenant's namespace is bound to a PV of the group's whole root; a pod
  of the tenant may mount it only read-only under its cache's storage key.
- M4: one namespace may fill at most its share of a group's storageLimit (by default half), and
  namespace caches get only the room the group's cluster caches leave.
"""

from __future__ import annotations

import json
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

from modelcache.kube.client import (
    LOCAL_MODEL_NAMESPACE_CACHES,
    LOCAL_MODEL_NODE_GROUPS,
    PERSISTENT_VOLUME_CLAIMS,
    PERSISTENT_VOLUMES,
    SECRETS,
    SERVICE_ACCOUNTS,
)
from modelcache.sources.uri import storage_key
from tests.agent_util import CRED_NS, start_agent, wait_states
from tests.coordinator_util import agent_report, entries_of, make_cache, make_group
from tests.deploy_util import serve_webhooks
from tests.fixtures.cluster import Cluster
from tests.helpers import wait_until
from tests.tenant_util import as_tenant, make_tenant, recording_origin

pytestmark = pytest.mark.timeout(400)

NODE = "node-1"
MANAGED = "app.kubernetes.io/managed-by=modelcache-coordinator"


def ns_cache(name: str, uri: str, size: str = "10Mi", **spec: Any) -> dict[str, Any]:
    return {"apiVersion": "serving.kserve.io/v1alpha1", "kind": "LocalModelNamespaceCache", "metadata": {"name": name},
            "spec": {"sourceModelUri": uri, "modelSize": size, "nodeGroups": ["workers"], **spec}}


def isvc(name: str, uri: str) -> dict[str, Any]:
    return {"apiVersion": "serving.kserve.io/v1beta1", "kind": "InferenceService", "metadata": {"name": name},
            "spec": {"predictor": {"model": {"modelFormat": {"name": "sklearn"}, "storageUri": uri}}}}


@pytest.fixture
def coordinator(cluster: Cluster, tmp_path: Path) -> Iterator[Any]:
    """deploy/'s coordinator, its webhooks called by the API server through their Service."""
    proc = serve_webhooks(cluster, tmp_path / "coordinator")
    try:
        probe = ns_cache("probe", "s3://probe/never", nodeGroups=["no-such-group"])
        wait_until(lambda: "NodeGroup no-such-group not found" in
                   cluster.kubectl("create", "-n", "default", "-f", "-", input=json.dumps(probe), check=False).stderr,
                   timeout=30, what=f"the webhooks called\n{proc.log()[-2000:]}")
        yield proc
    finally:
        proc.stop()


# -- H3 ------------------------------------------------------------------------------------------


def test_a_namespace_cache_uses_only_credentials_granted_to_its_namespace(cluster: Cluster, coordinator: Any,
                                                                          tmp_path: Path) -> None:
    admin = cluster.kube()
    cluster.register_node(NODE, {"kserve/localmodel": "worker"})
    make_group(admin, "workers")
    tenant_a, tenant_b = make_tenant(cluster, "tenant-a"), make_tenant(cluster, "tenant-b")
    with recording_origin() as origin:
        # Team B's credentials in the shared credential namespace (review's 05-setup-tenants.sh):
        # a storage-config key and a ServiceAccount whose Secret holds S3 keys, both for an S3
        # endpoint that is, here, the recording origin.
        spec = {"type": "s3", "access_key_id": "AKIATEAMB", "secret_access_key": "TEAMBSECRETKEY",
                "endpoint_url": origin.url, "region": "us-east-1"}
        admin.create(SECRETS, {"metadata": {"name": "storage-config", "namespace": CRED_NS},
                               "stringData": {"team-b": json.dumps(spec)}}, CRED_NS)
        admin.create(SECRETS, {"metadata": {"name": "team-b-s3", "namespace": CRED_NS, "annotations": {
            "serving.kserve.io/s3-endpoint": f"127.0.0.1:{origin.port}", "serving.kserve.io/s3-usehttps": "0"}},
            "stringData": {"awsAccessKeyID": "AKIASAB", "awsSecretAccessKey": "SASECRETB"}}, CRED_NS)
        admin.create(SERVICE_ACCOUNTS, {"metadata": {"name": "team-b", "namespace": CRED_NS},
                                        "secrets": [{"name": "team-b-s3"}]}, CRED_NS)
        agent = start_agent(cluster.agent_kubeconfig, NODE, tmp_path / "root", tmp_path)
        try:
            # The review's step: tenant A names team B's key and points it at an endpoint of its own.
            out = as_tenant(cluster, tenant_a, "create", "-n", "tenant-a", "-f", "-", stdin=ns_cache(
                "steal-key", "s3://team-b-private/model",
                storage={"key": "team-b", "parameters": {"type": "s3", "endpoint_url": "http://127.0.0.1:18555"}}))
            assert out.returncode != 0
            assert "storage.parameters may not set endpoint_url in a namespace cache" in out.stderr, out.stderr
            # Without the redirect the cache is admitted, and so is one naming team B's ServiceAccount:
            # the agent uses neither (they are not granted to tenant-a).
            for cache in (ns_cache("steal-key", "s3://team-b-private/model", storage={"key": "team-b"}),
                          ns_cache("steal-sa-s3", "s3://team-b-private/weights", serviceAccountName="team-b")):
                out = as_tenant(cluster, tenant_a, "create", "-n", "tenant-a", "-f", "-", stdin=cache)
                assert out.returncode == 0, out.stderr
            err = "ModelDownloadError"
            status = wait_states(admin, NODE, {"tenant-a/steal-key": err, "tenant-a/steal-sa-s3": err}, agent=agent)
            details = status["modelDetails"]
            assert ("key 'team-b' of Secret 'storage-config' is not granted to namespace tenant-a"
                    in details["tenant-a/steal-key"]["message"]), details
            assert ("service account 'team-b' is not granted to namespace tenant-a"
                    in details["tenant-a/steal-sa-s3"]["message"]), details
            assert origin.requests == []  # not one request went out with team B's keys

            # A cluster admin grants them to tenant-b: tenant-b's caches use them (the origin sees
            # requests signed with both key ids), tenant-a's still do not.
            admin.patch(SERVICE_ACCOUNTS, "team-b", {"metadata": {"annotations": {
                "modelcache.io/namespaces": "tenant-b"}}}, CRED_NS)
            admin.patch(SECRETS, "storage-config", {"metadata": {"annotations": {
                "namespaces.modelcache.io/team-b": "tenant-b"}}}, CRED_NS)
            # (Other URIs than tenant-a's: caches of one URI share one folder, downloaded with the
            # credentials of the first entry; docs/operations.md, "Threat model".)
            for cache in (ns_cache("own-key", "s3://team-b-private/model-b", storage={"key": "team-b"}),
                          ns_cache("own-sa", "s3://team-b-private/weights-b", serviceAccountName="team-b")):
                out = as_tenant(cluster, tenant_b, "create", "-n", "tenant-b", "-f", "-", stdin=cache)
                assert out.returncode == 0, out.stderr
            wait_until(lambda: origin.seen("Credential=AKIATEAMB/") and origin.seen("Credential=AKIASAB/"),
                       timeout=60, what=f"tenant-b's downloads at the origin\n{agent.log()[-3000:]}")
            # Still refused: each refusal is retried after its backoff (an admin may grant it), so
            # the entry is Downloading for a moment each time; in between, an error saying why.
            status = wait_states(admin, NODE, {"tenant-a/steal-key": err, "tenant-a/steal-sa-s3": err}, agent=agent)
            details = status["modelDetails"]
            assert "not granted to namespace tenant-a" in details["tenant-a/steal-key"]["message"], details
            assert "not granted to namespace tenant-a" in details["tenant-a/steal-sa-s3"]["message"], details
        finally:
            agent.stop()


def test_a_cache_uri_carrying_credentials_is_refused(cluster: Cluster, coordinator: Any) -> None:
    """The review's L2/L3: a URI's password or signature would reach every node's LocalModelNode, a
    download Job's arguments and (hashed) a Node label. The cache webhook refuses it, naming the
    parts and never their values."""
    make_group(cluster.kube(), "workers")
    leaky = ("https://alice:Pa55wordXYZ@models.example/m/model.bin?X-Amz-Signature=PRESIGNEDSIG123"
             "&sv=2022-11-02&sig=SASTOKENSIG456")
    cache = {"apiVersion": "serving.kserve.io/v1alpha1", "kind": "LocalModelCache", "metadata": {"name": "leaky"},
             "spec": {"sourceModelUri": leaky, "modelSize": "10Mi", "nodeGroups": ["workers"]}}
    out = cluster.kubectl("create", "-f", "-", input=json.dumps(cache), check=False)
    assert out.returncode != 0
    assert ("sourceModelUri carries credentials (userinfo, query parameter X-Amz-Signature, query parameter sig)"
            in out.stderr), out.stderr
    assert "Pa55word" not in out.stderr and "PRESIGNEDSIG123" not in out.stderr and "SASTOKENSIG456" not in out.stderr
    cache["spec"]["sourceModelUri"] = "https://models.example/m/model.bin?download=true"
    cluster.kubectl("create", "-f", "-", input=json.dumps(cache))


def test_a_tenant_naming_another_owners_uri_is_not_served_that_folder(cluster: Cluster, coordinator: Any, nginx: Any,
                                                                       tmp_path: Path) -> None:
    """Caches of one URI share one folder (KServe's contract). A tenant's namespace cache of the URI
    of a model someone downloaded with credentials is served that folder (its entry Downloaded,
    then its serving claim) only when it names the same credentials, granted to its namespace."""
    admin = cluster.kube()
    cluster.register_node(NODE, {"kserve/localmodel": "worker"})
    make_group(admin, "workers")
    tenants = {ns: make_tenant(cluster, ns) for ns in ("tenant-a", "tenant-b", "tenant-c")}
    admin.create(SERVICE_ACCOUNTS, {"metadata": {"name": "private", "namespace": CRED_NS, "annotations": {
        "modelcache.io/namespaces": "tenant-b"}}}, CRED_NS)
    private, public = nginx.url("private/model.bin"), nginx.url("public/model.bin")
    nginx.write("private/model.bin", 64 * 1024)
    nginx.write("public/model.bin", 64 * 1024)
    make_cache(admin, "private", private, ["workers"], serviceAccountName="private")
    make_cache(admin, "public", public, ["workers"])
    agent = start_agent(cluster.agent_kubeconfig, NODE, tmp_path / "root", tmp_path)
    try:
        wait_states(admin, NODE, {"private": "ModelDownloaded", "public": "ModelDownloaded"}, agent=agent)
        caches = {"tenant-a": ns_cache("llm", private),  # no credentials: someone else's private model
                  "tenant-b": ns_cache("llm", private, serviceAccountName="private"),  # the same, granted
                  "tenant-c": ns_cache("llm", public)}  # a public model: shared as before
        for ns, cache in caches.items():
            for obj in (cache, isvc("svc", cache["spec"]["sourceModelUri"])):
                out = as_tenant(cluster, tenants[ns], "create", "-n", ns, "-f", "-", stdin=obj)
                assert out.returncode == 0, out.stderr
        status = wait_states(admin, NODE, {"tenant-a/llm": "ModelDownloadError", "tenant-b/llm": "ModelDownloaded",
                                           "tenant-c/llm": "ModelDownloaded"}, agent=agent)
        assert "its URI is also cached with other credentials on this node" in \
            status["modelDetails"]["tenant-a/llm"]["message"]
        for ns in ("tenant-b", "tenant-c"):
            wait_until(lambda n=ns: admin.get_or_none(PERSISTENT_VOLUME_CLAIMS, "llm-workers", n) is not None,
                       timeout=60, what=f"the serving claim of {ns}")
        # Tenant A's serving claim is never made: its namespace cannot mount the folder.
        assert admin.get_or_none(PERSISTENT_VOLUME_CLAIMS, "llm-workers", "tenant-a") is None
        assert admin.get_or_none(PERSISTENT_VOLUMES, "llm-workers-tenant-a") is None
    finally:
        agent.stop()


# -- H4 ------------------------------------------------------------------------------------------


def reader_pod(claim: str, mount: dict[str, Any], name: str = "reader") -> dict[str, Any]:
    """The review's 09-tenant-pvc.sh pod: the serving claim mounted as the tenant likes."""
    return {"apiVersion": "v1", "kind": "Pod", "metadata": {"name": name}, "spec": {
        "containers": [{"name": "c", "image": "busybox", "command": ["sh", "-c", "ls -R /all"],
                        "volumeMounts": [{"name": "root", "mountPath": "/all", **mount}]}],
        "volumes": [{"name": "root", "persistentVolumeClaim": {"claimName": claim}}]}}


def test_a_tenants_serving_claim_is_mounted_read_only_under_its_own_model(cluster: Cluster, coordinator: Any) -> None:
    admin = cluster.kube()
    cluster.register_node(NODE, {"kserve/localmodel": "worker"})
    make_group(admin, "workers")
    tenant_a = make_tenant(cluster, "tenant-a")
    make_tenant(cluster, "tenant-b")
    uri, other_uri = "s3://team-a/model", "s3://team-b/model"
    key = storage_key(uri)
    # Tenant A's cache and service, made by tenant A; tenant B's by the admin.
    for obj in (ns_cache("llm", uri), isvc("svc", uri)):
        out = as_tenant(cluster, tenant_a, "create", "-n", "tenant-a", "-f", "-", stdin=obj)
        assert out.returncode == 0, out.stderr
    make_cache(admin, "llm", other_uri, ["workers"], namespace="tenant-b")
    cluster.kubectl("create", "-n", "tenant-b", "-f", "-", input=json.dumps(isvc("svc", other_uri)))
    # A namespace cache's claim is made once an agent reports its entry downloaded: as the agent.
    wait_until(lambda: len(entries_of(admin, NODE) or []) == 2, timeout=60, what="the entries")
    agent_report(admin, NODE, {"tenant-a/llm": ("ModelDownloaded", uri),
                               "tenant-b/llm": ("ModelDownloaded", other_uri)})

    def volumes() -> list[tuple[str, str, str]]:
        return sorted((res.kind, v["metadata"].get("namespace", ""), v["metadata"]["labels"].get(
            "modelcache.io/storage-key", "")) for res in (PERSISTENT_VOLUMES, PERSISTENT_VOLUME_CLAIMS)
            for v in admin.list(res, label_selector=MANAGED).get("items") or [])

    other_key = storage_key(other_uri)
    want = sorted([("PersistentVolume", "", key), ("PersistentVolume", "", other_key),
                   ("PersistentVolumeClaim", "tenant-a", key), ("PersistentVolumeClaim", "tenant-b", other_key)])
    wait_until(lambda: volumes() == want, timeout=60, what=f"serving volumes: {volumes()}\n{coordinator.log()[-2000:]}")
    pv = admin.get(PERSISTENT_VOLUMES, "llm-workers-tenant-a")
    assert pv["spec"]["local"]["path"] == "/models"  # the group's whole root, as KServe makes it

    def create(pod: dict[str, Any]) -> Any:
        return as_tenant(cluster, tenant_a, "create", "-n", "tenant-a", "-f", "-", stdin=pod)

    refused = f"PersistentVolumeClaim tenant-a/llm-workers (a model cache, PV llm-workers-tenant-a) is mounted " \
              f"read-only at subPath models/{key} or below it only"
    # The review's step: the claim mounted whole, read-write.
    for mount in ({}, {"readOnly": True}, {"subPath": f"models/{key}"},
                  {"subPath": f"models/{storage_key(other_uri)}", "readOnly": True},
                  {"subPath": f"models/{key}x", "readOnly": True}, {"subPath": ".modelcache", "readOnly": True},
                  {"subPathExpr": f"models/{key}", "readOnly": True}):
        out = create(reader_pod("llm-workers", mount))
        assert out.returncode != 0 and "ValidatingAdmissionPolicy 'modelcache-serving-volumes'" in out.stderr, \
            (mount, out.stderr)
        assert refused in out.stderr, out.stderr
    # What KServe's pod mutator mounts (pvc://llm-workers/models/<key>/, read-only), and a sub-path.
    for n, sub in enumerate((f"models/{key}/", f"models/{key}", f"models/{key}/sub/dir")):
        out = create(reader_pod("llm-workers", {"subPath": sub, "readOnly": True}, name=f"ok-{n}"))
        assert out.returncode == 0, (sub, out.stderr)
    # An init container is held to the same; an ephemeral container added later too.
    init = reader_pod("llm-workers", {"subPath": f"models/{key}", "readOnly": True}, name="init")
    init["spec"]["initContainers"] = [{"name": "i", "image": "busybox", "volumeMounts": [
        {"name": "root", "mountPath": "/w"}]}]
    assert "modelcache-serving-volumes" in create(init).stderr
    debug = [{"op": "add", "path": "/spec/ephemeralContainers", "value": [{
        "name": "dbg", "image": "busybox", "volumeMounts": [{"name": "root", "mountPath": "/all"}]}]}]
    # (`edit` does not grant pods/ephemeralcontainers; whoever may debug pods is held to it too.)
    out = cluster.kubectl("patch", "-n", "tenant-a", "pod", "ok-0", "--subresource", "ephemeralcontainers",
                          "--type", "json", "-p", json.dumps(debug), check=False)
    assert out.returncode != 0 and refused in out.stderr, out.stderr
    # Tenant B's claim is another PV, another key: nothing of it is mountable from tenant-a (no
    # claim of that name there), and tenant-a's rule says nothing about tenant-b's pods.
    cluster.kubectl("create", "-n", "tenant-b", "-f", "-", input=json.dumps(
        reader_pod("llm-workers", {"subPath": f"models/{storage_key(other_uri)}", "readOnly": True})))


# -- M4 ------------------------------------------------------------------------------------------


def test_a_namespace_fills_at_most_its_share_of_a_group(cluster: Cluster, coordinator: Any, nginx: Any,
                                                         tmp_path: Path) -> None:
    """The review's 13-fill-group.sh on a default install (no annotation on the group): storageLimit
    1Mi; tenant-b's cache declares 1Ki but is 900 KiB. A namespace's default share is half the
    group's storageLimit: tenant-b's model is refused (real bytes, by the agent; the refusal is on
    its cache too), tenant-a's 300 KiB and the cluster admin's 600 KiB are Downloaded. Then cluster
    caches come first: a second admin model that does not fit (yet) keeps its room from a tenant's
    later one, and nothing downloaded is deleted to make room."""
    admin = cluster.kube()
    cluster.register_node(NODE, {"kserve/localmodel": "worker"})
    make_group(admin, "workers")
    admin.patch(LOCAL_MODEL_NODE_GROUPS, "workers", {"spec": {"storageLimit": "1Mi"}})
    tenant_a, tenant_b = make_tenant(cluster, "tenant-a"), make_tenant(cluster, "tenant-b")
    for name, kib in (("big.bin", 900), ("admin.bin", 600), ("a.bin", 300), ("admin2.bin", 200), ("b.bin", 100)):
        nginx.write(name, kib * 1024)
    default = "(the default: half the group's storageLimit of 1.0 MiB)"
    agent = start_agent(cluster.agent_kubeconfig, NODE, tmp_path / "root", tmp_path)
    try:
        # Declared sizes over the share are refused at once, by the webhook.
        out = as_tenant(cluster, tenant_b, "create", "-n", "tenant-b", "-f", "-",
                        stdin=ns_cache("honest", nginx.url("big.bin"), size="900Ki"))
        assert out.returncode != 0 and f"over its share of 512.0 KiB per node {default}" in out.stderr, out.stderr
        assert "modelcache.io/namespace-storage-limit" in out.stderr, out.stderr
        # A declared size that lies passes the webhook; the agent counts the real bytes.
        out = as_tenant(cluster, tenant_b, "create", "-n", "tenant-b", "-f", "-",
                        stdin=ns_cache("filler", nginx.url("big.bin"), size="1Ki"))
        assert out.returncode == 0, out.stderr
        status = wait_states(admin, NODE, {"tenant-b/filler": "ModelDownloadError"}, agent=agent)
        message = status["modelDetails"]["tenant-b/filler"]["message"]
        why = ("does not fit namespace tenant-b's share of node group 'workers': the model is 900.0 KiB, a "
               f"namespace's caches may hold 512.0 KiB on each node of the group {default}")
        assert why in message and "LocalModelNamespaceCache of tenant-b" in message, message
        assert "set the annotation modelcache.io/namespace-storage-limit" in message, message

        def failures(name: str) -> str:
            conditions = (admin.get(LOCAL_MODEL_NAMESPACE_CACHES, name, "tenant-b").get("status") or {}).get(
                "conditions") or []
            return next((c["message"] for c in conditions if c["type"] == "NoDownloadErrors"), "")

        # The refusal is on the refused cache too, where its owner looks (`kubectl describe`).
        wait_until(lambda: why in failures("filler"), timeout=60, what=f"filler's refusal on it: {failures('filler')}")
        # Another tenant within its share, and the cluster admin's model: both fit.
        out = as_tenant(cluster, tenant_a, "create", "-n", "tenant-a", "-f", "-",
                        stdin=ns_cache("a-model", nginx.url("a.bin"), size="300Ki"))
        assert out.returncode == 0, out.stderr
        make_cache(admin, "admin-model", nginx.url("admin.bin"), ["workers"])
        wait_states(admin, NODE, {"tenant-b/filler": "ModelDownloadError", "tenant-a/a-model": "ModelDownloaded",
                                  "admin-model": "ModelDownloaded"}, agent=agent)
        # 900 KiB held: a second admin model (200 KiB) does not fit, and nothing is deleted for it.
        make_cache(admin, "admin-two", nginx.url("admin2.bin"), ["workers"])
        status = wait_states(admin, NODE, {"admin-two": "ModelDownloadError"}, agent=agent)
        message = status["modelDetails"]["admin-two"]["message"]
        assert "does not fit the node group's storageLimit" in message, message
        assert "namespace caches hold: tenant-a 300.0 KiB)" in message, message  # what keeps it out
        # Tenant-b's 100 KiB would fit storageLimit and its share, but not next to admin-two.
        out = as_tenant(cluster, tenant_b, "create", "-n", "tenant-b", "-f", "-",
                        stdin=ns_cache("small", nginx.url("b.bin"), size="100Ki"))
        assert out.returncode == 0, out.stderr
        status = wait_states(admin, NODE, {"tenant-b/small": "ModelDownloadError"}, agent=agent)
        message = status["modelDetails"]["tenant-b/small"]["message"]
        assert ("namespace tenant-b: does not fit node group 'workers' next to its cluster caches: the model is "
                "100.0 KiB" in message and "LocalModelCache admin-two still need 200.0 KiB here" in message), message
        assert status["modelStatus"]["tenant-a/a-model"] == status["modelStatus"]["admin-model"] == "ModelDownloaded"
        # Tenant-a's model goes: the room is the admin's first, then tenant-b's model fits as well.
        assert as_tenant(cluster, tenant_a, "delete", "-n", "tenant-a", "localmodelnamespacecache",
                         "a-model").returncode == 0
        wait_states(admin, NODE, {"admin-two": "ModelDownloaded", "tenant-b/small": "ModelDownloaded",
                                  "admin-model": "ModelDownloaded", "tenant-b/filler": "ModelDownloadError"},
                    timeout=120, agent=agent)
    finally:
        agent.stop()
