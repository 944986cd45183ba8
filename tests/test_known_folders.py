"""A folder the store knew is checked against what the store recorded, never trusted on sizes
(issue 33, F1 and F2; issue 27, "repairs that stay honest").

Each test is a step of an integrity review done as the review did it, with the CLI and a
``file://`` origin (no checksums: only the store's own digests can tell a damaged file from a
good one). Before the fix each ended with wrong bytes and ``verify`` saying ok.
"""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from modelcache.sources.uri import storage_key
from modelcache.store import NodeLayout, NodeStore
from tests import crashpoints
from tests.fixtures.http import random_bytes
from tests.pull_helpers import run_cli

pytestmark = pytest.mark.timeout(180)

A_SIZE = 300_000


def _origin(tmp_path: Path) -> tuple[Path, str, Path, Path]:
    """An origin folder (a.bin, b.json), pulled into a store: (src, uri, root, model folder)."""
    src = tmp_path / "src"
    src.mkdir()
    (src / "a.bin").write_bytes(random_bytes(A_SIZE, seed=1))
    (src / "b.json").write_bytes(b'{"v": 1}')
    root = tmp_path / "root"
    uri = f"file://{src}"
    pulled = run_cli("pull", uri, "--root", str(root), "--progress", "none")
    assert pulled.returncode == 0, pulled.stderr
    return src, uri, root, root / "models" / storage_key(uri)


def _flip(path: Path, at: int = 1000) -> bytes:
    """One byte of ``path`` flipped (same size); returns the damaged bytes."""
    data = bytearray(path.read_bytes())
    data[at] ^= 0xFF
    path.write_bytes(bytes(data))
    return bytes(data)


def _ls(root: Path, key: str) -> dict[str, object]:
    out = run_cli("ls", "--root", str(root), "--json")
    assert out.returncode == 0, out.stderr
    (entry,) = [e for e in json.loads(out.stdout) if e["storage_key"] == key]
    return entry


def _no_repair_records(root: Path, key: str) -> None:
    layout = NodeLayout(root)
    assert not layout.repair_dir(key).exists() and not layout.pin_path(key).exists()
    assert not layout.damaged_path(key).exists() and not layout.staging_dir(key).exists()


def _healthy(root: Path, key: str, src: Path) -> None:
    """Present, verified, byte for byte the origin as it is now, nothing of a repair left."""
    folder = root / "models" / key
    assert {p.name: p.read_bytes() for p in folder.iterdir()} == {p.name: p.read_bytes() for p in src.iterdir()}
    assert _ls(root, key)["present"] is True
    verify = run_cli("verify", "--root", str(root), key)
    assert verify.returncode == 0 and verify.stdout.strip() == f"{key}: ok", verify.stdout + verify.stderr
    _no_repair_records(root, key)


def test_f1_refresh_fetches_a_stored_file_that_no_longer_matches_its_digest(tmp_path: Path) -> None:
    """F1: one byte of the stored a.bin flipped, b.json changed at the origin, ``pull --refresh``:
    a.bin was hard-linked into the new model unread and its old digest written into the new
    manifest ("1 file(s) fetched again (b.json)", ``verify`` then failed)."""
    src, uri, root, folder = _origin(tmp_path)
    key = storage_key(uri)
    _flip(folder / "a.bin")
    (src / "b.json").write_bytes(b'{"v": 2}')
    res = run_cli("pull", "--refresh", uri, "--root", str(root), "--progress", "none")
    assert res.returncode == 0, res.stderr
    assert "1 file(s) fetched again (b.json)" in res.stderr
    assert f"{key}: 1 stored file(s) no longer matched their digests and were fetched again (a.bin)" in res.stderr
    _healthy(root, key, src)


def test_f1_refresh_still_carries_files_that_match_without_reading_the_origin(tmp_path: Path) -> None:
    """The check costs a read of the stored file, never a download: a.bin stays the same inode."""
    src, uri, root, folder = _origin(tmp_path)
    inode = (folder / "a.bin").stat().st_ino
    (src / "b.json").write_bytes(b'{"v": 2}')
    res = run_cli("pull", "--refresh", uri, "--root", str(root), "--progress", "none", "--json")
    assert res.returncode == 0, res.stderr
    (out,) = json.loads(res.stdout)
    assert out["refreshed"] == ["b.json"] and out["refetched"] == []
    assert (folder / "a.bin").stat().st_ino == inode
    _healthy(root, storage_key(uri), src)


