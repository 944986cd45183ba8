"""The webhook server trusts only the API server (security review H2 and L1; docs/operations.md,
"Threat model").

- The review's step: one POST of a hand-made AdmissionReview (``DELETE`` of our namespace, with its
  real uid) to the webhook port, with no credentials, released every cache's finalizer and
  deleted every serving volume. Now the uninstall hook is served only at the secret path the
  coordinator puts in its webhook configuration (which only the API server and cluster admins
  read), and the same POST changes nothing.
- Where the API server can be given a client certificate for webhooks (kube-apiserver's
  ``--admission-control-config-file``, as Kubernetes documents it), ``--webhook-client-ca`` makes
  every route require it: a caller without one fails the handshake.
- A connection costs the server at most ``TIMEOUT`` seconds, a bounded body, and one of
  ``MAX_CONNECTIONS`` slots.
"""

from __future__ import annotations

import json
import re
import socket
import ssl
import time
from pathlib import Path
from typing import Any

import pytest
import yaml

from coordinator.httpserve import MAX_BODY, WebhookServer
from coordinator.uninstall import RELEASED_ANNOTATION
from modelcache.kube.client import (
    LOCAL_MODEL_CACHES,
    LOCAL_MODEL_NAMESPACE_CACHES,
    NAMESPACES,
    PERSISTENT_VOLUME_CLAIMS,
    PERSISTENT_VOLUMES,
    Kube,
)
from modelcache.kube.types import CACHE_FINALIZER, NAMESPACE_CACHE_FINALIZER
from tests.coordinator_util import agent_report, entries_of, make_cache, make_group, make_isvc, make_namespace
from tests.deploy_util import NAMESPACE, host_address, serve_webhooks
from tests.fixtures.cluster import Cluster
from tests.helpers import self_trusting_pair, wait_until

pytestmark = pytest.mark.timeout(300)

VALIDATOR = "modelcache-cache-validator"
MANAGED = "app.kubernetes.io/managed-by=modelcache-coordinator"


def post(host: str, port: int, path: str, body: bytes | dict[str, Any], ctx: ssl.SSLContext | None = None,
         timeout: float = 30) -> tuple[int, bytes]:
    """One POST as any pod on the network can send it (no client certificate unless ``ctx`` has one)."""
    if ctx is None:
        ctx = ssl.create_default_context()
        ctx.check_hostname, ctx.verify_mode = False, ssl.CERT_NONE
    data = body if isinstance(body, bytes) else json.dumps(body).encode()
    with socket.create_connection((host, port), timeout=timeout) as raw, ctx.wrap_socket(raw) as s:
        s.sendall(f"POST {path} HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\nContent-Length: "
                  f"{len(data)}\r\nConnection: close\r\n\r\n".encode() + data)
        out = b""
        while chunk := s.recv(65536):
            out += chunk
    head, _, rest = out.partition(b"\r\n\r\n")
    return int(head.split(b" ")[1]), rest


def uninstall_review(uid: str) -> dict[str, Any]:
    """What the review's 10-webhook-direct.py sent: a namespace DELETE, with the real uid."""
    return {"apiVersion": "admission.k8s.io/v1", "kind": "AdmissionReview", "request": {
        "uid": "forged", "operation": "DELETE", "name": NAMESPACE, "kind": {"kind": "Namespace"},
        "oldObject": {"metadata": {"name": NAMESPACE, "uid": uid}}}}


def uninstall_path(cluster: Cluster) -> str:
    config = json.loads(cluster.kubectl("get", "validatingwebhookconfiguration", VALIDATOR, "-o", "json").stdout)
    (hook,) = [h for h in config["webhooks"] if h["name"] == "uninstall.modelcache.serving.kserve.io"]
    return str(hook["clientConfig"]["service"]["path"])


def held(admin: Kube) -> dict[str, Any]:
    """What the uninstall release would change: finalizers, its mark, the serving volumes."""
    lmc = admin.get(LOCAL_MODEL_CACHES, "llm")["metadata"]
    lmnc = admin.get(LOCAL_MODEL_NAMESPACE_CACHES, "nsllm", "team")["metadata"]
    volumes = [(res.kind, v) for res, ns in ((PERSISTENT_VOLUME_CLAIMS, "team"), (PERSISTENT_VOLUMES, None))
               for v in admin.list(res, ns, label_selector=MANAGED).get("items") or []]
    return {"finalizers": (CACHE_FINALIZER in (lmc.get("finalizers") or []),
                           NAMESPACE_CACHE_FINALIZER in (lmnc.get("finalizers") or [])),
            "released": [m.get("annotations", {}).get(RELEASED_ANNOTATION) for m in (lmc, lmnc)],
            "volumes": sorted((kind, v["metadata"]["name"], bool(v["metadata"].get("deletionTimestamp")))
                              for kind, v in volumes)}


