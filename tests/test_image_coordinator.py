"""The image as the coordinator Deployment runs it (deploy/coordinator/deployment.yaml), against the
real control plane (tests/cluster) with in-cluster configuration and deploy/rbac/coordinator.yaml's
identity: the manifest's command, args and env (its own webhook CA and serving pair, in a Secret it
makes), read-only root, no capabilities, uid 1000. It becomes leader on its Lease, the API server
itself calls its validating webhook over TLS (deploy/webhooks/validating.yaml, pointed at the
container, with the CA the container patched in), it reconciles, and it releases the Lease on
SIGTERM."""

from __future__ import annotations

import uuid
from pathlib import Path
from typing import Any

import pytest
import requests
import yaml

from modelcache.kube.client import LEASES, LOCAL_MODEL_CACHES, Kube
from tests.coordinator_util import make_cache, make_group
from tests.fixtures.cluster import COORDINATOR_SA, Cluster
from tests.fixtures.image import Image
from tests.helpers import REPO, free_port, wait_until
from tests.image_pods import SA_PATH, in_cluster_env, manifest_pod, resolve_env, service_account_volume, user_of

# The first test to use `image` also builds it (minutes when the layer cache is cold).
pytestmark = pytest.mark.timeout(900)

URI = "http://models.example/m.bin"


def holder(kube: Kube) -> str | None:
    lease = kube.get_or_none(LEASES, "modelcache-coordinator", "modelcache-system")
    return None if lease is None else (lease.get("spec") or {}).get("holderIdentity")


def validator_to(port: int) -> str:
    """deploy/'s ValidatingWebhookConfiguration with the Service (no kube-proxy or endpoints here)
    replaced by the container's address; the coordinator patches its own CA in."""
    doc = yaml.safe_load((REPO / "deploy" / "webhooks" / "validating.yaml").read_text())
    for hook in doc["webhooks"]:
        path = hook["clientConfig"]["service"]["path"]
        hook["clientConfig"] = {"url": f"https://127.0.0.1:{port}{path}"}
    return yaml.safe_dump(doc)


def cache_yaml(name: str, uri: str, group: str) -> str:
    return yaml.safe_dump({"apiVersion": "serving.kserve.io/v1alpha1", "kind": "LocalModelCache",
                           "metadata": {"name": name},
                           "spec": {"sourceModelUri": uri, "modelSize": "1Gi", "nodeGroups": [group]}})


def test_coordinator_role_in_cluster(image: Image, cluster: Cluster, tmp_path: Path) -> None:
    admin = cluster.kube()
    cluster.register_node("n1", {"kserve/localmodel": "worker"})
    make_group(admin, "workers")

    pod = manifest_pod("coordinator/deployment.yaml", "Deployment")
    [container] = pod["containers"]
    pod_name = f"modelcache-coordinator-{uuid.uuid4().hex[:5]}-x"
    env = {**resolve_env(container, {"metadata.namespace": COORDINATOR_SA[0], "metadata.name": pod_name}),
           **in_cluster_env(cluster)}
    sa = service_account_volume(tmp_path / "serviceaccount", cluster, *COORDINATOR_SA)
    port, hook_port = free_port(), free_port()
    # Host network here: free ports instead of the manifest's 8080/9443, on loopback only; the
    # webhook is called by URL, so its certificate names 127.0.0.1 too.
    extra = [f"--port={port}", f"--webhook-port={hook_port}", "--bind=127.0.0.1", "--webhook-cert-host=127.0.0.1"]
    c = image.start("coordinator", *container["args"], *extra, entrypoint=container["command"][0], env=env,
                    user=user_of(container["securityContext"], pod["securityContext"]),
                    mounts=[(sa, SA_PATH, "ro")])
    try:
        wait_until(lambda: holder(admin) == pod_name, timeout=90, what=f"the container leads ({c.logs()[-2000:]})")
        wait_until(lambda: requests.get(f"http://127.0.0.1:{port}/readyz", timeout=2).status_code == 200,
                   timeout=60, what="readyz")
        assert "modelcache_" in requests.get(f"http://127.0.0.1:{port}/metrics", timeout=5).text

        cluster.kubectl("apply", "-f", "-", input=validator_to(hook_port))
        # The API server calls the container for every cache write, verifying its certificate against
        # the CA the container made (Secret modelcache-webhook-tls) and patched into the configuration.
        wait_until(lambda: cluster.kubectl("create", "-f", "-", input=cache_yaml("c", URI, "workers"),
                                           check=False).returncode == 0,
                   timeout=30, what="the first cache admitted through the webhook")
        dup = cluster.kubectl("create", "-f", "-", input=cache_yaml("c2", URI, "workers"), check=False)
        assert dup.returncode != 0
        assert f"LocalModelCache c has the same StorageURI {URI}" in dup.stderr, dup.stderr
        assert "localmodelcache.modelcache.serving.kserve.io" in dup.stderr  # denied by our webhook

        # As leader it reconciles, with its own RBAC: the cache gets its status.
        def copies() -> Any:
            return ((admin.get(LOCAL_MODEL_CACHES, "c").get("status") or {}).get("copies") or {}).get("total")

        wait_until(lambda: copies() == 1, timeout=60, what=f"status written ({c.logs()[-2000:]})")
        make_cache(admin, "c3", URI + "3", ["workers"])  # another write through the webhook
        assert c.stop() == 0, c.logs()[-3000:]  # SIGTERM: a clean exit ...
        assert holder(admin) in (None, "")  # ... that hands the Lease on at once
        assert "Traceback" not in c.logs()
    finally:
        cluster.kubectl("delete", "validatingwebhookconfiguration", "modelcache-cache-validator",
                        "--ignore-not-found", check=False)
        c.remove()
