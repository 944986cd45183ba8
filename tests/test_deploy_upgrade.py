"""An upgrade from the previous release's manifests and code (main's deploy/ before this work, pinned
below) to these, on the real control plane, in the documented order (docs/operations.md,
"Upgrade"): every Downloaded model stays Downloaded, on disk untouched and not fetched again, and
afterwards the agent can no longer read the webhook's Secrets."""

from __future__ import annotations

import base64
import contextlib
import json
import subprocess
import sys
import tarfile
import threading
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
import yaml
from kubernetes.client.exceptions import ApiException

from coordinator.nodelabels import model_label
from modelcache.kube.client import LOCAL_MODEL_CACHES, LOCAL_MODEL_NODES, NODES, PODS, Kube
from modelcache.sources.uri import storage_key
from tests.agent_util import model_files, start_agent
from tests.coordinator_util import make_group
from tests.deploy_util import DEPLOY, NAMESPACE, publish_webhook_endpoint, render, start_deployed_coordinator
from tests.fixtures.cluster import AGENT_SA, Cluster
from tests.helpers import REPO, require, wait_until
from tests.test_agent_hostpath import agent_pod
from tests.test_deploy_install import cache_yaml

pytestmark = pytest.mark.timeout(600)

#: main as of 2026-12-01, before issue 18: deploy/ with a cert-manager Secret and MODELCACHE_HOST_PATH.
PREVIOUS = "79a127aecabd64bc40b2d923c7bba7bde43da3af"
SERVICE_DNS = "modelcache-coordinator-webhook.modelcache-system.svc"


@contextlib.contextmanager
def kubelet_confirms_pod_deletions(kube: Kube) -> Iterator[None]:
    """What the kubelets would do for our pods (the DaemonSet's and the Deployment's, bound to
    registered Nodes): confirm a graceful deletion once the containers stopped. Without it no pod,
    hence no namespace, ever finishes deleting here (docs/test-cluster.md, "API-only Nodes and
    why"; the uninstall with kubelets: tests/test_realnodes_deploy.py)."""
    stop = threading.Event()

    def run() -> None:
        while not stop.wait(0.5):
            try:
                for pod in kube.list(PODS, NAMESPACE).get("items") or []:
                    if pod["metadata"].get("deletionTimestamp"):
                        kube.delete(PODS, pod["metadata"]["name"], NAMESPACE, grace_period=0)
            except ApiException:
                pass  # the namespace is going; try again

    thread = threading.Thread(target=run, daemon=True)
    thread.start()
    try:
        yield
    finally:
        stop.set()
        thread.join(5)


def previous_release(into: Path) -> Path:
    """The previous release's source tree (manifests and code) from git."""
    into.mkdir(parents=True)
    archive = into / "previous.tar"
    out = subprocess.run(["git", "-C", str(REPO), "archive", "-o", str(archive), PREVIOUS, "deploy", "agent",
                          "coordinator", "modelcache"], capture_output=True, text=True)
    require(out.returncode == 0, f"commit {PREVIOUS} of this repository (git archive: {out.stderr.strip()})")
    with tarfile.open(archive) as tar:
        tar.extractall(into, filter="data")
    return into


def downloaded(kube: Kube, node: str, key: str) -> bool:
    lmn = kube.get_or_none(LOCAL_MODEL_NODES, node) or {}
    return ((lmn.get("status") or {}).get("modelStatus") or {}).get(key) == "ModelDownloaded"


