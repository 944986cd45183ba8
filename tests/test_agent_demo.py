"""`make demo`'s part without a cluster: one model of several files in one folder (not one model
per file), every command printed as it runs, and nothing written into the current directory of
an installed copy (the newcomer review's C6 and its demo points)."""

from __future__ import annotations

import os
import re
import subprocess
import sys

import pytest
import yaml

from tests.helpers import REPO

pytestmark = pytest.mark.timeout(180)


def test_demo_pulls_one_model_of_several_files_and_runs_the_agent_standalone(tmp_path):
    env = {**os.environ, "MODELCACHE_DEMO_DIR": str(tmp_path), "MODELCACHE_DEMO_SHARDS": "2",
           "MODELCACHE_DEMO_SHARD_MB": "1"}
    proc = subprocess.run([sys.executable, "-m", "examples.demo"], cwd=REPO, env=env, capture_output=True,
                          text=True, timeout=150)
    assert proc.returncode == 0, proc.stdout[-2000:] + proc.stderr[-2000:]
    out = proc.stdout
    # It says plainly why the model is served as one archive.
    assert "an HTTP URI names one file (HTTP has no listing), so the model is served as one archive" in out
    # Each command is shown as it runs: with its --root, and the one URI it pulls.
    shown = re.findall(r"^\$ modelcache (pull|verify|ls) (.*)$", out, re.M)
    assert [c for c, _ in shown] == ["pull", "pull", "verify", "ls"], out
    assert all(f"--root {tmp_path}/store" in rest for _, rest in shown)
    assert all(rest.count("http://") == 1 for c, rest in shown if c == "pull")
    files = {"config.json", "generation_config.json", "model.safetensors.index.json",
             "model-00001-of-00002.safetensors", "model-00002-of-00002.safetensors"}
    for root in (tmp_path / "store", tmp_path / "node"):
        (folder,) = list((root / "models").iterdir())  # one model, not one per file
        assert {p.name for p in folder.iterdir()} == files
    assert "modelcache-agent --standalone" in out
    status = yaml.safe_load((tmp_path / "localmodelnode.yaml.status.yaml").read_text())["status"]
    assert status["modelStatus"] == {"sample-llm": "ModelDownloaded"}
    assert "downloaded: 1" in out and "one model, 5 files" in out


def test_an_installed_demo_writes_nothing_into_the_current_directory(tmp_path):
    """Run outside the project's checkout (it shipped in the wheel then), it used to fill ./.work with 1.7 GB."""
    cwd, tmp = tmp_path / "somewhere", tmp_path / "tmp"
    cwd.mkdir()
    tmp.mkdir()
    env = {k: v for k, v in os.environ.items() if k != "MODELCACHE_DEMO_DIR"}
    env.update(TMPDIR=str(tmp), MODELCACHE_DEMO_SHARDS="1", MODELCACHE_DEMO_SHARD_MB="1",
               PYTHONPATH=str(REPO))
    proc = subprocess.run([sys.executable, "-m", "examples.demo"], cwd=cwd, env=env, capture_output=True,
                          text=True, timeout=150)
    assert proc.returncode == 0, proc.stdout[-2000:] + proc.stderr[-2000:]
    assert list(cwd.iterdir()) == []
    assert (tmp / "modelcache-demo" / "store" / "models").is_dir()
    assert f"everything is under {tmp}/modelcache-demo: `rm -rf {tmp}/modelcache-demo` removes it" in proc.stdout
