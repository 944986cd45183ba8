"""The test control plane itself: `python -m tests.cluster up`, what it runs, and the shared
fixture's reset between tests."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
from pathlib import Path

import pytest

from tests.cluster.build import BIN, kubernetes_version
from tests.fixtures.cluster import Cluster
from tests.helpers import REPO, wait_until

pytestmark = pytest.mark.timeout(240)


def _children_of(pid: int) -> set[int]:
    """Every process whose parent chain leads to ``pid`` (from /proc)."""
    parents: dict[int, int] = {}
    for entry in Path("/proc").iterdir():
        if entry.name.isdigit():
            try:
                fields = (entry / "stat").read_text().rsplit(")", 1)[1].split()
            except OSError:
                continue
            parents[int(entry.name)] = int(fields[1])
    found: set[int] = set()
    frontier = {pid}
    while frontier:
        frontier = {p for p, parent in parents.items() if parent in frontier} - found
        found |= frontier
    return found


def test_up_runs_a_real_control_plane_with_ready_nodes_and_stops_everything(tmp_path: Path,
                                                                            kube_binaries: Path) -> None:
    workdir = tmp_path / "cp"
    proc = subprocess.Popen([sys.executable, "-m", "tests.cluster", "up", str(workdir), "--nodes", "2"], cwd=REPO,
                            stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    try:
        line = proc.stdout.readline() if proc.stdout else ""
        assert line.startswith("ready "), f"first line {line!r}; stderr: {proc.stderr.read() if proc.stderr else ''}"
        assert float(line.split()[1]) > 0
        kubeconfig = workdir / "kubeconfig"
        kubectl = [str(BIN / "kubectl"), "--kubeconfig", str(kubeconfig)]

        version = json.loads(subprocess.run([*kubectl, "version", "-o", "json"], capture_output=True, text=True,
                                            check=True).stdout)
        assert version["serverVersion"]["gitVersion"] == kubernetes_version()
        assert version["clientVersion"]["gitVersion"] == kubernetes_version()

        nodes = json.loads(subprocess.run([*kubectl, "get", "nodes", "-o", "json"], capture_output=True, text=True,
                                          check=True).stdout)["items"]
        assert sorted(n["metadata"]["name"] for n in nodes) == ["node-1", "node-2"]
        for n in nodes:
            ready = [c for c in n["status"]["conditions"] if c["type"] == "Ready"]
            assert ready and ready[0]["status"] == "True"
            assert not n["spec"].get("taints"), "the not-ready taint must be lifted"
            assert n["metadata"]["labels"]["kubernetes.io/hostname"] == n["metadata"]["name"]

        # The four components are running and authorization is RBAC (an anonymous user is refused).
        children = _children_of(proc.pid)
        names = {Path(os.readlink(f"/proc/{p}/exe")).name for p in children if Path(f"/proc/{p}/exe").exists()}
        assert {"etcd", "kube-apiserver", "kube-controller-manager", "kube-scheduler"} <= names
        anon = subprocess.run([*kubectl, "--as", "system:anonymous", "get", "secrets", "-A"], capture_output=True,
                              text=True)
        assert anon.returncode != 0 and "forbidden" in anon.stderr.lower()

        proc.send_signal(signal.SIGTERM)
        assert proc.wait(60) == 0
        wait_until(lambda: not (_children_of(proc.pid) & children), timeout=30, what="children gone")
        alive = [p for p in children if Path(f"/proc/{p}").exists()]
        assert not alive, f"processes left behind: {alive}"
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait()


def test_service_account_tokens_and_rbac_of_deploy(cluster: Cluster) -> None:
    """The agent's ServiceAccount (deploy/rbac/agent.yaml) may read LocalModelNodes and may not
    read Secrets outside its namespace or write a LocalModelNode's spec: checked by the real
    authorizer, with a bound token from TokenRequest."""
    agent = cluster.agent_kubeconfig
    ok = cluster.kubectl("get", "localmodelnodes", kubeconfig=agent)
    assert ok.returncode == 0
    denied = cluster.kubectl("get", "secrets", "-n", "default", kubeconfig=agent, check=False)
    assert denied.returncode != 0 and "forbidden" in denied.stderr
    can = cluster.kubectl("auth", "can-i", "patch", "localmodelnodes", kubeconfig=agent, check=False)
    assert can.stdout.strip() == "no"
    can = cluster.kubectl("auth", "can-i", "patch", "localmodelnodes", "--subresource", "status", kubeconfig=agent,
                          check=False)
    assert can.stdout.strip() == "yes"
    # The coordinator (deploy/rbac/coordinator.yaml) writes caches' status but may not delete Nodes
    # or read Secrets anywhere.
    coordinator = cluster.coordinator_kubeconfig
    assert cluster.kubectl("get", "localmodelcaches", kubeconfig=coordinator).returncode == 0
    for args in (("delete", "node", "nothing-here"), ("get", "secrets", "-n", "kube-system")):
        denied = cluster.kubectl(*args, kubeconfig=coordinator, check=False)
        assert denied.returncode != 0 and "forbidden" in denied.stderr, (args, denied.stderr)


def test_reset_removes_what_a_test_added_and_restores_the_baseline(cluster: Cluster) -> None:
    cluster.register_node("scratch-node")
    cluster.kubectl("create", "namespace", "scratch")
    cluster.kubectl("create", "configmap", "c", "-n", "default")
    cluster.kubectl("delete", "crd", "inferenceservices.serving.kserve.io")
    cluster.kubectl("label", "namespace", "modelcache-system", "scratch=yes")
    cluster.reset()
    assert cluster.kubectl("get", "node", "scratch-node", check=False).returncode != 0
    assert cluster.kubectl("get", "namespace", "scratch", check=False).returncode != 0
    assert cluster.kubectl("get", "configmap", "c", "-n", "default", check=False).returncode != 0
    assert cluster.kubectl("get", "crd", "inferenceservices.serving.kserve.io").returncode == 0
    labels = json.loads(cluster.kubectl("get", "namespace", "modelcache-system", "-o", "json").stdout)["metadata"][
        "labels"]
    assert "scratch" not in labels



def test_reset_deletes_a_crd_whose_instance_kept_a_stopped_controllers_finalizer(cluster: Cluster) -> None:
    """A test's KServe adds finalizers and is stopped before the reset: the API server deletes a CRD
    only once its instances are gone, so the reset releases theirs (it timed out after 180 s)."""
    crd = {"apiVersion": "apiextensions.k8s.io/v1", "kind": "CustomResourceDefinition",
           "metadata": {"name": "widgets.scratch.example.com"},
           "spec": {"group": "scratch.example.com", "scope": "Namespaced",
                    "names": {"plural": "widgets", "singular": "widget", "kind": "Widget"},
                    "versions": [{"name": "v1", "served": True, "storage": True,
                                  "schema": {"openAPIV3Schema": {"type": "object",
                                                                 "x-kubernetes-preserve-unknown-fields": True}}}]}}
    cluster.kubectl("apply", "-f", "-", input=json.dumps(crd))
    cluster.kubectl("wait", "--for", "condition=Established", "crd/widgets.scratch.example.com")
    widget = {"apiVersion": "scratch.example.com/v1", "kind": "Widget",
              "metadata": {"name": "w", "namespace": "default", "finalizers": ["scratch.example.com/held"]}}
    cluster.kubectl("apply", "-f", "-", input=json.dumps(widget))
    cluster.reset()
    assert cluster.kubectl("get", "crd", "widgets.scratch.example.com", check=False).returncode != 0
