"""`make demo` ends with the agent filling a node root from a LocalModelNode (small sample here)."""

from __future__ import annotations

import os
import subprocess
import sys

import pytest
import yaml

from tests.helpers import REPO

pytestmark = pytest.mark.timeout(120)


def test_demo_runs_the_agent_standalone(tmp_path):
    env = {**os.environ, "MODELCACHE_DEMO_DIR": str(tmp_path), "MODELCACHE_DEMO_SHARDS": "2",
           "MODELCACHE_DEMO_SHARD_MB": "1"}
    proc = subprocess.run([sys.executable, "-m", "modelcache.demo"], cwd=REPO, env=env, capture_output=True,
                          text=True, timeout=100)
    assert proc.returncode == 0, proc.stdout[-2000:] + proc.stderr[-2000:]
    assert "modelcache-agent --standalone" in proc.stdout
    status = yaml.safe_load((tmp_path / "localmodelnode.yaml.status.yaml").read_text())["status"]
    assert len(status["modelStatus"]) == 5 and set(status["modelStatus"].values()) == {"ModelDownloaded"}
    assert len(list((tmp_path / "node" / "models").iterdir())) == 5
    assert "downloaded: 5" in proc.stdout
