"""An invalid LocalModelNode spec changes nothing on disk: refused whole, each problem on one line
(standalone: exit 2; --watch and cluster mode: the last valid spec stays, status says why)."""

from __future__ import annotations

import os
import subprocess
import time
from pathlib import Path
from typing import Any

import pytest
import yaml

from modelcache.kube.client import EVENTS, LOCAL_MODEL_NODES
from modelcache.kube.validate import SPEC_SCHEMA, node_problems
from modelcache.sources.uri import storage_key
from modelcache.store import NodeStore
from tests.agent_util import (
    agent_cmd,
    create_node,
    entry,
    kube_for,
    model_files,
    node_status,
    run_agent,
    start_agent,
    status_of,
    wait_states,
    write_node,
)
from tests.helpers import REPO, wait_until
from tests.test_kube_crd_contract import _schema

pytestmark = pytest.mark.timeout(180)

D = "ModelDownloaded"


def _strip(schema: Any) -> Any:
    if isinstance(schema, dict):
        return {k: _strip(v) for k, v in schema.items() if k != "description"}
    if isinstance(schema, list):
        return [_strip(v) for v in schema]
    return schema


def test_the_agent_checks_the_spec_schema_of_deploy_crds() -> None:
    # The installed agent has no deploy/ to read: its copy must be the CRD's, field for field.
    assert _strip(_schema("LocalModelNode")["properties"]["spec"]) == SPEC_SCHEMA


@pytest.mark.parametrize(("doc", "lines"), [
    ({"spec": {"localModels": [{"name": "m", "storageUri": "s3://b/m"}]}},
     ['spec.localModels[0]: missing required field "modelName"',
      'spec.localModels[0]: missing required field "sourceModelUri"',
      'spec.localModels[0]: unknown field "name" (a LocalModelNode entry calls it "modelName")',
      'spec.localModels[0]: unknown field "storageUri" (a LocalModelNode entry calls it "sourceModelUri")']),
    ({"spec": {"localModels": [{"modelName": "m", "sourceModelUrl": "s3://b/m"}]}},
     ['spec.localModels[0]: missing required field "sourceModelUri"',
      'spec.localModels[0]: unknown field "sourceModelUrl" (did you mean "sourceModelUri"?)']),
    ({"spec": {"localModels": {"modelName": "m"}}}, ["spec.localModels: must be an array, not dict"]),
    ({"spec": {}}, ['spec: missing required field "localModels"']),
    ({"metadata": {"name": "x"}}, ['missing required field "spec" (with its list "localModels")']),
    ({"spec": {"localModels": []}, "spek": {}}, ['unknown field "spek" (did you mean "spec"?)']),
    ({"spec": {"localModels": [{"modelName": "m", "sourceModelUri": 3}]}},
     ["spec.localModels[0].sourceModelUri: must be a string, not int"]),
    ({"spec": {"localModels": [{"modelName": "m", "sourceModelUri": "s3://b/m", "storage": {"kee": "k"}}]}},
     ['spec.localModels[0].storage: unknown field "kee" (did you mean "key"?)']),
    ({"spec": {"localModels": [{"modelName": "m", "sourceModelUri": "s3://b/m",
                                "imagePullSecrets": [{"name": "a"}, {"name": "b"}]}]}},
     ["spec.localModels[0].imagePullSecrets: at most 1 item(s), got 2"]),
    ({"spec": {"localModels": [{"modelName": "", "sourceModelUri": " "}]}},
     ['spec.localModels[0]: "modelName" is empty', 'spec.localModels[0]: "sourceModelUri" is empty']),
    ({"spec": {"localModels": [entry("m", "s3://b/a"), entry("m", "s3://b/b", namespace="t"),
                               entry("m", "s3://b/c")]}},
     ["spec.localModels[2]: modelName 'm' is listed twice (also spec.localModels[0]); each model has one "
      "status entry"]),
])
def test_every_problem_is_named(doc: dict[str, Any], lines: list[str]) -> None:
    assert node_problems({"apiVersion": "serving.kserve.io/v1alpha1", "kind": "LocalModelNode", **doc}) == lines


