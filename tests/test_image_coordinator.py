"""The image as the coordinator Deployment runs it (deploy/coordinator/deployment.yaml): the
webhook certificate mounted as a Secret volume at /etc/modelcache/webhook-certs, read-only root,
no capabilities, uid 1000. It starts, becomes leader on its Lease, answers admission reviews over
TLS with that certificate, reconciles, and releases the Lease on SIGTERM."""

from __future__ import annotations

import uuid
from pathlib import Path
from typing import Any

import requests

from coordinator.certs import generate_self_signed
from modelcache.kube.client import LEASES, LOCAL_MODEL_CACHES, Kube, load_api_client
from tests.coordinator_util import make_cache, make_group, make_namespace, make_node
from tests.fixtures.image import Image, secret_volume
from tests.fixtures.kubeapi import KubeAPI
from tests.helpers import free_port, wait_until

CERT_DIR = "/etc/modelcache/webhook-certs"  # deploy/coordinator/deployment.yaml's mountPath
SERVICE_DNS = "modelcache-coordinator-webhook.modelcache-system.svc"
URI = "http://models.example/m.bin"


def holder(kube: Kube) -> str | None:
    lease = kube.get_or_none(LEASES, "modelcache-coordinator", "modelcache-system")
    return None if lease is None else (lease.get("spec") or {}).get("holderIdentity")


def review(port: int, ca: Path, obj: dict[str, Any]) -> dict[str, Any]:
    body = {"apiVersion": "admission.k8s.io/v1", "kind": "AdmissionReview",
            "request": {"uid": str(uuid.uuid4()), "operation": "CREATE", "object": obj}}
    resp = requests.post(f"https://127.0.0.1:{port}/validate-localmodelcaches", json=body, verify=str(ca), timeout=10)
    assert resp.status_code == 200, resp.text
    assert resp.json()["response"]["uid"] == body["request"]["uid"]
    return resp.json()["response"]


def cache_obj(name: str, uri: str, group: str) -> dict[str, Any]:
    return {"metadata": {"name": name}, "spec": {"sourceModelUri": uri, "modelSize": "1Gi", "nodeGroups": [group]}}


def test_coordinator_role(image: Image, kubeapi: KubeAPI, tmp_path: Path) -> None:
    kube = Kube(load_api_client(str(kubeapi.kubeconfig)))
    make_namespace(kube, "modelcache-system")
    make_node(kube, "n1", **{"kserve/localmodel": "worker"})
    make_group(kube, "workers")
    crt, key = generate_self_signed(tmp_path / "pair", [SERVICE_DNS, "127.0.0.1"])
    certs = secret_volume(tmp_path / "secret", {"tls.crt": crt.read_bytes(), "tls.key": key.read_bytes()})
    kubeconfig = tmp_path / "kubeconfig"
    kubeconfig.write_bytes(kubeapi.kubeconfig.read_bytes())
    kubeconfig.chmod(0o644)
    port, hook_port = free_port(), free_port()
    pod = f"modelcache-coordinator-{uuid.uuid4().hex[:5]}"
    c = image.start(
        "coordinator", f"--webhook-cert-dir={CERT_DIR}", "--bind=127.0.0.1", f"--port={port}",
        f"--webhook-port={hook_port}",
        entrypoint="modelcache-coordinator",
        env={"POD_NAMESPACE": "modelcache-system", "POD_NAME": pod, "KUBECONFIG": "/etc/modelcache/kubeconfig"},
        mounts=[(certs, CERT_DIR, "ro"), (kubeconfig, "/etc/modelcache/kubeconfig", "ro")],
    )
    try:
        wait_until(lambda: holder(kube) == pod, timeout=60, what=f"the container leads ({c.logs()[-2000:]})")
        wait_until(lambda: requests.get(f"http://127.0.0.1:{port}/readyz", timeout=2).status_code == 200,
                   timeout=60, what="readyz")
        assert "modelcache_" in requests.get(f"http://127.0.0.1:{port}/metrics", timeout=5).text
        # The webhook server presents the mounted certificate: verified against it, for the IP SAN.
        ok = review(hook_port, crt, cache_obj("c2", URI + "2", "workers"))
        assert ok["allowed"] is True
        bad = review(hook_port, crt, cache_obj("c3", URI, "missing"))
        assert bad["allowed"] is False and "missing" in bad["status"]["message"]
        # As leader it reconciles: a cache gets its status from the container's controllers.
        make_cache(kube, "c", URI, ["workers"])
        wait_until(lambda: ((kube.get(LOCAL_MODEL_CACHES, "c").get("status") or {}).get("copies") or {})
                   .get("total") == 1, timeout=60, what=f"status written ({c.logs()[-2000:]})")
        assert c.stop() == 0, c.logs()[-3000:]  # SIGTERM: a clean exit ...
        assert holder(kube) in (None, "")  # ... that hands the Lease on at once
        assert "Traceback" not in c.logs()
    finally:
        c.remove()