def test_an_unauthenticated_uninstall_changes_nothing(cluster: Cluster, tmp_path: Path) -> None:
    admin = cluster.kube()
    coordinator = serve_webhooks(cluster, tmp_path / "coordinator")
    try:
        # The coordinator put a secret into the uninstall webhook's path (the manifest says /uninstall).
        wait_until(lambda: re.fullmatch(r"/uninstall/[0-9a-f]{64}", uninstall_path(cluster)) is not None,
                   timeout=30, what=f"the uninstall path's secret\n{coordinator.log()[-2000:]}")
        secret_path = uninstall_path(cluster)

        # Caches held with finalizers, and serving volumes (as in the review).
        cluster.register_node("gpu-1", {"kserve/localmodel": "worker"})
        make_group(admin, "workers")
        make_namespace(admin, "team")
        make_cache(admin, "llm", "s3://models/llm", ["workers"])
        make_cache(admin, "nsllm", "s3://models/nsllm", ["workers"], namespace="team")
        make_isvc(admin, "svc", "team", "s3://models/llm")
        make_isvc(admin, "svc2", "team", "s3://models/nsllm")
        # A namespace cache's claim is made once an agent reports its entry downloaded: as the agent.
        wait_until(lambda: len(entries_of(admin, "gpu-1") or []) == 2, timeout=60, what="the entries")
        agent_report(admin, "gpu-1", {"team/nsllm": ("ModelDownloaded", "s3://models/nsllm")})
        want = {"finalizers": (True, True), "released": [None, None],
                "volumes": sorted([("PersistentVolume", "llm-workers-team", False),
                                   ("PersistentVolume", "nsllm-workers-team", False),
                                   ("PersistentVolumeClaim", "llm-workers", False),
                                   ("PersistentVolumeClaim", "nsllm-workers", False)])}
        wait_until(lambda: held(admin) == want, timeout=60, what=f"finalizers and volumes: {held(admin)}")

        # The review's step: the namespace's real uid (any reader of namespaces has it), no credentials.
        uid = admin.get(NAMESPACES, NAMESPACE)["metadata"]["uid"]
        host, port = host_address(), coordinator.webhook_port
        for path in ("/uninstall", "/uninstall/" + "0" * 64, secret_path + "x", secret_path.upper()):
            status, body = post(host, port, path, uninstall_review(uid))
            assert status == 404, (path, status, body)
        time.sleep(5)  # the leader reconciles within this; the review saw the release persist after 17 s
        assert held(admin) == want
        assert "released the finalizers" not in coordinator.log()
        assert "POST uninstall from" in coordinator.log() and secret_path not in coordinator.log()

        # The same request at the configuration's path (what the API server sends) is acted on: the
        # path is what told them apart. A dry run first: no side effect (sideEffects: NoneOnDryRun).
        dry = uninstall_review(uid)
        dry["request"]["dryRun"] = True
        assert post(host, port, secret_path, dry)[0] == 200
        assert held(admin) == want
        status, body = post(host, port, secret_path, uninstall_review("made-up"))
        assert status == 200 and "released the finalizers of 2 caches" in body.decode(), body
        # Marked with the uid the API gives for the namespace, not with the one in the body.
        assert held(admin)["released"] == [uid, uid]
    finally:
        coordinator.stop()


# -- mutual TLS ----------------------------------------------------------------------------------


def admission_config(folder: Path, cert: Path, key: Path) -> Path:
    """kube-apiserver's --admission-control-config-file: its client certificate for our webhook
    Service (the user named <service>.<namespace>.svc), as Kubernetes documents it."""
    kubeconfig = folder / "webhook-kubeconfig.yaml"
    kubeconfig.write_text(yaml.safe_dump({"apiVersion": "v1", "kind": "Config", "users": [{
        "name": f"modelcache-coordinator-webhook.{NAMESPACE}.svc",
        "user": {"client-certificate": str(cert), "client-key": str(key)}}]}))
    plugin = {"apiVersion": "apiserver.config.k8s.io/v1", "kind": "WebhookAdmissionConfiguration",
              "kubeConfigFile": str(kubeconfig)}
    config = folder / "admission.yaml"
    config.write_text(yaml.safe_dump({"apiVersion": "apiserver.config.k8s.io/v1", "kind": "AdmissionConfiguration",
                                      "plugins": [{"name": name, "configuration": plugin} for name in
                                                  ("ValidatingAdmissionWebhook", "MutatingAdmissionWebhook")]}))
    return config


def client_context(ca: Any, name: str) -> ssl.SSLContext:
    ctx = ssl.create_default_context()
    ctx.check_hostname, ctx.verify_mode = False, ssl.CERT_NONE
    ca.issue_cert(name).configure_cert(ctx)
    return ctx