def test_a_valid_spec_has_no_problems() -> None:
    assert node_problems({"kind": "LocalModelNode", "metadata": {}, "status": {"x": 1}, "spec": {"localModels": [
        entry("a", "s3://b/a", namespace="t", nodeGroup="g", serviceAccountName="sa",
              storage={"key": "k", "parameters": {"type": "s3"}}, imagePullSecrets=[{"name": "p"}]),
        entry("a", "s3://b/a"), {"modelName": "n", "sourceModelUri": "hf://o/m", "namespace": None}]}}) == []


def _two_models(tmp_path: Path) -> tuple[Path, Path, list[str]]:
    uris = []
    for name in ("a", "b"):
        src = tmp_path / f"src-{name}"
        src.mkdir()
        (src / "w.bin").write_bytes(os.urandom(200_000))
        uris.append(f"file://{src}")
    spec, root = tmp_path / "node.yaml", tmp_path / "root"
    write_node(spec, [{"modelName": "a", "sourceModelUri": uris[0]}, {"modelName": "b", "sourceModelUri": uris[1]}])
    assert run_agent(spec, root).returncode == 0
    return spec, root, uris


def _intact(root: Path, uris: list[str]) -> None:
    store = NodeStore.at(root)
    for uri in uris:
        key = storage_key(uri)
        assert store.is_present(key) and store.verify(key) == [], uri
        assert model_files(root, key) == {"w.bin": 200_000}


def test_a_malformed_file_deletes_nothing_and_names_each_problem(tmp_path: Path) -> None:
    spec, root, uris = _two_models(tmp_path)
    before = sorted(str(p.relative_to(root)) for p in root.rglob("*") if ".modelcache/locks" not in str(p))
    # KServe's InferenceService keys instead of a LocalModelNode entry's: as the trial's file.
    spec.write_text(yaml.safe_dump({"apiVersion": "serving.kserve.io/v1alpha1", "kind": "LocalModelNode",
                                    "metadata": {"name": "box"},
                                    "spec": {"localModels": [{"name": "c", "storageUri": uris[0]}]}}))
    proc = run_agent(spec, root)
    assert proc.returncode == 2, proc.stderr
    assert "Traceback" not in proc.stderr
    errors = [ln for ln in proc.stderr.splitlines() if ln.startswith("error:")]
    assert errors == [
        f'error: --standalone {spec}: spec.localModels[0]: missing required field "modelName"',
        f'error: --standalone {spec}: spec.localModels[0]: missing required field "sourceModelUri"',
        f'error: --standalone {spec}: spec.localModels[0]: unknown field "name" (a LocalModelNode entry calls '
        'it "modelName")',
        f'error: --standalone {spec}: spec.localModels[0]: unknown field "storageUri" (a LocalModelNode entry '
        'calls it "sourceModelUri")',
        f"error: --standalone {spec}: 4 problem(s) above, so nothing was done and nothing in {root} changed; fix "
        'the file (see docs/agent.md, "Standalone mode") and run again',
    ], proc.stderr
    _intact(root, uris)
    after = sorted(str(p.relative_to(root)) for p in root.rglob("*") if ".modelcache/locks" not in str(p))
    assert after == before


