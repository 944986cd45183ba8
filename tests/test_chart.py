"""The Helm chart charts/modelcache/ against deploy/, its one source of truth: the chart is what
charts/generate.py renders from deploy/ now (not stale), `helm lint` passes, `helm template` with
default values gives exactly the objects of `kubectl kustomize deploy/` (and, with cert-manager
on, of deploy/ with its cert-manager component), and every value lands where it should."""

from __future__ import annotations

import copy
import hashlib
import json
import os
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest
import yaml

from tests.deploy_util import DEPLOY, Obj, find, render
from tests.fixtures.ops import Helm
from tests.helpers import REPO

CHART = REPO / "charts" / "modelcache"
GENERATOR = REPO / "charts" / "generate.py"


def key(obj: Obj) -> tuple[str, str, str, str]:
    return obj["apiVersion"], obj["kind"], obj["metadata"].get("namespace", ""), obj["metadata"]["name"]


def template(helm: Helm, *args: str, namespace: str = "default") -> list[Obj]:
    out = helm("template", "modelcache", str(CHART), "--include-crds", "--namespace", namespace, *args).stdout
    return [d for d in yaml.safe_load_all(out) if d]


def assert_same_objects(chart: list[Obj], kustomized: list[Obj]) -> None:
    by_chart, by_kustomize = {key(o): o for o in chart}, {key(o): o for o in kustomized}
    assert len(by_chart) == len(chart), "the chart renders an object twice"
    assert sorted(by_chart) == sorted(by_kustomize)
    for k, obj in by_kustomize.items():
        assert by_chart[k] == obj, f"{k}: the chart renders it differently from deploy/"


def kustomize_with(component: str, tmp_path: Path) -> list[Obj]:
    overlay = tmp_path / "overlay"
    overlay.mkdir()
    (overlay / "kustomization.yaml").write_text(yaml.safe_dump({
        "apiVersion": "kustomize.config.k8s.io/v1beta1", "kind": "Kustomization",
        "resources": [os.path.relpath(DEPLOY, overlay)],
        "components": [os.path.relpath(DEPLOY / "components" / component, overlay)]}))
    return render(overlay)


def test_the_chart_is_generated_from_deploy_as_it_is_now(kube_binaries: Path) -> None:
    """A change to deploy/ without `make chart` fails here, with the diff."""
    proc = subprocess.run([sys.executable, str(GENERATOR), "--check", "--kubectl", str(kube_binaries / "kubectl")],
                          capture_output=True, text=True)
    assert proc.returncode == 0, proc.stderr + proc.stdout[-6000:]


def test_the_generator_names_a_place_deploy_lost(kube_binaries: Path, tmp_path: Path) -> None:
    """A value whose field left deploy/ is an error naming it, never a value that silently does nothing."""
    sys.path.insert(0, str(GENERATOR.parent))
    try:
        import generate
    finally:
        sys.path.remove(str(GENERATOR.parent))
    base = generate.kustomize(DEPLOY, str(kube_binaries / "kubectl"))
    agent = find(base, "DaemonSet", "modelcache-agent")
    agent["spec"]["template"]["spec"]["volumes"] = [v for v in agent["spec"]["template"]["spec"]["volumes"]
                                                    if v["name"] != "hostroot"]
    with pytest.raises(generate.DeployChanged, match=r"agent.hostPath .*name=hostroot"):
        generate.defaults(base)


def test_helm_lint(helm: Helm) -> None:
    proc = helm("lint", "--strict", str(CHART))
    assert "1 chart(s) linted, 0 chart(s) failed" in proc.stdout


def test_default_values_render_deploy_field_for_field(helm: Helm, kube_binaries: Path) -> None:
    assert_same_objects(template(helm), render())


def test_cert_manager_renders_deploy_with_its_component(helm: Helm, kube_binaries: Path, tmp_path: Path) -> None:
    chart = template(helm, "--set", "webhooks.certManager.enabled=true")
    assert_same_objects(chart, kustomize_with("cert-manager", tmp_path))
    assert {o["kind"] for o in chart} >= {"Issuer", "Certificate"}


