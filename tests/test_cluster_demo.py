"""`make demo`'s cluster part (tests/cluster/demo.py), on a small model: pods on real nodes."""

from __future__ import annotations

import itertools
import os
import re
import subprocess
import sys
from pathlib import Path

import pytest
import yaml

from modelcache.sources.uri import storage_key
from tests.cluster import demo
from tests.fixtures.image import Image
from tests.helpers import REPO

pytestmark = [pytest.mark.timeout(900), pytest.mark.xdist_group("realnodes")]


def test_cluster_demo_runs_the_agents_and_a_ready_predictor_pod_on_a_node_with_the_model(
        tmp_path: Path, image: Image, real_node_builds: None) -> None:
    env = {**os.environ, "MODELCACHE_DEMO_DIR": str(tmp_path), "MODELCACHE_DEMO_SHARDS": "2",
           "MODELCACHE_DEMO_SHARD_MB": "2", "IMAGE": image.ref}
    proc = subprocess.run([sys.executable, "-m", "tests.cluster.demo"], cwd=REPO, env=env, capture_output=True,
                          text=True, timeout=880)
    out = proc.stdout
    assert proc.returncode == 0, out[-5000:] + proc.stderr[-3000:]
    assert "Server Version: v1.37.2" in out
    agents = re.findall(r"^(modelcache-agent-\S+)\s+1/1\s+Running\s.*\s(node-\d)\s", out, re.M)
    assert sorted(node for _, node in agents) == ["node-1", "node-2"], out
    assert len(re.findall(r"^modelcache-coordinator-\S+\s+1/1\s+Running", out, re.M)) == 2, out
    assert "localmodelcache.serving.kserve.io/llm" in out and "localmodelnode.serving.kserve.io/node-1" in out, out
    # The last table printed shows both copies available (its columns: NAME URI AVAILABLE TOTAL ...).
    assert re.search(r"^localmodelcache\.serving\.kserve\.io/llm\s+s3://models/llm\s+2\s+2\s", out, re.M), out
    (node,) = re.findall(r"^llm-predictor-0\s+1/1\s+Running\s.*\s(node-[12])\s", out, re.M)
    names = sorted(["config.json", "generation_config.json", "model.safetensors.index.json",
                    "model-00001-of-00002.safetensors", "model-00002-of-00002.safetensors"])
    folder = tmp_path / "cluster" / "run" / node / "host" / "models" / "models" / storage_key("s3://models/llm")
    assert sorted(p.name for p in folder.iterdir()) == names
    size = sum((folder / n).stat().st_size for n in names)
    assert f"serve: loaded model llm from /mnt/models: 5 files, {size} bytes" in out, out
    assert f"running on {node}, whose agent reports the model ModelDownloaded" in out
    assert "stopped" in out.splitlines()[-1]


#: ``kubectl get localmodelcaches,localmodelnodes`` as the cluster moves: the cache alone (kubectl
#: names no kind: one kind came back), the LocalModelNodes made, both copies available.
TABLES = [
    "NAME   URI               AVAILABLE   TOTAL   AGE\nllm    s3://models/llm   0           0       1s\n",
    "NAME                                    URI               AVAILABLE   TOTAL   AGE\n"
    "localmodelcache.serving.kserve.io/llm   s3://models/llm   0           2       2s\n\n"
    "NAME                                      AGE\nlocalmodelnode.serving.kserve.io/node-1   1s\n"
    "localmodelnode.serving.kserve.io/node-2   1s\n",
    "NAME                                    URI               AVAILABLE   TOTAL   AGE\n"
    "localmodelcache.serving.kserve.io/llm   s3://models/llm   2           2       3s\n\n"
    "NAME                                      AGE\nlocalmodelnode.serving.kserve.io/node-1   2s\n"
    "localmodelnode.serving.kserve.io/node-2   2s\n",
]


class MovingCluster:
    """kubectl as the demo's poll sees the cluster: it moves to the next state after the reads
    numbered in ``moves`` (the nodes are made after one, filled after another), whatever the poll
    reads in between."""

    def __init__(self, moves: tuple[int, int]) -> None:
        self.moves, self.reads, self.state = moves, 0, 0

    def kubectl(self, *args: str) -> subprocess.CompletedProcess[str]:
        if args[:2] == ("get", "localmodelcaches,localmodelnodes"):
            out = TABLES[self.state]
        elif args[:3] == ("get", "localmodelcache", "llm"):
            out = yaml.safe_dump({"status": {"copies": {"available": 2 if self.state == 2 else 0}}})
        else:
            assert args[:2] == ("get", "localmodelnodes"), args
            out = "items:\n- status: {modelStatus: {llm: ModelDownloading}}\n" if self.state == 1 else "items: []\n"
        self.reads += 1
        self.state += sum(1 for m in self.moves if m == self.reads)
        return subprocess.CompletedProcess(args, 0, out, "")


@pytest.mark.parametrize("moves", list(itertools.combinations_with_replacement(range(1, 8), 2)))
def test_the_demo_ends_its_wait_on_a_table_that_shows_the_cache_and_its_nodes(
        moves: tuple[int, int], capsys: pytest.CaptureFixture[str], monkeypatch: pytest.MonkeyPatch) -> None:
    """In every order of the cluster's two moves against the poll's reads (CI, stop 37: a 4 MiB
    model was made and filled within the first poll), the last table the demo printed is the one
    with both copies available, its objects named with their kinds (what the test above asserts)."""
    monkeypatch.setattr(demo, "status_shown", lambda cp: print("$ modelcache status"))
    poll, polls = demo.CopiesShown(MovingCluster(moves)), 0
    while not poll():
        polls += 1
        assert polls < 20
    tables = [t for t in capsys.readouterr().out.split("\n[") if "AVAILABLE" in t]
    assert TABLES[2] in tables[-1], tables
