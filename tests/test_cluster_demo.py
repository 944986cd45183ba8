"""`make demo`'s cluster part (tests/cluster/demo.py), on a small model."""

from __future__ import annotations

import os
import subprocess
import sys

import pytest

from tests.helpers import REPO

pytestmark = pytest.mark.timeout(300)


def test_cluster_demo_fills_two_nodes_and_places_the_pod_on_one_of_them(tmp_path, kube_binaries):
    env = {**os.environ, "MODELCACHE_DEMO_DIR": str(tmp_path), "MODELCACHE_DEMO_SHARDS": "2",
           "MODELCACHE_DEMO_SHARD_MB": "2"}
    proc = subprocess.run([sys.executable, "-m", "tests.cluster.demo"], cwd=REPO, env=env, capture_output=True,
                          text=True, timeout=280)
    out = proc.stdout
    assert proc.returncode == 0, out[-3000:] + proc.stderr[-3000:]
    assert "Server Version: v1.37.2" in out
    assert "localmodelcache.serving.kserve.io/llm" in out and "localmodelnode.serving.kserve.io/node-1" in out
    node = out.rsplit("bound to ", 1)[1].split(",", 1)[0]
    assert node in ("node-1", "node-2")
    models = tmp_path / "cluster" / "nodes" / node / "models"
    (folder,) = list(models.iterdir())  # one model of several files, not one model per file
    assert sorted(p.name for p in folder.iterdir()) == sorted(
        ["config.json", "generation_config.json", "model.safetensors.index.json",
         "model-00001-of-00002.safetensors", "model-00002-of-00002.safetensors"])
    assert not (tmp_path / "cluster" / "nodes" / "node-3" / "models").exists() or not any(
        (tmp_path / "cluster" / "nodes" / "node-3" / "models").iterdir())
    assert "stopped" in out.splitlines()[-1]
