"""The Helm chart charts/modelcache/ against deploy/, its one source of truth: the chart is what
charts/generate.py renders from deploy/ now (not stale), `helm lint` passes, `helm template` with
default values gives exactly the objects of `kubectl kustomize deploy/` (and, with cert-manager
on, of deploy/ with its cert-manager component), and every value lands where it should."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

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