def test_with_a_client_ca_only_the_api_server_certificate_is_served(cluster_factory: Any, tmp_path: Path) -> None:
    import trustme

    ca = trustme.CA(organization_name="webhook clients")
    folder = tmp_path / "apiserver"
    folder.mkdir()
    leaf = ca.issue_cert("kube-apiserver-webhook-client")
    cert, key = folder / "client.crt", folder / "client.key"
    leaf.cert_chain_pems[0].write_to_path(str(cert))
    leaf.private_key_pem.write_to_path(str(key))
    ca_file = folder / "clients-ca.crt"
    ca.cert_pem.write_to_path(str(ca_file))
    cluster = cluster_factory(apiserver_args=("--admission-control-config-file",
                                              str(admission_config(folder, cert, key))))
    admin = cluster.kube()
    coordinator = serve_webhooks(cluster, tmp_path / "coordinator", "--webhook-client-ca", str(ca_file),
                                 "--webhook-client-name", "kube-apiserver-webhook-client")
    try:
        make_group(admin, "workers")
        # The API server's calls are served: the fail-closed validator admits one cache, refuses its twin.
        spec = {"sourceModelUri": "s3://m/llm", "modelSize": "1Gi", "nodeGroups": ["workers"]}
        cache = yaml.safe_dump({"apiVersion": "serving.kserve.io/v1alpha1", "kind": "LocalModelCache",
                                "metadata": {"name": "llm"}, "spec": spec})
        wait_until(lambda: cluster.kubectl("create", "-f", "-", input=cache, check=False).returncode == 0,
                   timeout=30, what=f"a cache admitted\n{coordinator.log()[-2000:]}")
        twin = cluster.kubectl("create", "-f", "-", input=cache.replace("name: llm", "name: llm2"), check=False)
        assert "LocalModelCache llm has the same StorageURI s3://m/llm" in twin.stderr, twin.stderr

        host, port = host_address(), coordinator.webhook_port
        review = {"apiVersion": "admission.k8s.io/v1", "kind": "AdmissionReview",
                  "request": {"uid": "1", "operation": "CREATE", "object": {}}}
        # No certificate: the handshake fails (nothing is read, nothing answered).
        with pytest.raises((ssl.SSLError, ConnectionError)):
            post(host, port, "/validate-localmodelcaches", review)
        # A certificate of that CA for another name: refused.
        assert post(host, port, "/validate-localmodelcaches", review,
                    client_context(ca, "some-workload"))[0] == 403
        # Another CA's certificate for the right name: the handshake fails.
        with pytest.raises((ssl.SSLError, ConnectionError)):
            post(host, port, "/validate-localmodelcaches", review,
                 client_context(trustme.CA(), "kube-apiserver-webhook-client"))
        # The API server's name and CA: served.
        assert post(host, port, "/validate-localmodelcaches", review,
                    client_context(ca, "kube-apiserver-webhook-client"))[0] == 200
    finally:
        coordinator.stop()


# -- what a connection may cost ------------------------------------------------------------------


@pytest.fixture
def small_server(tmp_path: Path) -> Any:
    """The webhook server with one echo route, a 1 s timeout and 8 connection slots."""
    from coordinator.certs import load_tls

    self_trusting_pair(tmp_path / "tls", "127.0.0.1")
    tls = load_tls(tmp_path / "tls")
    server = WebhookServer("127.0.0.1", 0, {"/echo": lambda r: {"response": {"allowed": True}}}, tls.context,
                           max_connections=8, timeout=1.0).start()
    yield server
    server.stop()



def test_idle_connections_are_closed_and_slots_are_bounded(small_server: Any) -> None:
    port = small_server.port
    # The review's "slow" step: TCP connections that never start TLS.
    idle = [socket.create_connection(("127.0.0.1", port), timeout=5) for _ in range(8)]
    time.sleep(0.3)
    # Every slot is taken: one more is closed at once, without a handshake.
    extra = socket.create_connection(("127.0.0.1", port), timeout=5)
    assert extra.recv(1) == b""
    extra.close()
    # Each idle one is closed after the timeout; then requests are served again.
    for s in idle:
        s.settimeout(5)
        assert s.recv(1) == b"", "an idle connection was kept past the handshake timeout"
        s.close()
    assert post("127.0.0.1", port, "/echo", {"request": {"uid": "1"}})[0] == 200


def test_bodies_are_bounded_and_must_be_admission_reviews(small_server: Any) -> None:
    port = small_server.port
    # Refused on its Content-Length alone: the body is never read.
    ctx = ssl.create_default_context()
    ctx.check_hostname, ctx.verify_mode = False, ssl.CERT_NONE
    with socket.create_connection(("127.0.0.1", port)) as raw, ctx.wrap_socket(raw) as s:
        s.sendall(f"POST /echo HTTP/1.1\r\nHost: x\r\nContent-Length: {MAX_BODY + 1}\r\n\r\n".encode())
        assert s.recv(4096).split(b" ")[1] == b"413"
    # The review's 8 MiB of `[[],[],...]` now costs at most MAX_BODY and answers 400 (it was a 500).
    n = (MAX_BODY - 2) // 3
    blob = b"[" + b"[]," * (n - 1) + b"[]]"
    assert len(blob) <= MAX_BODY
    assert post("127.0.0.1", port, "/echo", blob)[0] == 400
    assert post("127.0.0.1", port, "/echo", b"{not json")[0] == 400
    assert post("127.0.0.1", port, "/echo", {"request": {"uid": "1"}})[0] == 200
