"""Helpers for tests of deploy/ on the real control plane: render it, run its coordinator as the
Deployment would (a process with the Deployment's command, args and env, authenticated with its
ServiceAccount's token: there is no kubelet), and make the webhook Service reach that process."""

from __future__ import annotations

import os
import socket
import subprocess
import sys
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import yaml

from tests.cluster.build import BIN
from tests.fixtures.cluster import COORDINATOR_SA, Cluster, require_binaries
from tests.helpers import REPO, free_port, stop_process, wait_until

DEPLOY = REPO / "deploy"
NAMESPACE = "modelcache-system"
WEBHOOK_SERVICE = "modelcache-coordinator-webhook"
Obj = dict[str, Any]


def render(path: Path = DEPLOY) -> list[Obj]:
    """`kubectl kustomize` with the kubectl built beside the test control plane."""
    require_binaries()
    out = subprocess.run([str(BIN / "kubectl"), "kustomize", str(path)], capture_output=True, text=True,
                         check=True).stdout
    return [d for d in yaml.safe_load_all(out) if d]


def find(docs: list[Obj], kind: str, name: str) -> Obj:
    matches = [d for d in docs if d["kind"] == kind and d["metadata"]["name"] == name]
    assert len(matches) == 1, f"expected one {kind}/{name}, found {len(matches)}"
    return matches[0]


def host_address() -> str:
    """This machine's address on its default route: what a pod IP would be (not loopback, which an
    EndpointSlice may not hold)."""
    with socket.socket(socket.AF_INET, socket.SOCK_DGRAM) as s:
        s.connect(("192.0.2.1", 53))  # no packet is sent: this only picks the route's source address
        return str(s.getsockname()[0])


def publish_webhook_endpoint(cluster: Cluster, port: int, address: str | None = None) -> None:
    """An EndpointSlice for the webhook Service pointing at ``address:port``: what the EndpointSlice
    controller publishes for a ready coordinator pod. The API server reaches Service webhooks
    through their endpoints (--enable-aggregator-routing; there is no kube-proxy)."""
    slice_ = {
        "apiVersion": "discovery.k8s.io/v1", "kind": "EndpointSlice",
        "metadata": {"name": f"{WEBHOOK_SERVICE}-test", "namespace": NAMESPACE, "labels": {
            "kubernetes.io/service-name": WEBHOOK_SERVICE,
            "endpointslice.kubernetes.io/managed-by": "tests.modelcache.io"}},
        "addressType": "IPv4",
        "endpoints": [{"addresses": [address or host_address()], "conditions": {"ready": True}}],
        "ports": [{"name": "webhook", "port": port, "protocol": "TCP"}],
    }
    cluster.kubectl("apply", "-f", "-", input=yaml.safe_dump(slice_))


@dataclass
class CoordinatorProc:
    proc: subprocess.Popen[bytes]
    log_path: Path
    port: int
    webhook_port: int
    args: list[str] = field(default_factory=list)

    def log(self) -> str:
        return self.log_path.read_text(errors="replace") if self.log_path.exists() else ""

    def stop(self) -> None:
        stop_process(self.proc)