def test_f2a_a_refused_repair_keeps_the_manifest_marked_damaged_and_the_next_pull_fetches_the_damage(
        tmp_path: Path) -> None:
    """F2/A (issue 27's "wrong result"): a.bin damaged, the origin's a.bin rewritten (same size),
    ``verify --repair`` refused; the next plain ``pull`` adopted the folder on sizes and kept the
    damaged copy (neither origin revision), and ``verify`` said ok."""
    src, uri, root, folder = _origin(tmp_path)
    key = storage_key(uri)
    damaged = _flip(folder / "a.bin")
    (src / "a.bin").write_bytes(random_bytes(A_SIZE, seed=2))
    fix = run_cli("verify", "--repair", uri, "--root", str(root), "--progress", "none")
    assert fix.returncode == 1
    assert "source changed since the model was downloaded" in fix.stderr
    assert f"{key}: kept as it is, marked damaged (not present); `modelcache pull --root {root} {uri}`" in fix.stderr
    # Refused: the manifest stays, the model is marked damaged (not present), nothing of the repair is left.
    assert (folder / "a.bin").read_bytes() == damaged
    store = NodeStore.at(root)
    damage = store.damage(key)
    assert store.manifest(key) is not None and damage is not None and damage.files == ("a.bin",)
    assert not NodeLayout(root).repair_dir(key).exists() and not NodeLayout(root).pin_path(key).exists()
    entry = _ls(root, key)
    assert entry["present"] is False and entry["damaged"] is True
    listing = run_cli("ls", "--root", str(root))
    assert f"{key}  damaged" in listing.stdout and f"damaged: `modelcache verify --repair --root {root} KEY`" in \
        listing.stderr  # the hints name the --root they were given (issue 27, C12)
    assert run_cli("verify", "--root", str(root), key).returncode == 1
    # The next plain pull fetches the damaged file (at the origin's current revision).
    again = run_cli("pull", uri, "--root", str(root), "--progress", "none", "--json")
    assert again.returncode == 0, again.stderr
    (out,) = json.loads(again.stdout)
    assert out["cached"] is False and out["adopted"] == 0 and "a.bin" in out["refetched"]
    _healthy(root, key, src)
    check = run_cli("pull", "--check", uri, "--root", str(root))
    assert check.returncode == 0 and "up to date" in check.stdout, check.stdout


def test_f2a_a_pull_after_a_refused_repair_with_the_source_unchanged_elsewhere_keeps_the_good_files(
        tmp_path: Path) -> None:
    """The damaged file alone is fetched when nothing else moved: b.json stays the same inode."""
    src, uri, root, folder = _origin(tmp_path)
    key = storage_key(uri)
    _flip(folder / "a.bin")
    (src / "a.bin").write_bytes(random_bytes(A_SIZE + 1, seed=2))  # resized: refused from the listing
    inode = (folder / "b.json").stat().st_ino
    assert run_cli("verify", "--repair", uri, "--root", str(root), "--progress", "none").returncode == 1
    again = run_cli("pull", uri, "--root", str(root), "--progress", "none", "--json")
    assert again.returncode == 0, again.stderr
    assert (folder / "b.json").stat().st_ino == inode
    _healthy(root, key, src)


def test_verify_marks_what_it_finds_and_a_plain_pull_then_fetches_it(tmp_path: Path) -> None:
    """A model ``verify`` found damaged was still "present" on sizes: a plain pull answered cached."""
    src, uri, root, folder = _origin(tmp_path)
    key = storage_key(uri)
    _flip(folder / "a.bin")
    assert run_cli("verify", "--root", str(root)).returncode == 1
    assert _ls(root, key)["damaged"] is True
    again = run_cli("pull", uri, "--root", str(root), "--progress", "none", "--json")
    assert again.returncode == 0, again.stderr
    (out,) = json.loads(again.stdout)
    assert out["cached"] is False and out["refetched"] == ["a.bin"] and out["refreshed"] == []
    _healthy(root, key, src)


def _break_manifest(root: Path, key: str, field: str) -> None:
    """One character of the manifest changed (its seal no longer matches): ``created_at`` (the
    review's case), or b.json's recorded digest (the record then names a wrong digest)."""
    mpath = NodeLayout(root).manifest_path(key)
    doc = json.loads(mpath.read_text())
    if field == "created_at":
        doc["created_at"] = doc["created_at"].replace("2", "3", 1)
    else:
        (entry,) = [f for f in doc["files"] if f["path"] == "b.json"]
        entry["xxh3"] = ("1" if entry["xxh3"][0] != "1" else "2") + entry["xxh3"][1:]
    mpath.write_text(json.dumps(doc))


@pytest.mark.parametrize("field", ["created_at", "digest"])
def test_f2b_a_damaged_manifest_is_never_a_reason_to_adopt_on_sizes(tmp_path: Path, field: str) -> None:
    """F2/B: one character of the manifest's ``created_at`` changed (the seal breaks), a.bin damaged:
    the plain pull adopted the folder and kept the damaged a.bin; ``verify`` said ok."""
    src, uri, root, folder = _origin(tmp_path)
    key = storage_key(uri)
    _flip(folder / "a.bin")
    _break_manifest(root, key, field)
    store = NodeStore.at(root)
    assert store.manifest(key) is None and store.knew(key)
    again = run_cli("pull", uri, "--root", str(root), "--progress", "none", "--json")
    assert again.returncode == 0, again.stderr
    (out,) = json.loads(again.stdout)
    # A file is kept only if it hashes to what the record says: b.json too is fetched where its
    # recorded digest is the damaged character.
    assert out["adopted"] == 0 and out["refetched"] == (["a.bin"] if field == "created_at" else ["a.bin", "b.json"])
    _healthy(root, key, src)


