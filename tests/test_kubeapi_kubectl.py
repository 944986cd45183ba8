"""kubectl against the kubeapi test server: applying our CRDs and KServe-shaped objects, the
printer columns of `kubectl get`, and validation errors as kubectl shows them."""

from __future__ import annotations

import json

import pytest
from kubernetes import client

from tests.helpers import REPO
from tests.kubeapi_helpers import EXAMPLES, GROUP, VERSION


@pytest.fixture
def bare(kubeapi_factory):
    """A server without preloaded CRDs: kubectl installs them."""
    return kubeapi_factory(crd_dirs=())


def _header(output: str) -> list[str]:
    return output.splitlines()[0].split()


def _rows(output: str) -> dict[str, list[str]]:
    return {line.split()[0]: line.split() for line in output.splitlines()[1:]}


def test_apply_crds_then_examples(bare):
    out = bare.kubectl("apply", "-f", str(REPO / "deploy" / "crds")).stdout
    assert out.count("created") == 5
    bare.kubectl("wait", "--for", "condition=established", "--timeout", "10s",
                 "crd/localmodelcaches.serving.kserve.io")
    assert bare.kubectl("apply", "-f", str(REPO / "deploy" / "crds")).stdout.count("unchanged") == 5
    crds = bare.kubectl("get", "crds", "-o", "name").stdout.split()
    assert sorted(crds) == sorted(f"customresourcedefinition.apiextensions.k8s.io/{p}.serving.kserve.io" for p in (
        "localmodelcaches", "localmodelnamespacecaches", "localmodelnodes", "localmodelnodegroups",
        "clusterstoragecontainers"))
    out = bare.kubectl("apply", "-f", str(EXAMPLES)).stdout
    assert out.count("created") == 5, out
    assert bare.kubectl("apply", "-f", str(EXAMPLES)).stdout.count("unchanged") == 5
    got = json.loads(bare.kubectl("get", "localmodelnamespacecache", "team-bert", "-n", "default", "-o", "json").stdout)
    assert got["spec"]["sourceModelUri"] == "s3://models/bert/"
    bare.kubectl("delete", "-f", str(EXAMPLES))
    assert bare.kubectl("get", "localmodelcaches", "-o", "name").stdout.strip() == ""


def test_printer_columns_of_caches_and_nodes(kubeapi):
    kubeapi.kubectl("apply", "-f", str(EXAMPLES))
    out = kubeapi.kubectl("get", "localmodelcaches").stdout
    assert _header(out) == ["NAME", "URI", "AVAILABLE", "TOTAL", "FAILED", "AGE"]
    row = _rows(out)["meta-llama3-8b-instruct"]
    assert row[1] == "hf://meta-llama/meta-llama-3-8b-instruct"
    with kubeapi.api_client() as api_client:
        crd = client.CustomObjectsApi(api_client)
        crd.patch_cluster_custom_object_status(GROUP, VERSION, "localmodelcaches", "meta-llama3-8b-instruct", {
            "status": {"copies": {"available": 2, "total": 3, "failed": 1}}})
        crd.patch_cluster_custom_object_status(GROUP, VERSION, "localmodelnodes", "node-1", {"status": {
            "modelCounts": {"downloaded": 1, "total": 2, "failed": 0},
            "capacity": {"totalBytes": 100, "freeBytes": 40, "free": "40Gi"}}})
    row = _rows(kubeapi.kubectl("get", "localmodelcaches").stdout)["meta-llama3-8b-instruct"]
    assert row[1:5] == ["hf://meta-llama/meta-llama-3-8b-instruct", "2", "3", "1"]
    assert row[5].endswith("s")  # age
    out = kubeapi.kubectl("get", "localmodelnodes").stdout
    assert _header(out) == ["NAME", "DOWNLOADED", "MODELS", "FAILED", "FREE", "AGE"]
    assert _rows(out)["node-1"][1:5] == ["1", "2", "0", "40Gi"]
    wide = kubeapi.kubectl("get", "localmodelnodes", "-o", "wide").stdout
    assert "FREEBYTES" in _header(wide) and _rows(wide)["node-1"][_header(wide).index("FREEBYTES")] == "40"
    ns_out = kubeapi.kubectl("get", "localmodelnamespacecaches", "-A").stdout
    assert _header(ns_out)[:3] == ["NAMESPACE", "NAME", "URI"]
    assert "team-bert" in _rows(ns_out).get("default", [])


