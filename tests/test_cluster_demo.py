"""`make demo`'s cluster part (tests/cluster/demo.py), on a small model: pods on real nodes."""

from __future__ import annotations

import os
import re
import subprocess
import sys
from pathlib import Path

import pytest

from modelcache.sources.uri import storage_key
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