def test_f2b_an_unreadable_manifest_means_every_file_is_fetched_again(tmp_path: Path) -> None:
    src, uri, root, folder = _origin(tmp_path)
    key = storage_key(uri)
    _flip(folder / "a.bin")
    NodeLayout(root).manifest_path(key).write_text("{not json")
    again = run_cli("pull", uri, "--root", str(root), "--progress", "none", "--json")
    assert again.returncode == 0, again.stderr
    (out,) = json.loads(again.stdout)
    assert out["adopted"] == 0 and out["cached"] is False
    _healthy(root, key, src)


def test_f2c_a_repair_killed_during_its_download_is_not_adopted_by_the_next_pull(tmp_path: Path) -> None:
    """F2/C: kill -9 of ``verify --repair`` during its download (here: exactly when the repair's
    download publishes, the damaged model marked and the download there); the plain CLI pull
    then ignored what the store knew and adopted the folder on sizes, keeping the damaged a.bin."""
    src, uri, root, folder = _origin(tmp_path)
    key = storage_key(uri)
    _flip(folder / "a.bin")
    killed = crashpoints.run("pending", "verify", "--repair", uri, "--root", str(root), "--progress", "none")
    assert killed.returncode == -9, killed.stderr
    assert NodeLayout(root).repair_dir(key).exists() and NodeStore.at(root).damage(key) is not None
    assert _ls(root, key)["present"] is False
    again = run_cli("pull", uri, "--root", str(root), "--progress", "none", "--json")
    assert again.returncode == 0, again.stderr
    (out,) = json.loads(again.stdout)
    assert out["adopted"] == 0 and out["refetched"] == ["a.bin"]
    _healthy(root, key, src)


def test_f2c_a_repair_pin_left_by_an_older_version_is_the_record_the_pull_checks_against(tmp_path: Path) -> None:
    """An older version moved a damaged model's manifest to ``repair/<key>.pinned.json``: the CLI
    pull (unlike the agent) did not look at it and adopted the folder on sizes."""
    src, uri, root, folder = _origin(tmp_path)
    key = storage_key(uri)
    _flip(folder / "a.bin")
    layout = NodeLayout(root)
    layout.pin_path(key).parent.mkdir(parents=True)
    layout.manifest_path(key).rename(layout.pin_path(key))
    layout.repair_dir(key).mkdir()
    again = run_cli("pull", uri, "--root", str(root), "--progress", "none", "--json")
    assert again.returncode == 0, again.stderr
    (out,) = json.loads(again.stdout)
    assert out["adopted"] == 0 and out["refetched"] == ["a.bin"]
    _healthy(root, key, src)


def test_rm_takes_the_damage_mark_with_the_model(tmp_path: Path) -> None:
    _src, uri, root, folder = _origin(tmp_path)
    key = storage_key(uri)
    _flip(folder / "a.bin")
    assert run_cli("verify", "--root", str(root)).returncode == 1
    assert run_cli("rm", key, "--root", str(root)).returncode == 0
    assert not NodeStore.at(root).has(key)
    _no_repair_records(root, key)


@pytest.mark.parametrize("field", ["created_at", "digest"])
def test_f2b_the_agent_repairs_a_folder_whose_manifest_broke_instead_of_adopting_it(
        tmp_path: Path, field: str) -> None:
    """The same folder through the agent (standalone): it takes the path the CLI takes, the store's
    record, never sizes; where pods may read the folder it fixes the damaged file in place."""
    from tests.agent_util import run_agent, status_of, write_node

    src = tmp_path / "src"
    src.mkdir()
    (src / "a.bin").write_bytes(random_bytes(A_SIZE, seed=1))
    (src / "b.json").write_bytes(b'{"v": 1}')
    uri = f"file://{src}"
    key = storage_key(uri)
    root = tmp_path / "root"
    spec = write_node(tmp_path / "node.yaml", [{"modelName": "m", "sourceModelUri": uri}])
    assert run_agent(spec, root).returncode == 0
    folder = root / "models" / key
    _flip(folder / "a.bin")
    inode = (folder / "b.json").stat().st_ino
    _break_manifest(root, key, field)
    proc = run_agent(spec, root)
    assert proc.returncode == 0, proc.stderr[-2000:]
    assert "replaced=a.bin" in proc.stderr and "adopting" not in proc.stderr, proc.stderr
    assert status_of(spec)["modelStatus"] == {"m": "ModelDownloaded"}
    assert (folder / "b.json").stat().st_ino == inode
    _healthy(root, key, src)
