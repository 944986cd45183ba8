"""The README's five-minute quickstart works as written (issue 27): its lines run in a shell with a
home of their own, offline, and do what their comments say. The venv lines are the only ones
replaced: the test's own venv (the same `pip install .` of this checkout) stands in for them."""

from __future__ import annotations

import os
import re
import subprocess
import sys
from pathlib import Path

import pytest

from modelcache.sources.uri import storage_key
from tests.helpers import REPO

pytestmark = pytest.mark.timeout(300)


def quickstart() -> list[str]:
    text = (REPO / "README.md").read_text()
    block = re.search(r"<!-- quickstart: [^>]*-->\n```sh\n(.*?)\n```", text, re.S)
    assert block, "README.md has no quickstart block"
    return [ln for ln in block.group(1).splitlines() if ln.strip()]


def test_the_quickstart_is_near_the_top_and_short() -> None:
    text = (REPO / "README.md").read_text()
    assert text.index("<!-- quickstart") < text.index("## The pieces") and text[: text.index("<!-- quickstart")].count(
        "\n") < 40
    assert len(quickstart()) <= 10
    # What a newcomer needs before it: the prerequisites (the newcomer review found none named).
    intro = " ".join(text[text.index("## Try it in five minutes"):text.index("<!-- quickstart")].split())
    assert "Linux, Python 3.11+" in intro and "venv of about" in intro
    # The CLI, what a one-box user reads next, comes before the contributors' sections (it came
    # after "Working on modelcache", the tests' Kubernetes and the image internals, at line 136),
    # and no internal tracker reference ("issue 14") means nothing to a visitor.
    headings = re.findall(r"^## (.+)$", text, re.M)
    assert headings.index("The CLI") < min(headings.index(h) for h in ("Working on modelcache", "The image"))
    assert not re.search(r"\bissue \d+", text, re.I)


def test_the_quickstart_runs_as_written(tmp_path: Path) -> None:
    home = tmp_path / "home"
    home.mkdir()
    lines = quickstart()
    assert lines[0].startswith("python3 -m venv ~/mc-venv") and "pip install" in lines[0]
    assert lines[1] == "export PATH=~/mc-venv/bin:$PATH"
    # ~/mc-venv is the test's venv (the same install of this checkout): linked, not built again.
    (home / "mc-venv").symlink_to(Path(sys.executable).parent.parent)
    env = {k: v for k, v in os.environ.items() if not k.startswith(("MODELCACHE_", "AWS_"))}
    env.update(HOME=str(home), MODELCACHE_DEMO_DIR=str(tmp_path / "demo"), MODELCACHE_DEMO_SHARD_MB="2")
    script = "set -e\ncd " + str(REPO) + "\n" + "\n".join(lines[1:]) + "\n"
    proc = subprocess.run(["bash", "-c", script], env=env, capture_output=True, text=True, timeout=280)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    model, root = home / "my-model", home / "mc"
    key = storage_key(f"{home}/my-model")  # what ~/my-model expands to
    folder = root / "models" / key
    assert sorted(p.name for p in folder.iterdir()) == ["config.json", "model.safetensors"]
    assert (folder / "model.safetensors").read_bytes() == (model / "model.safetensors").read_bytes()
    err = proc.stderr
    assert f"{home}/my-model -> {folder} (2 files, 64.0 MiB, in " in err
    assert f"{home}/my-model -> {folder} (2 files, 64.0 MiB, cached)" in err
    assert re.search(rf"^{key}\s+present\s+64\.0 MiB\s+2\s+{re.escape(str(model))}$", proc.stdout, re.M)
    assert f"{key}: ok" in proc.stdout
    assert "one model, 6 files" in proc.stdout  # the demo's closing line
    assert "error" not in err.lower().replace("error_log", "")