def test_upgrade_from_the_previous_manifests_keeps_every_downloaded_model(
    cluster_factory: Any, nginx: Any, tmp_path: Path
) -> None:
    old = previous_release(tmp_path / "previous")
    cluster: Cluster = cluster_factory(baseline=False)
    admin = cluster.kube()
    nginx.write("llm/model.bin", 2 << 20)
    nginx.write("llm2/model.bin", 1 << 20)
    uri = nginx.url("llm/model.bin")
    key = storage_key(uri)
    host = tmp_path / "models"  # the node's model root

    # --- the previous release, installed as its README said: kustomize, then the webhook Secret
    # made by hand and its CA set on both webhook configurations.
    cluster.kubectl("apply", "-k", str(old / "deploy"))
    cluster.kubectl("wait", "--for", "condition=Established", "--timeout", "60s", "crd", "--all")
    certs = tmp_path / "old-certs"
    subprocess.run([sys.executable, "-m", "coordinator.certs", str(certs), SERVICE_DNS], cwd=old, check=True)
    cluster.kubectl("-n", NAMESPACE, "create", "secret", "tls", "modelcache-webhook-cert",
                    f"--cert={certs / 'tls.crt'}", f"--key={certs / 'tls.key'}")
    ca = base64.b64encode((certs / "tls.crt").read_bytes()).decode()
    for kind, name, count in (("mutatingwebhookconfiguration", "modelcache-pod-mutator", 1),
                              ("validatingwebhookconfiguration", "modelcache-cache-validator", 2)):
        patch = [{"op": "add", "path": f"/webhooks/{i}/clientConfig/caBundle", "value": ca} for i in range(count)]
        cluster.kubectl("patch", kind, name, "--type=json", "-p", json.dumps(patch))
    old_docs = render(old / "deploy")
    coordinator = start_deployed_coordinator(cluster, tmp_path / "old-coordinator", docs=old_docs, code=old,
                                             mounts={"/etc/modelcache/webhook-certs": certs})
    publish_webhook_endpoint(cluster, coordinator.webhook_port)
    cluster.register_node("gpu-1", {"kserve/localmodel": "worker"})
    make_group(admin, "workers", path=str(host))
    # The previous agent with its DaemonSet's env (MODELCACHE_HOST_PATH=/models, credentials in its namespace).
    old_env = {"MODELCACHE_HOST_PATH": "/models", "POD_NAMESPACE": NAMESPACE}
    agent = start_agent(cluster.kubeconfig_for(*AGENT_SA), "gpu-1", host, tmp_path / "old-agent", env=old_env,
                        code=old)
    try:
        wait_until(lambda: cluster.kubectl("create", "-f", "-", input=cache_yaml("llm", uri, ["workers"]),
                                           check=False).returncode == 0, timeout=30, what="the cache admitted")
        wait_until(lambda: downloaded(admin, "gpu-1", "llm"), timeout=90, what=f"Downloaded ({agent.log()[-2000:]})")
    finally:
        agent.stop()  # the rollout replaces the pods
        coordinator.stop()
    inode = (host / "models" / key / "model.bin").stat().st_ino
    entries = admin.get(LOCAL_MODEL_NODES, "gpu-1")["spec"]["localModels"]
    nginx.clear_access_log()

    # --- the upgrade, as docs/operations.md says: apply, then delete what the new manifests no
    # longer have (kubectl apply does not prune).
    cluster.kubectl("apply", "-k", str(DEPLOY))
    cluster.kubectl("-n", NAMESPACE, "delete", "role,rolebinding", "modelcache-agent-credentials")
    cluster.kubectl("-n", NAMESPACE, "delete", "secret", "modelcache-webhook-cert")
    coordinator = start_deployed_coordinator(cluster, tmp_path / "new-coordinator", pod_name="coordinator-1")
    publish_webhook_endpoint(cluster, coordinator.webhook_port)
    _pod, env = agent_pod(admin, "gpu-1", host)
    agent = start_agent(cluster.kubeconfig_for(*AGENT_SA), "gpu-1", host, tmp_path / "new-agent", env=env,
                        name="new")
    try:
        wait_until(lambda: "model present" in agent.log(), timeout=30, what=f"the agent found its model "
                                                                            f"({agent.log()[-2000:]})")
        # The new coordinator serves its own certificate, and the API server calls it.
        second = cache_yaml("llm2", nginx.url("llm2/model.bin"), ["workers"])
        wait_until(lambda: cluster.kubectl("create", "-f", "-", input=second, check=False).returncode == 0, timeout=60,
                   what=f"a cache admitted after the upgrade ({coordinator.log()[-2000:]})")
        wait_until(lambda: downloaded(admin, "gpu-1", "llm2"), timeout=90, what="a new model downloaded")
        # Every model downloaded before is still Downloaded, the same file, never fetched again.
        assert downloaded(admin, "gpu-1", "llm")
        assert (host / "models" / key / "model.bin").stat().st_ino == inode
        assert model_files(host, key) == {"model.bin": 2 << 20}
        assert nginx.requests_for("llm/model.bin", method=None) == [] and nginx.requests_for("llm2/model.bin")
        assert admin.get(LOCAL_MODEL_NODES, "gpu-1")["spec"]["localModels"][0] == entries[0]
        copies = (admin.get(LOCAL_MODEL_CACHES, "llm").get("status") or {}).get("copies") or {}
        assert copies.get("available") == 1
        assert admin.get(NODES, "gpu-1")["metadata"]["labels"].get(model_label(uri)) == "true"
        assert "deleted" not in agent.log().replace("nothing is deleted", "")
    finally:
        agent.stop()
    # The agent reads no Secret of modelcache-system any more.
    can = cluster.kubectl("auth", "can-i", "get", "secrets", "-n", NAMESPACE, "--as",
                          f"system:serviceaccount:{NAMESPACE}:modelcache-agent", check=False)
    assert can.stdout.strip() == "no"
    assert yaml.safe_load(cluster.kubectl("get", "validatingwebhookconfiguration", "modelcache-cache-validator",
                                          "-o", "yaml").stdout)["metadata"].get("annotations", {}).get(
        "cert-manager.io/inject-ca-from") is None
    with kubelet_confirms_pod_deletions(admin):
        out = cluster.kubectl("delete", "-k", str(DEPLOY), "--timeout", "180s", check=False, timeout=240)
    coordinator.stop()
    assert out.returncode == 0, out.stderr
