"""kill -9 at each step of a publish, then the next command: no manifest ever describes other
bytes, and the next pull ends with one whole revision, verified (issue 33, F3 and point 3).

The review's F3: ``pull --refresh`` killed between the folder swap and the manifest rename left
the new revision's bytes under the old manifest; ``ls`` said present, a plain pull said cached and
``verify`` found the model damaged. A kill at a random moment almost never lands there, so here
the CLI is killed exactly at each step (``modelcache.store.PUBLISH_STEPS``, tests/crashpoints.py):
a replacing publish (refresh), an in-place one (adoption), one into a destination folder, and an
in-place repair's install.
"""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from modelcache.sources.uri import storage_key
from modelcache.store import PUBLISH_STEPS, REPAIR_STEPS, NodeLayout
from tests import crashpoints
from tests.fixtures.http import random_bytes
from tests.pull_helpers import run_cli

pytestmark = pytest.mark.timeout(180)

V1 = {"weights.bin": random_bytes(400_000, seed=1), "sub/config.json": b'{"v": 1}'}
V2 = {"weights.bin": random_bytes(400_000, seed=2), "sub/config.json": b'{"v": 1}'}  # same sizes


def _write(src: Path, files: dict[str, bytes]) -> None:
    for rel, data in files.items():
        (src / rel).parent.mkdir(parents=True, exist_ok=True)
        (src / rel).write_bytes(data)


def _folder(folder: Path) -> dict[str, bytes]:
    return {p.relative_to(folder).as_posix(): p.read_bytes() for p in sorted(folder.rglob("*")) if p.is_file()}


def _present(root: Path, key: str) -> bool:
    out = run_cli("ls", "--root", str(root), "--json")
    assert out.returncode == 0, out.stderr
    return any(e["storage_key"] == key and e["present"] for e in json.loads(out.stdout))


def _consistent(root: Path, key: str, revisions: list[dict[str, bytes]]) -> None:
    """Whatever ``ls`` calls present hashes to its manifest and is one revision, byte for byte."""
    if _present(root, key):
        verify = run_cli("verify", "--root", str(root), key)
        assert verify.returncode == 0, f"present but not what its manifest says: {verify.stdout}"
        assert _folder(root / "models" / key) in revisions


def _steps_of(tmp_path: Path, *args: str) -> list[str]:
    log = tmp_path / "steps.log"
    done = crashpoints.run("none", *args, env={"MODELCACHE_STEPS_LOG": str(log)})
    assert done.returncode == 0, done.stderr
    return crashpoints.steps_reached(log)


def test_every_step_is_reached_by_the_publishes_tested(tmp_path: Path) -> None:
    """The kills below are aimed at real steps: a replacing publish passes all but ``merging``."""
    src, root = tmp_path / "src", tmp_path / "root"
    _write(src, V1)
    assert _steps_of(tmp_path, "pull", str(src), "--root", str(root), "--progress", "none") == [
        s for s in PUBLISH_STEPS if s != "merging"]


@pytest.mark.parametrize("step", [s for s in PUBLISH_STEPS if s != "merging"])
def test_refresh_killed_at_each_step(tmp_path: Path, step: str) -> None:
    src, root = tmp_path / "src", tmp_path / "root"
    _write(src, V1)
    uri = f"file://{src}"
    key = storage_key(uri)
    assert run_cli("pull", uri, "--root", str(root), "--progress", "none").returncode == 0
    _write(src, V2)  # a new revision of the same size
    killed = crashpoints.run(step, "pull", "--refresh", uri, "--root", str(root), "--progress", "none")
    assert killed.returncode == -9, killed.stderr
    _consistent(root, key, [V1, V2])
    if step == "swapped":  # the review's window: new bytes in place, old manifest installed
        assert not _present(root, key), "the old manifest vouched for the new bytes"
    again = run_cli("pull", uri, "--root", str(root), "--progress", "none")
    assert again.returncode == 0, again.stderr
    assert _present(root, key)
    _consistent(root, key, [V1, V2])
    # Once the folder was swapped the new revision is what the store has (and says it is).
    if step != "pending":
        assert _folder(root / "models" / key) == V2
        check = run_cli("pull", "--check", uri, "--root", str(root))
        assert check.returncode == 0 and "up to date" in check.stdout, check.stdout
    refresh = run_cli("pull", "--refresh", uri, "--root", str(root), "--progress", "none")
    assert refresh.returncode == 0, refresh.stderr
    assert _folder(root / "models" / key) == V2 and run_cli("verify", "--root", str(root)).returncode == 0
    assert not NodeLayout(root).staging_dir(key).exists()


def _kserve_filled(root: Path, key: str) -> Path:
    """A folder someone else filled: weights.bin there, config.json missing (adoption fetches it)."""
    folder = root / "models" / key
    folder.mkdir(parents=True)
    (folder / "weights.bin").write_bytes(V1["weights.bin"])
    return folder


@pytest.mark.parametrize("step", PUBLISH_STEPS)
def test_adoption_killed_at_each_step(tmp_path: Path, step: str) -> None:
    src, root = tmp_path / "src", tmp_path / "root"
    _write(src, V1)
    uri = f"file://{src}"
    key = storage_key(uri)
    folder = _kserve_filled(root, key)
    inode = (folder / "weights.bin").stat().st_ino
    killed = crashpoints.run(step, "pull", uri, "--root", str(root), "--progress", "none")
    assert killed.returncode == -9, killed.stderr
    _consistent(root, key, [V1])
    again = run_cli("pull", uri, "--root", str(root), "--progress", "none")
    assert again.returncode == 0, again.stderr
    assert _present(root, key) and _folder(folder) == V1
    assert (folder / "weights.bin").stat().st_ino == inode, "the adopted file was replaced"
    assert run_cli("verify", "--root", str(root)).returncode == 0


@pytest.mark.parametrize("step", PUBLISH_STEPS)
def test_pull_into_a_destination_killed_at_each_step(tmp_path: Path, step: str) -> None:
    src, dest = tmp_path / "src", tmp_path / "dest"
    _write(src, V1)
    uri = f"file://{src}"
    killed = crashpoints.run(step, "pull", uri, "--dest", str(dest), "--progress", "none")
    assert killed.returncode == -9, killed.stderr
    again = run_cli("pull", uri, "--dest", str(dest), "--progress", "none")
    assert again.returncode == 0, again.stderr
    assert {k: v for k, v in _folder(dest).items() if not k.startswith(".modelcache/")} == V1


@pytest.mark.parametrize("step", REPAIR_STEPS)
def test_repair_killed_at_each_step_of_its_install(tmp_path: Path, step: str) -> None:
    src, root = tmp_path / "src", tmp_path / "root"
    _write(src, V1)
    uri = f"file://{src}"
    key = storage_key(uri)
    assert run_cli("pull", uri, "--root", str(root), "--progress", "none").returncode == 0
    folder = root / "models" / key
    data = bytearray((folder / "weights.bin").read_bytes())
    data[5] ^= 1
    (folder / "weights.bin").write_bytes(bytes(data))
    killed = crashpoints.run(step, "verify", "--repair", uri, "--root", str(root), "--progress", "none")
    assert killed.returncode == -9, killed.stderr
    _consistent(root, key, [V1])
    again = run_cli("pull", uri, "--root", str(root), "--progress", "none")
    assert again.returncode == 0, again.stderr
    assert _present(root, key) and _folder(folder) == V1
    assert run_cli("verify", "--root", str(root)).returncode == 0
    layout = NodeLayout(root)
    assert not layout.repair_dir(key).exists() and not layout.damaged_path(key).exists()