def start_deployed_coordinator(cluster: Cluster, workdir: Path, *extra: str, pod_name: str = "coordinator-0",
                               docs: list[Obj] | None = None, code: Path = REPO,
                               mounts: dict[str, Path] | None = None) -> CoordinatorProc:
    """``modelcache-coordinator`` with deploy/'s args and env, as its ServiceAccount; health and
    webhook ports are free ones (the pod's 8080/9443 may be taken on this machine). ``docs``,
    ``code``: another release's manifests and source; ``mounts``: a directory standing for each
    mount path in the args (there is no container here)."""
    docs = docs or render()
    dep = find(docs, "Deployment", "modelcache-coordinator")
    (container,) = dep["spec"]["template"]["spec"]["containers"]
    assert container["command"] == ["modelcache-coordinator"]
    port, webhook_port = free_port(), free_port()
    args = list(container["args"])
    for mount_path, directory in (mounts or {}).items():
        args = [a.replace(mount_path, str(directory)) for a in args]
    args += ["--port", str(port), "--webhook-port", str(webhook_port), *extra]
    env = {k: v for k, v in os.environ.items() if not k.startswith("KUBECONFIG")}
    env.update({"POD_NAMESPACE": dep["metadata"]["namespace"], "POD_NAME": pod_name,
                "KUBECONFIG": str(cluster.kubeconfig_for(*COORDINATOR_SA)),
                "TMPDIR": str(workdir / "tmp")})  # its own: what it leaves there is checked
    (workdir / "tmp").mkdir(parents=True, exist_ok=True)
    log_path = workdir / f"{pod_name}.log"
    with open(log_path, "wb") as out:
        proc = subprocess.Popen([sys.executable, "-m", "coordinator", *args], cwd=code, stdout=out,
                                stderr=subprocess.STDOUT, env=env)
    c = CoordinatorProc(proc, log_path, port, webhook_port, args)
    try:
        wait_until(lambda: _ready(port) or proc.poll() is not None, timeout=60, what="coordinator /readyz")
    except TimeoutError:
        c.stop()
        raise AssertionError(f"coordinator not ready; log:\n{c.log()[-4000:]}") from None
    if proc.poll() is not None:
        raise AssertionError(f"coordinator exited {proc.returncode}; log:\n{c.log()[-4000:]}")
    return c


def _ready(port: int) -> bool:
    import urllib.request

    try:
        with urllib.request.urlopen(f"http://127.0.0.1:{port}/readyz", timeout=2) as resp:
            return bool(resp.status == 200)
    except OSError:
        return False


def serve_webhooks(cluster: Cluster, workdir: Path, *extra: str) -> CoordinatorProc:
    """deploy/'s webhook Service and configurations on a cluster with the baseline, and its
    coordinator serving them (the API server calls it through the Service, with the CA the
    coordinator patches in). Stop the returned process."""
    cluster.kubectl("apply", "-f", str(DEPLOY / "coordinator" / "service.yaml"), "-f", str(DEPLOY / "webhooks"))
    coordinator = start_deployed_coordinator(cluster, workdir, *extra)
    try:
        publish_webhook_endpoint(cluster, coordinator.webhook_port)
    except BaseException:
        coordinator.stop()
        raise
    return coordinator


def image_overlay(folder: Path, ref: str, host_root: str | None = None) -> Path:
    """A kustomize overlay of deploy/ that only sets the image reference (to ``ref``, an image a
    test built), as a user's overlay for a private registry does: `kubectl apply -k` it. The tag is
    not `latest`, so the pull policy stays IfNotPresent and a node that has the image runs it.
    ``host_root``: the agents' host folder (volume ``hostroot``) set as deploy/agent/daemonset.yaml
    says to change it."""
    shipped = next(i for i in yaml.safe_load((DEPLOY / "kustomization.yaml").read_text())["images"])
    name, _, tag = ref.rpartition(":")
    assert name and tag and tag != "latest", f"{ref}: an image reference with a tag other than latest"
    folder.mkdir(parents=True, exist_ok=True)
    kustomization: Obj = {
        "apiVersion": "kustomize.config.k8s.io/v1beta1", "kind": "Kustomization",
        "resources": [os.path.relpath(DEPLOY, folder)],
        "images": [{"name": shipped["newName"], "newName": name, "newTag": tag}],
    }
    if host_root:
        kustomization["patches"] = [{"patch": yaml.safe_dump({
            "apiVersion": "apps/v1", "kind": "DaemonSet",
            "metadata": {"name": "modelcache-agent", "namespace": NAMESPACE},
            "spec": {"template": {"spec": {"volumes": [
                {"name": "hostroot", "hostPath": {"path": host_root, "type": "DirectoryOrCreate"}}]}}}})}]
    (folder / "kustomization.yaml").write_text(yaml.safe_dump(kustomization))
    return folder
