"""deploy/'s workloads as a real control plane admits and places them: Pod Security admission (on an
API server whose default level is `restricted`, as hardened clusters set it) admits the agent and
coordinator pods in our labelled namespace and rejects the agent where the namespace says
`restricted` or `baseline`; the DaemonSet's pods go to tainted GPU nodes."""

from __future__ import annotations

import json
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
import yaml

from modelcache.kube.client import PODS
from tests.cluster.controlplane import ControlPlane
from tests.deploy_util import DEPLOY, NAMESPACE, find, render
from tests.fixtures.cluster import Cluster
from tests.helpers import wait_until

pytestmark = pytest.mark.timeout(300)

POD_SECURITY_DEFAULTS = """\
apiVersion: apiserver.config.k8s.io/v1
kind: AdmissionConfiguration
plugins:
- name: PodSecurity
  configuration:
    apiVersion: pod-security.admission.config.k8s.io/v1
    kind: PodSecurityConfiguration
    defaults: {enforce: restricted, enforce-version: latest, warn: restricted, warn-version: latest}
    exemptions: {usernames: [], runtimeClasses: [], namespaces: []}
"""


class RestrictedByDefault(ControlPlane):
    """A control plane whose Pod Security admission enforces `restricted` in every namespace that
    does not say otherwise (the cluster-wide default hardened distributions use)."""

    def _apiserver_args(self) -> list[str]:
        config = self.workdir / "admission.yaml"
        config.write_text(POD_SECURITY_DEFAULTS)
        return [*super()._apiserver_args(), "--admission-control-config-file", str(config)]


@pytest.fixture
def restricted(tmp_path: Path, kube_binaries: Path) -> Iterator[Cluster]:
    cp = RestrictedByDefault(tmp_path / "cp", bin_dir=kube_binaries).start()
    try:
        yield Cluster(cp, tmp_path)
    finally:
        cp.stop()


def pods_of(kube: Any, component: str) -> list[dict[str, Any]]:
    items = kube.list(PODS, NAMESPACE, label_selector=f"app.kubernetes.io/component={component}").get("items")
    return list(items or [])


def failed_creates(cluster: Cluster) -> str:
    out = cluster.kubectl("get", "events", "-n", NAMESPACE, "--field-selector", "reason=FailedCreate", "-o", "json")
    return "\n".join(e["message"] for e in json.loads(out.stdout)["items"])


def test_pod_security_admits_our_pods_in_our_namespace_where_the_default_is_restricted(restricted: Cluster) -> None:
    cluster = restricted
    cluster.kubectl("apply", "-k", str(DEPLOY))
    # A GPU node as clouds taint them, and a custom NoExecute taint: the agent goes there anyway.
    cluster.cp.register_node("gpu-1", {"kserve/localmodel": "worker"}, taints=[
        {"key": "nvidia.com/gpu", "value": "present", "effect": "NoSchedule"},
        {"key": "dedicated", "value": "inference", "effect": "NoExecute"}])
    kube = cluster.kube()
    try:
        wait_until(lambda: pods_of(kube, "agent") and len(pods_of(kube, "coordinator")) == 2, timeout=60,
                   what="the DaemonSet's and the Deployment's pods")
    except TimeoutError:
        raise AssertionError(f"pods not created; controller events:\n{failed_creates(cluster)}") from None
    (agent,) = pods_of(kube, "agent")
    # The scheduler places it on the tainted node (the DaemonSet controller pins it there by affinity).
    wait_until(lambda: kube.get(PODS, agent["metadata"]["name"], NAMESPACE)["spec"].get("nodeName") == "gpu-1",
               timeout=30, what="the agent pod bound to gpu-1")
    assert agent["spec"]["priorityClassName"] == "system-node-critical" and agent["spec"]["priority"] > 1 << 30
    assert "violates PodSecurity" not in failed_creates(cluster)


@pytest.mark.parametrize("level", ["restricted", "baseline"])
def test_pod_security_rejects_the_agent_in_a_stricter_namespace(cluster: Cluster, level: str) -> None:
    docs = render()
    cluster.kubectl("create", "namespace", f"strict-{level}")
    cluster.kubectl("label", "namespace", f"strict-{level}", f"pod-security.kubernetes.io/enforce={level}")
    for sa in ("modelcache-agent", "modelcache-coordinator"):  # the pods name them
        cluster.kubectl("create", "serviceaccount", sa, "-n", f"strict-{level}")

    def dry_run(kind: str, name: str) -> Any:
        template = find(docs, kind, name)["spec"]["template"]
        pod = {"apiVersion": "v1", "kind": "Pod", "metadata": {"name": name, "namespace": f"strict-{level}",
                                                              "labels": template["metadata"]["labels"]},
               "spec": template["spec"]}
        return cluster.kubectl("create", "--dry-run=server", "-f", "-", input=yaml.safe_dump(pod), check=False)

    agent = dry_run("DaemonSet", "modelcache-agent")
    assert agent.returncode != 0 and f'violates PodSecurity "{level}:latest"' in agent.stderr
    assert "hostPath" in agent.stderr and "\"hostroot\"" in agent.stderr  # the model root on the node
    coordinator = dry_run("Deployment", "modelcache-coordinator")
    if level == "restricted":  # the coordinator needs no privilege at all
        assert coordinator.returncode == 0, coordinator.stderr
    # The same pods are admitted in our namespace as deploy/ labels it.
    labels = find(docs, "Namespace", NAMESPACE)["metadata"]["labels"]
    assert labels["pod-security.kubernetes.io/enforce"] == "privileged"