def test_every_value_lands_where_deploy_has_it(helm: Helm, kube_binaries: Path, tmp_path: Path) -> None:
    values: dict[str, Any] = {
        "image": {"repository": "registry.example.com/ml/modelcache", "tag": "9.9.9"},
        "agent": {"hostPath": "/mnt/models", "nodeSelector": {"gpu": "a100"},
                  "tolerations": [{"key": "nvidia.com/gpu", "operator": "Exists", "effect": "NoSchedule"}],
                  "resources": {"requests": {"cpu": "1", "memory": "1Gi"}}, "peers": "off"},
        "coordinator": {"replicas": 3, "resources": {"limits": {"memory": "2Gi"}}},
        "credentialsNamespace": "ml-credentials",
        "webhooks": {"failurePolicy": {"pods.modelcache.serving.kserve.io": "Fail"}},
    }
    (tmp_path / "values.yaml").write_text(yaml.safe_dump(values))
    chart = template(helm, "-f", str(tmp_path / "values.yaml"))
    want = copy.deepcopy(render())
    # The same edits by hand on deploy/'s objects: the rendering must be exactly that.
    for obj in want:
        for c in [*obj.get("spec", {}).get("template", {}).get("spec", {}).get("containers", []),
                  *obj.get("spec", {}).get("template", {}).get("spec", {}).get("initContainers", [])]:
            c["image"] = "registry.example.com/ml/modelcache:9.9.9"
    agent = find(want, "DaemonSet", "modelcache-agent")["spec"]["template"]["spec"]
    next(v for v in agent["volumes"] if v["name"] == "hostroot")["hostPath"]["path"] = "/mnt/models"
    agent["nodeSelector"]["gpu"] = "a100"  # merged over the default label, as Helm merges maps
    agent["tolerations"] = values["agent"]["tolerations"]
    container = next(c for c in agent["containers"] if c["name"] == "agent")
    # Helm merges a value's map over the chart's default (deploy/'s): the requests change, the limits stay.
    container["resources"]["requests"] = values["agent"]["resources"]["requests"]
    next(e for e in container["env"] if e["name"] == "MODELCACHE_CREDENTIALS_NAMESPACE")["value"] = "ml-credentials"
    find(want, "ConfigMap", "modelcache-agent")["data"]["MODELCACHE_PEERS"] = "off"
    find(want, "DaemonSet", "modelcache-agent")["spec"]["template"]["metadata"]["annotations"] = {
        "modelcache.serving.kserve.io/config-values": config_hash({"agent.peers": "off"})}
    coordinator = find(want, "Deployment", "modelcache-coordinator")
    coordinator["spec"]["replicas"] = 3
    coordinator["spec"]["template"]["spec"]["containers"][0]["resources"]["limits"]["memory"] = "2Gi"
    mutator = find(want, "MutatingWebhookConfiguration", "modelcache-pod-mutator")
    next(h for h in mutator["webhooks"] if h["name"] == "pods.modelcache.serving.kserve.io")["failurePolicy"] = "Fail"
    # The credential namespace wherever deploy/ names it (its Namespace, the Role and binding there,
    # the agent's env, policies that match it): every string that is exactly that name.
    want = [renamed(o, "modelcache-credentials", "ml-credentials") for o in want]
    assert any(o["kind"] == "Namespace" and o["metadata"]["name"] == "ml-credentials" for o in want)
    assert_same_objects(chart, want)


def config_hash(values: dict[str, str]) -> str:
    return hashlib.sha256(json.dumps(values, sort_keys=True, separators=(",", ":")).encode()).hexdigest()[:16]


def test_a_config_value_alone_rolls_the_agents(helm: Helm, kube_binaries: Path) -> None:
    """MODELCACHE_PEERS reaches the agent through envFrom, read when the pod starts: `helm upgrade
    --set agent.peers=off` must change the agent's pod template (so the DaemonSet replaces its pods),
    each value to its own template, and back to the default to deploy/'s exactly."""
    def pod_template(*args: str) -> Obj:
        return find(template(helm, *args), "DaemonSet", "modelcache-agent")["spec"]["template"]  # type: ignore[no-any-return]

    base = find(render(), "DaemonSet", "modelcache-agent")["spec"]["template"]
    off, on = pod_template("--set", "agent.peers=off"), pod_template("--set", "agent.peers=on")
    assert off["metadata"].pop("annotations") == {"modelcache.serving.kserve.io/config-values":
                                                  config_hash({"agent.peers": "off"})}
    assert on["metadata"]["annotations"] != {"modelcache.serving.kserve.io/config-values":
                                             config_hash({"agent.peers": "off"})}
    assert off == base  # nothing else of the pod changes
    assert pod_template("--set", "agent.peers=auto") == base


def renamed(node: Any, old: str, new: str) -> Any:
    if isinstance(node, dict):
        return {k: renamed(v, old, new) for k, v in node.items()}
    if isinstance(node, list):
        return [renamed(v, old, new) for v in node]
    return new if node == old else node


def test_a_wrong_value_is_refused_before_anything_is_applied(helm: Helm) -> None:
    for bad, words in (("agent.peers=sometimes", "at '/agent/peers': value must be one of 'auto', 'on', 'off'"),
                       ("webhooks.failurePolicy.pods\\.modelcache\\.serving\\.kserve\\.io=Open",
                        "at '/webhooks/failurePolicy/pods.modelcache.serving.kserve.io': value must be one of"),
                       ("agent.hostPathh=/x", "at '/agent': additional properties 'hostPathh' not allowed")):
        proc = helm("template", "modelcache", str(CHART), "--set", bad, check=False)
        assert proc.returncode != 0 and words in proc.stderr, (bad, proc.stderr)


def test_the_release_namespace_is_not_rendered_again(helm: Helm, kube_binaries: Path) -> None:
    """`helm install -n modelcache-system --create-namespace`: Helm made the namespace, so the chart
    must not render it (Helm would refuse an object it does not own); every other object stays."""
    chart = template(helm, namespace="modelcache-system")
    want = [o for o in render() if not (o["kind"] == "Namespace" and o["metadata"]["name"] == "modelcache-system")]
    assert_same_objects(chart, want)
