"""`modelcache verify` names the fix when it finds damage, and `verify --repair` applies it: exactly
the damaged or missing files are fetched again, at the revision the manifest names, in place."""

from __future__ import annotations

import os
from pathlib import Path

import pytest

from modelcache.sources.uri import storage_key
from modelcache.store import NodeStore
from tests.hfhub import HubServer
from tests.pull_helpers import run_cli

pytestmark = pytest.mark.timeout(180)


def test_verify_names_the_repair_and_repair_fetches_only_the_damaged_files(hf_hub: HubServer, tmp_path: Path) -> None:
    v1 = {"config.json": b'{"v": 1}\n', "model.safetensors": os.urandom(400_000),
          "tokenizer.json": os.urandom(200_000)}
    repo = hf_hub.create_repo("org/rep")
    first = repo.commit(v1)
    env = {k: v for k, v in os.environ.items() if not k.startswith("HF_")}
    env.update(HF_ENDPOINT=hf_hub.url, HF_HOME=str(tmp_path / "hf-home"), HF_HUB_DISABLE_TELEMETRY="1")
    uri, root = "hf://org/rep", tmp_path / "root"
    assert run_cli("pull", uri, "--root", str(root), "--progress", "none", env=env).returncode == 0
    key = storage_key(uri)
    folder = root / "models" / key
    with open(folder / "model.safetensors", "r+b") as f:  # one byte off: only a re-hash sees it
        f.seek(1234)
        f.write(bytes([v1["model.safetensors"][1234] ^ 1]))
    (folder / "config.json").unlink()
    kept = (folder / "tokenizer.json").stat().st_ino
    folder_ino = folder.stat().st_ino
    repo.commit({"tokenizer.json": os.urandom(200_000)})  # main moves on: the repair must not take it

    check = run_cli("verify", "--root", str(root), env=env)
    assert check.returncode == 1
    assert f"{key}: config.json: missing" in check.stdout and f"{key}: model.safetensors: xxh3-128" in check.stdout
    assert check.stderr.strip() == (f"error: 1 model(s) failed verification; fetch their damaged files again "
                                    f"(nothing else is downloaded): modelcache verify --repair --root {root} {key}")

    hf_hub.requests.clear()
    fix = run_cli("verify", "--repair", "--root", str(root), key, "--progress", "none", env=env)
    assert fix.returncode == 0, fix.stderr
    assert f"{key}: repaired in place: 2 file(s) fetched again (config.json, model.safetensors)" in fix.stdout
    got = [r for r in hf_hub.requests if r.method == "GET" and "/resolve/" in r.path]
    assert got and all(first in r.path for r in got), [r.path for r in got]  # the manifest's commit, not main
    assert not any("tokenizer.json" in r.path for r in hf_hub.requests if r.method == "GET")
    assert (folder / "tokenizer.json").stat().st_ino == kept and folder.stat().st_ino == folder_ino
    assert {p.name: p.read_bytes() for p in folder.iterdir()} == v1
    assert run_cli("verify", "--root", str(root), env=env).returncode == 0
    manifest = NodeStore.at(root).manifest(key)
    assert manifest is not None and manifest.revision == first


def test_repair_that_cannot_be_done_is_one_line_and_keeps_the_files(tmp_path: Path) -> None:
    src, root = tmp_path / "src", tmp_path / "root"
    src.mkdir()
    (src / "a.bin").write_bytes(os.urandom(100_000))
    assert run_cli("pull", str(src), "--root", str(root), "--progress", "none").returncode == 0
    key = storage_key(str(src))
    damaged = bytearray((root / "models" / key / "a.bin").read_bytes())
    damaged[10] ^= 1
    (root / "models" / key / "a.bin").write_bytes(bytes(damaged))
    (src / "a.bin").write_bytes(os.urandom(100_001))  # the source moved: nothing to restore from
    fix = run_cli("verify", "--repair", str(src), "--root", str(root), "--progress", "none")
    assert fix.returncode == 1
    errors = [ln for ln in fix.stderr.splitlines() if ln.startswith("error:")]
    assert len(errors) == 2 and "source changed since the model was downloaded" in errors[0], fix.stderr
    assert errors[1] == "error: 1 of 1 damaged model(s) not repaired"
    assert (root / "models" / key / "a.bin").read_bytes() == bytes(damaged)  # untouched