def test_kubectl_shows_validation_errors(kubeapi, tmp_path):
    bad = tmp_path / "bad.yaml"
    bad.write_text("apiVersion: serving.kserve.io/v1alpha1\nkind: LocalModelCache\nmetadata:\n  name: bad\n"
                   "spec:\n  sourceModelUri: s3://a/b\n  modelSize: 1Gi\n")
    proc = kubeapi.kubectl("apply", "-f", str(bad), check=False)
    assert proc.returncode != 0 and "spec.nodeGroups: Required value" in proc.stderr
    kubeapi.kubectl("apply", "-f", str(EXAMPLES))
    changed = EXAMPLES.read_text().replace("hf://meta-llama/meta-llama-3-8b-instruct", "hf://meta-llama/other")
    moved = tmp_path / "moved.yaml"
    moved.write_text(changed)
    proc = kubeapi.kubectl("apply", "-f", str(moved), check=False)
    assert proc.returncode != 0
    assert 'spec.sourceModelUri: Invalid value: "string": StorageUri is immutable' in proc.stderr


NS_AND_CM = """apiVersion: v1
kind: Namespace
metadata:
  name: team-a
---
apiVersion: v1
kind: ConfigMap
metadata:
  name: cfg
  namespace: team-a
data:
  a: "1"
"""


def test_core_kinds_with_kubectl(kubeapi):
    # `kubectl create namespace NAME` and friends send protobuf, which this server answers with 415;
    # manifests (-f) go as JSON.
    kubeapi.kubectl("create", "-f", "-", input=NS_AND_CM)
    kubeapi.kubectl("label", "configmap", "cfg", "-n", "team-a", "tier=gpu")
    assert kubeapi.kubectl("get", "cm", "-n", "team-a", "-l", "tier=gpu", "-o", "name").stdout.split() == [
        "configmap/cfg"]
    assert kubeapi.kubectl("get", "cm", "-n", "team-a", "-l", "tier!=gpu", "-o", "name").stdout.strip() == ""
    kubeapi.kubectl("annotate", "configmap", "cfg", "-n", "team-a", "note=x")
    got = json.loads(kubeapi.kubectl("get", "cm", "cfg", "-n", "team-a", "-o", "json").stdout)
    assert got["data"] == {"a": "1"} and got["metadata"]["annotations"]["note"] == "x"
    kubeapi.kubectl("delete", "namespace", "team-a")
    proc = kubeapi.kubectl("get", "namespace", "team-a", check=False)
    assert proc.returncode != 0 and "not found" in proc.stderr
    assert "default" in kubeapi.kubectl("get", "namespaces", "-o", "name").stdout


def test_unknown_fields_are_reported_by_kubectl(kubeapi, tmp_path):
    extra = tmp_path / "extra.yaml"
    extra.write_text("apiVersion: serving.kserve.io/v1alpha1\nkind: LocalModelCache\nmetadata:\n  name: extra\n"
                     "spec:\n  sourceModelUri: s3://a/b\n  modelSize: 1Gi\n  nodeGroups: [gpu]\n  bogus: 1\n")
    # kubectl >= 1.27 asks for strict field validation (an error), older ones get the default warning
    proc = kubeapi.kubectl("apply", "-f", str(extra), check=False)
    assert 'unknown field "spec.bogus"' in proc.stderr
    proc = kubeapi.kubectl("apply", "--validate=false", "-f", str(extra))
    got = json.loads(kubeapi.kubectl("get", "localmodelcache", "extra", "-o", "json").stdout)
    assert "bogus" not in got["spec"]


def test_server_side_dry_run_validates_without_storing(kubeapi, tmp_path):
    out = kubeapi.kubectl("apply", "--dry-run=server", "-f", str(EXAMPLES)).stdout
    assert out.count("(server dry run)") == 5
    assert kubeapi.kubectl("get", "localmodelcaches", "-o", "name").stdout.strip() == ""
    bad = tmp_path / "bad.yaml"
    bad.write_text(EXAMPLES.read_text().replace("nodeGroups:\n  - gpu\n  serviceAccountName", "serviceAccountName"))
    proc = kubeapi.kubectl("apply", "--dry-run=server", "-f", str(bad), check=False)
    assert proc.returncode != 0 and "spec.nodeGroups: Required value" in proc.stderr
    kubeapi.kubectl("apply", "-f", str(EXAMPLES))
    kubeapi.kubectl("delete", "--dry-run=server", "localmodelcache", "meta-llama3-8b-instruct")
    assert kubeapi.kubectl("get", "localmodelcaches", "-o", "name").stdout.split() == [
        "localmodelcache.serving.kserve.io/meta-llama3-8b-instruct"]
