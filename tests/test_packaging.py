"""Packaging a user expects: one version everywhere (the package, `modelcache --version`, the
image label, deploy/'s image tag, the chart, the changelog), a LICENSE, and a wheel and an sdist
that install into a fresh venv and run."""

from __future__ import annotations

import re
import shutil
import subprocess
import sys
import tarfile
import tomllib
import zipfile
from pathlib import Path

import pytest
import yaml

from tests import tiers
from tests.helpers import REPO

VERSION = tomllib.loads((REPO / "pyproject.toml").read_text())["project"]["version"]


def dockerfile_version() -> str:
    (default,) = re.findall(r"^ARG VERSION=(\S+)$", (REPO / "Dockerfile").read_text(), re.M)
    return default


def test_one_version_everywhere() -> None:
    """A release bumps pyproject.toml; every other place that names the version must follow."""
    assert re.fullmatch(r"\d+\.\d+\.\d+", VERSION)
    assert dockerfile_version() == VERSION
    assert 'org.opencontainers.image.version="${VERSION}"' in (REPO / "Dockerfile").read_text()
    images = yaml.safe_load((REPO / "deploy" / "kustomization.yaml").read_text())["images"]
    assert [i["newTag"] for i in images] == [VERSION]
    chart = yaml.safe_load((REPO / "charts" / "modelcache" / "Chart.yaml").read_text())
    assert (chart["version"], chart["appVersion"]) == (VERSION, VERSION)
    assert f"## [{VERSION}]" in (REPO / "CHANGELOG.md").read_text()
    assert "Apache License" in (REPO / "LICENSE").read_text()
    assert tomllib.loads((REPO / "pyproject.toml").read_text())["project"]["license"] == "Apache-2.0"


def test_version_flag() -> None:
    out = subprocess.run([str(Path(sys.executable).parent / "modelcache"), "--version"], capture_output=True,
                         text=True, check=True).stdout
    assert out.strip() == f"modelcache, version {VERSION}"


# The builds and a fresh venv with every dependency: minutes on a loaded machine (27 with isolated
# builds and bytecode compiled at load 35: hence --no-isolation and --no-compile).
pytestmark = pytest.mark.timeout(1500)


@pytest.fixture(scope="module")
@tiers.needs(tiers.SERVERS)
def dist(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """sdist, then the wheel built from that sdist (python -m build), from the tracked files only. The
    build backend is the venv's (setuptools>=77, as pyproject's build-system asks): an isolated build
    would install it twice more from the package index."""
    src = tmp_path_factory.mktemp("src")
    files = subprocess.run(["git", "ls-files", "-z"], cwd=REPO, capture_output=True, check=True).stdout
    for name in filter(None, files.decode().split("\0")):
        if (REPO / name).is_file():
            (src / name).parent.mkdir(parents=True, exist_ok=True)
            shutil.copy2(REPO / name, src / name)
    out = tmp_path_factory.mktemp("dist")
    proc = subprocess.run([sys.executable, "-m", "build", "--no-isolation", "--outdir", str(out), str(src)],
                          capture_output=True,
                          text=True, timeout=600)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    return out


def test_wheel_and_sdist_install_in_a_fresh_venv(dist: Path, tmp_path: Path) -> None:
    (wheel,) = dist.glob(f"modelcache-{VERSION}-py3-none-any.whl")
    (sdist,) = dist.glob(f"modelcache-{VERSION}.tar.gz")
    with zipfile.ZipFile(wheel) as z:
        names = z.namelist()
    assert f"modelcache-{VERSION}.dist-info/licenses/LICENSE" in names
    for pkg in ("modelcache/cli/commands.py", "agent/__main__.py", "coordinator/__main__.py",
                "initializer/__main__.py"):
        assert pkg in names
    assert not [n for n in names if n.startswith(("tests/", "examples/"))]  # the demo is run from a checkout
    with tarfile.open(sdist) as t:
        members = {m.name.split("/", 1)[1] for m in t.getmembers() if "/" in m.name}
    assert {"LICENSE", "README.md", "CHANGELOG.md", "pyproject.toml", "modelcache/cli/commands.py"} <= members

    venv = tmp_path / "venv"
    subprocess.run([sys.executable, "-m", "venv", str(venv)], check=True)
    pip = [str(venv / "bin" / "python"), "-m", "pip", "install", "-q", "--disable-pip-version-check", "--no-compile"]
    # The image's pins (as `make install` uses them) keep the resolve to what the cache holds.
    constraints = REPO / ".venv" / "constraints.txt"
    pinned = ["-c", str(constraints)] if constraints.exists() else []
    proc = subprocess.run([*pip, *pinned, str(wheel)], capture_output=True, text=True, timeout=900)
    assert proc.returncode == 0, proc.stderr[-3000:]
    for script in ("modelcache", "modelcache-agent", "modelcache-coordinator"):
        run = subprocess.run([str(venv / "bin" / script), "--help"], capture_output=True, text=True, timeout=120)
        assert run.returncode == 0, f"{script} --help: {run.stderr[-2000:]}"
        assert "Usage:" in run.stdout
    # KServe's initializer contract: positional pairs only; its usage, on stderr, for anything else.
    run = subprocess.run([str(venv / "bin" / "storage-initializer"), "--help"], capture_output=True, text=True,
                         timeout=120)
    assert run.returncode != 0 and run.stderr.startswith("Usage: initializer-entrypoint src_uri_0 dest_path_0")
    version = subprocess.run([str(venv / "bin" / "modelcache"), "--version"], capture_output=True, text=True)
    assert version.stdout.strip() == f"modelcache, version {VERSION}"
    # The sdist builds and installs too (over the wheel's dependencies, already there).
    proc = subprocess.run([*pip, "--force-reinstall", "--no-deps", str(sdist)], capture_output=True, text=True,
                          timeout=900)
    assert proc.returncode == 0, proc.stderr[-3000:]
    run = subprocess.run([str(venv / "bin" / "modelcache"), "--help"], capture_output=True, text=True, timeout=120)
    assert run.returncode == 0 and "Usage:" in run.stdout, run.stderr[-2000:]
