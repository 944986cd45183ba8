"""requirements/image.txt (the image's pins, also the test venv's constraints) keeps up with
pyproject.toml: every dependency pinned, at a version its specifier accepts, with hashes."""

from __future__ import annotations

import re
import tomllib

from packaging.requirements import Requirement
from packaging.utils import canonicalize_name

from tests.helpers import REPO

PIN = re.compile(r"^([A-Za-z0-9][A-Za-z0-9._-]*)==([^\s;\\]+)")


def pins(path: str) -> dict[str, str]:
    text = (REPO / path).read_text()
    blocks = re.split(r"\n(?=\S)", text)
    out = {}
    for block in blocks:
        m = PIN.match(block)
        if m:
            assert "--hash=sha256:" in block, f"{path}: {m.group(1)} has no hash"
            out[canonicalize_name(m.group(1))] = m.group(2)
    return out


def test_every_dependency_is_pinned_in_the_image_lock() -> None:
    """The image ships the kerberos extra too (HDFS with Kerberos, as KServe's initializer can do):
    its sdist-only gssapi in requirements/image-src.txt, everything else in image.txt."""
    project = tomllib.loads((REPO / "pyproject.toml").read_text())["project"]
    deps = project["dependencies"] + project["optional-dependencies"]["kerberos"]
    wheels, sources = pins("requirements/image.txt"), pins("requirements/image-src.txt")
    assert not set(wheels) & set(sources), "a package pinned in both image.txt and image-src.txt"
    locked = wheels | sources
    problems = []
    for dep in map(Requirement, deps):
        version = locked.get(canonicalize_name(dep.name))
        if version is None:
            problems.append(f"{dep.name} is not in requirements/image.txt")
        elif not dep.specifier.contains(version, prereleases=True):
            problems.append(f"{dep.name}=={version} does not satisfy {dep}")
    assert problems == [], "; ".join(problems) + ": run `make lock`"


def test_the_build_lock_pins_the_build_tools() -> None:
    build = pins("requirements/image-build.txt")
    assert set(build) >= {"pip", "setuptools", "wheel", "cython"}  # cython: gssapi's sdist
    requires = tomllib.loads((REPO / "pyproject.toml").read_text())["build-system"]["requires"]
    for req in map(Requirement, requires):
        assert req.specifier.contains(build[canonicalize_name(req.name)]), req
