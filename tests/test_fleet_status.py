"""`modelcache status` (modelcache/kube/fleet.py): the fleet built from caches and LocalModelNodes
as the coordinator and agents write them, and what a person reads. On the real control plane:
tests/test_prometheus.py."""

from __future__ import annotations

import json
import re
from typing import Any

from click.testing import CliRunner

from modelcache.cli.commands import cli
from modelcache.kube.fleet import build, render

GiB = 1 << 30


def node(name: str, entries: list[tuple[str, str | None, str]], statuses: dict[str, dict[str, Any]],
         free: int = 100 * GiB, total: int = 500 * GiB) -> dict[str, Any]:
    return {"metadata": {"name": name},
            "spec": {"localModels": [{"modelName": m, "namespace": ns, "nodeGroup": g, "sourceModelUri": "s3://b/m"}
                                     for m, ns, g in entries]},
            "status": {"modelStatus": {k: v["state"] for k, v in statuses.items()}, "modelDetails": statuses,
                       "capacity": {"freeBytes": free, "totalBytes": total}, "lastUpdated": "2026-12-02T03:00:00Z"}}


def cache(name: str, groups: list[str], available: int, total: int, failed: int = 0, namespace: str | None = None,
          services: int = 0) -> dict[str, Any]:
    meta = {"name": name, **({"namespace": namespace} if namespace else {})}
    return {"metadata": meta, "spec": {"sourceModelUri": f"s3://models/{name}", "modelSize": "40Gi",
                                       "nodeGroups": groups},
            "status": {"copies": {"available": available, "total": total, "failed": failed},
                       "inferenceServices": [{"namespace": "serving", "name": f"svc{i}"} for i in range(services)]}}


def fleet_objects() -> tuple[list[dict[str, Any]], list[dict[str, Any]]]:
    caches = [cache("llm", ["a100", "h100"], 2, 3, 1, services=2), cache("embed", ["a100"], 1, 1, namespace="team")]
    nodes = [
        node("gpu-1", [("llm", None, "a100"), ("embed", "team", "a100")], {
            "llm": {"state": "ModelDownloaded", "bytesDone": 40 * GiB, "bytesTotal": 40 * GiB},
            "team/embed": {"state": "ModelDownloaded", "bytesTotal": GiB, "drift": "config.json changed at the source"},
        }),
        node("gpu-2", [("llm", None, "a100")], {
            "llm": {"state": "ModelDownloading", "bytesDone": 10 * GiB, "bytesTotal": 40 * GiB, "rate": 512 << 20},
        }, free=30 * GiB),
        node("gpu-3", [("llm", None, "h100")], {
            "llm": {"state": "ModelDownloadError",
                    "message": "AccessDenied: s3://models/llm: 403 Forbidden (retry 3 in 8s)"},
        }),
    ]
    return caches, nodes


def test_copies_by_node_group_in_flight_and_failures() -> None:
    fleet = build(*fleet_objects())
    llm = next(c for c in fleet.caches if c.key == "llm")
    assert (llm.available, llm.total, llm.failed) == (2, 3, 1)
    assert [(g.group, g.downloaded, g.nodes) for g in llm.groups] == [("a100", 1, 2), ("h100", 0, 1)]
    assert llm.services == ["serving/svc0", "serving/svc1"]
    assert [c.key for c in fleet.caches] == ["llm", "team/embed"]  # cluster caches first, then by namespace
    gpu2 = next(n for n in fleet.nodes if n.node == "gpu-2")
    (m,) = gpu2.models
    assert m.percent == 25 and m.rate == 512 << 20 and m.eta_seconds == 60.0  # 30 GiB at 512 MiB/s
    assert [(f.node, f.model) for f in fleet.failures] == [("gpu-3", "llm")]
    assert "403 Forbidden" in fleet.failures[0].message


def test_the_text_a_person_reads() -> None:
    text = render(build(*fleet_objects()))
    lines = text.splitlines()
    assert lines[0] == "CACHES (2)"
    assert re.search(r"^llm +2/3 \(1 failed\) +a100 1/2, h100 0/1 +40Gi +2 +s3://models/llm$", text, re.M)
    assert re.search(r"^gpu-2 +a100 +30\.0 GiB of 500\.0 GiB +0/1 downloaded +llm 25% 512\.0 MiB/s eta 1m00s$",
                     text, re.M)
    assert "DRIFTED (1)\ngpu-1  team/embed  config.json changed at the source" in text
    assert text.endswith("FAILURES (1)\ngpu-3  llm  AccessDenied: s3://models/llm: 403 Forbidden (retry 3 in 8s)")


def test_an_empty_cluster_says_so() -> None:
    text = render(build([], []))
    assert "no LocalModelCache or LocalModelNamespaceCache" in text and "no LocalModelNode" in text
    assert text.endswith("FAILURES (0)\nnone")


def test_json_is_the_same_fleet() -> None:
    data = json.loads(json.dumps(build(*fleet_objects()).to_dict()))
    assert {c["key"] for c in data["caches"]} == {"llm", "team/embed"}
    assert data["failures"][0]["node"] == "gpu-3"


def test_no_kubeconfig_is_one_line_and_exit_2(tmp_path: Any) -> None:
    result = CliRunner().invoke(cli, ["status", "--kubeconfig", str(tmp_path / "missing")])
    assert result.exit_code == 2
    assert len(result.output.strip().splitlines()) == 1 and "missing" in result.output


def test_the_docs_show_what_status_prints_now() -> None:
    """docs/operations.md's demo output (captured from `make demo`) is what render() prints for those
    objects today: a change to the layout that leaves the page behind fails here."""
    from tests.helpers import REPO

    page = (REPO / "docs" / "operations.md").read_text()
    blocks = re.findall(r"^\$ modelcache status\n(.*?)(?=^\$ |^```)", page, re.M | re.S)
    assert len(blocks) == 2, blocks
    free, total = int(40.3 * GiB), 252 * GiB
    group = [("llm", None, "workers")]
    llm = cache("llm", ["workers"], 0, 2) | {"spec": {"sourceModelUri": "s3://models/llm", "modelSize": "578Mi",
                                                      "nodeGroups": ["workers"]}}
    size = 605179791
    arriving = [node("node-1", group, {"llm": {"state": "ModelDownloading", "bytesDone": size * 17 // 100,
                                               "bytesTotal": size, "rate": int(6.1 * (1 << 20))}}, free, total),
                node("node-2", group, {"llm": {"state": "ModelDownloading", "bytesDone": size * 20 // 100,
                                               "bytesTotal": size, "rate": int(8.6 * (1 << 20))}}, free, total)]
    assert render(build([llm], arriving)) == blocks[0].rstrip("\n")
    llm["status"]["copies"]["available"] = 2
    there = [node(n, group, {"llm": {"state": "ModelDownloaded", "bytesDone": size, "bytesTotal": size}}, free, total)
             for n in ("node-1", "node-2")]
    assert render(build([llm], there)) == blocks[1].rstrip("\n")

