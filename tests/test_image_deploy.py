"""deploy/ pulls exactly what `make image` tags and `make push` pushes: one place (the `images:`
entry of deploy/kustomization.yaml) sets the reference for both, a private registry included."""

from __future__ import annotations

import os
import re
import shutil
import subprocess
from pathlib import Path

import yaml

from tests.helpers import REPO, require_tool


def rendered_images(deploy: Path) -> set[str]:
    kubectl = require_tool("kubectl")
    out = subprocess.run([kubectl, "kustomize", str(deploy)], capture_output=True, text=True, check=True).stdout
    images = set()
    for doc in yaml.safe_load_all(out):
        if doc and doc["kind"] in ("DaemonSet", "Deployment"):
            pod = doc["spec"]["template"]["spec"]
            images |= {c["image"] for c in pod.get("initContainers", []) + pod["containers"]}
    return images


def make(*args: str) -> str:
    """`make` as a user runs it: without the IMAGE override of a test run sharing podman's storage
    (docs/development.md), which would stand in for the reference these tests check."""
    env = {k: v for k, v in os.environ.items() if k != "IMAGE"}
    return subprocess.run(["make", "-s", *args], cwd=REPO, capture_output=True, text=True, check=True,
                          env=env).stdout


def test_deploy_pulls_what_make_image_tags() -> None:
    ref = make("print-image").strip()
    assert ref == "ghcr.io/modelcache/modelcache:0.1.0"
    assert rendered_images(REPO / "deploy") == {ref}
    assert f" -t {ref} ." in make("-n", "image", "CONTAINER_TOOL=podman")
    assert make("-n", "push", "CONTAINER_TOOL=podman").strip() == f"podman push {ref}"


def test_a_private_registry_is_set_in_one_place(tmp_path: Path) -> None:
    """What deploy/README.md says to do for one's own registry: edit the `images:` entry (by hand or
    `kustomize edit set image`); `make image push` and the manifests follow."""
    deploy = tmp_path / "deploy"
    shutil.copytree(REPO / "deploy", deploy)
    k = deploy / "kustomization.yaml"
    text = k.read_text()
    text, n = re.subn(r"(?m)^(\s*newName:).*$", r"\1 registry.example.com/ml/modelcache", text)
    text, m = re.subn(r"(?m)^(\s*newTag:).*$", r"\1 1.2.3-rc1", text)
    assert n == m == 1
    k.write_text(text)
    ref = "registry.example.com/ml/modelcache:1.2.3-rc1"
    assert rendered_images(deploy) == {ref}
    assert make("print-image", f"KUSTOMIZATION={k}").strip() == ref
    assert make("-n", "push", "CONTAINER_TOOL=docker", f"KUSTOMIZATION={k}").strip() == f"docker push {ref}"


def kustomize_v2() -> bool:
    """kubectl <= 1.20 embeds kustomize v2, where a base directory goes under `bases:`."""
    out = subprocess.run([require_tool("kubectl"), "version", "--client", "-o", "json"], capture_output=True,
                         text=True, check=True).stdout
    minor = yaml.safe_load(out)["clientVersion"]["minor"]
    return int(re.sub(r"\D", "", minor)) <= 20


def test_an_overlay_of_ones_own_drives_make_too(tmp_path: Path) -> None:
    """deploy/README.md's overlay kept outside the repository: `make image push
    KUSTOMIZATION=<it>` tags and pushes what it deploys."""
    shutil.copytree(REPO / "deploy", tmp_path / "modelcache" / "deploy")
    site = tmp_path / "my-site"
    site.mkdir()
    key = "bases" if kustomize_v2() else "resources"
    (site / "kustomization.yaml").write_text(f"""apiVersion: kustomize.config.k8s.io/v1beta1
kind: Kustomization
{key}:
- ../modelcache/deploy
images:
- name: ghcr.io/modelcache/modelcache
  newName: registry.example.com/ml/modelcache
  newTag: 0.1.0
""")
    ref = "registry.example.com/ml/modelcache:0.1.0"
    assert rendered_images(site) == {ref}
    assert make("print-image", f"KUSTOMIZATION={site / 'kustomization.yaml'}").strip() == ref