def test_watch_keeps_the_last_valid_spec_and_reports_the_invalid_edit(tmp_path: Path) -> None:
    spec, root, uris = _two_models(tmp_path)
    spec.with_name("node.yaml.status.yaml").unlink()  # written anew once the watching agent runs
    proc = subprocess.Popen(agent_cmd(spec, root, "--watch"), cwd=REPO, stdout=subprocess.PIPE,
                            stderr=subprocess.STDOUT, text=True)
    try:
        wait_until(lambda: spec.with_name("node.yaml.status.yaml").exists()
                   and status_of(spec)["modelStatus"] == {"a": D, "b": D}, timeout=30, what="both downloaded")
        time.sleep(0.05)  # a new mtime for the edit
        spec.write_text(yaml.safe_dump({"kind": "LocalModelNode", "spec": {"localModels": [
            {"modelName": "a", "sourceModelUri": uris[0], "sourceModelURI": "typo"}]}}))

        def refused() -> bool:
            conds = status_of(spec).get("conditions") or []
            return bool(conds) and conds[0]["type"] == "SpecValid"

        wait_until(refused, timeout=30, what="the SpecValid condition")
        st = status_of(spec)
        (cond,) = st["conditions"]
        assert cond["status"] == "False" and cond["reason"] == "InvalidSpec"
        assert 'unknown field "sourceModelURI" (did you mean "sourceModelUri"?)' in cond["message"]
        assert st["modelStatus"] == {"a": D, "b": D}  # b stays: the invalid file listed only a
        time.sleep(1.5)  # a few supervisor ticks: still nothing deleted
        _intact(root, uris)
        write_node(spec, [{"modelName": "a", "sourceModelUri": uris[0]}])  # valid again: b leaves for real
        wait_until(lambda: "conditions" not in status_of(spec) and status_of(spec)["modelStatus"] == {"a": D},
                   timeout=30, what="the valid edit applied")
        wait_until(lambda: not (root / "models" / storage_key(uris[1])).exists(), timeout=30, what="b deleted")
    finally:
        proc.terminate()
        out, _ = proc.communicate(timeout=30)
    assert "invalid spec file: keeping the last valid spec" in out


def test_cluster_mode_an_invalid_spec_is_a_condition_and_nothing_is_deleted(cluster, nginx, tmp_path) -> None:
    cluster.register_node("node-a")
    kube = kube_for(cluster)
    for name in ("a", "b"):
        nginx.write(f"v/{name}.bin", 300_000)
    uris = [nginx.url("v/a.bin"), nginx.url("v/b.bin")]
    create_node(kube, "node-a", [entry("a", uris[0]), entry("b", uris[1])])
    root = tmp_path / "root"
    agent = start_agent(cluster.agent_kubeconfig, "node-a", root, tmp_path)
    try:
        wait_states(kube, "node-a", {"a": D, "b": D}, agent=agent)
        # The API server lets empty strings and a repeated name through; the agent does not.
        kube.patch(LOCAL_MODEL_NODES, "node-a", {"spec": {"localModels": [entry("a", ""), entry("c", uris[0]),
                                                                          entry("c", uris[1])]}})
        generation = kube.get(LOCAL_MODEL_NODES, "node-a")["metadata"]["generation"]

        def condition() -> dict[str, Any] | None:
            for c in node_status(kube, "node-a").get("conditions") or []:
                if c["type"] == "SpecValid":
                    return c
            return None

        wait_until(lambda: condition() is not None, timeout=30, what="the SpecValid condition")
        cond = condition()
        assert cond is not None and cond["status"] == "False" and cond["reason"] == "InvalidSpec"
        assert cond["observedGeneration"] == generation
        assert 'spec.localModels[0]: "sourceModelUri" is empty' in cond["message"]
        assert "spec.localModels[2]: modelName 'c' is listed twice" in cond["message"]
        status = node_status(kube, "node-a")
        assert status["modelStatus"] == {"a": D, "b": D}
        assert status["observedGeneration"] < generation  # the refused one is not observed as applied
        time.sleep(1.5)
        for uri in uris:
            assert model_files(root, storage_key(uri)) == {uri.rsplit("/", 1)[1]: 300_000}
        wait_until(lambda: any(e["reason"] == "InvalidSpec" and e["involvedObject"]["name"] == "node-a"
                               for e in kube.list(EVENTS, "default")["items"]), timeout=30, what="the event")
        kube.patch(LOCAL_MODEL_NODES, "node-a", {"spec": {"localModels": [entry("a", uris[0])]}})
        wait_until(lambda: condition() is None and node_status(kube, "node-a")["modelStatus"] == {"a": D},
                   timeout=30, what="the valid spec applied")
    finally:
        agent.stop()
    assert "invalid LocalModelNode spec: keeping the last valid one" in agent.log()
