"""Drift: `modelcache pull --check` tells, per stored model, whether its source still matches (no
download); `pull --refresh` fetches only what changed and publishes the new model whole."""

from __future__ import annotations

import json
import os
from pathlib import Path

import pytest

from modelcache.sources.uri import storage_key
from modelcache.store import NodeStore
from tests.fixtures.http import NginxServer
from tests.fixtures.s3 import S3Server
from tests.hfhub import HubServer
from tests.pull_helpers import run_cli

pytestmark = pytest.mark.timeout(180)


def rows(stdout: str) -> dict[str, tuple[str, str]]:
    """{storage key: (state, "uri: message")} from `pull --check`."""
    out = {}
    for line in stdout.splitlines():
        key, state, rest = line.split(None, 2)
        out[key] = (state, rest)
    return out


def inodes(folder: Path) -> dict[str, int]:
    return {str(p.relative_to(folder)): p.stat().st_ino for p in folder.rglob("*") if p.is_file()}


def test_s3_check_names_what_changed_and_refresh_fetches_only_that(moto_s3: S3Server, tmp_path: Path) -> None:
    s3, bucket = moto_s3.client(), moto_s3.new_bucket()
    for name, body in {"config.json": b'{"a": 1}', "w1.bin": os.urandom(300_000), "w2.bin": os.urandom(200_000),
                       "old.txt": b"gone soon"}.items():
        s3.put_object(Bucket=bucket, Key=f"m/{name}", Body=body)
    uri, root = f"s3://{bucket}/m", tmp_path / "root"
    env = moto_s3.env()
    assert run_cli("pull", uri, "--root", str(root), "--progress", "none", env=env).returncode == 0
    key = storage_key(uri)
    check = run_cli("pull", "--check", "--root", str(root), env=env)
    assert check.returncode == 0, check.stderr
    assert rows(check.stdout) == {key: ("current", f"{uri}: up to date")}

    s3.put_object(Bucket=bucket, Key="m/config.json", Body=b'{"a": 2}')  # same size, other bytes
    s3.delete_object(Bucket=bucket, Key="m/old.txt")
    s3.put_object(Bucket=bucket, Key="m/new.txt", Body=b"hello")
    before = inodes(root / "models" / key)
    check = run_cli("pull", "--check", "--root", str(root), env=env)
    assert check.returncode == 1, check.stderr
    state, text = rows(check.stdout)[key]
    assert state == "changed"
    assert text.startswith(f"{uri}: 1 changed (config.json: crc32 "), text
    assert text.endswith("; 1 added (new.txt; 5 B); 1 removed (old.txt)"), text
    assert f"bring them up to date (only changed files are fetched): modelcache pull --refresh --root {root} {uri}" \
        in check.stderr
    assert inodes(root / "models" / key) == before  # a check downloads nothing

    refresh = run_cli("pull", "--refresh", uri, "--root", str(root), "--progress", "none", env=env)
    assert refresh.returncode == 0, refresh.stderr
    assert "2 file(s) fetched again (config.json, new.txt), 1 dropped" in refresh.stderr, refresh.stderr
    after = inodes(root / "models" / key)
    assert sorted(after) == ["config.json", "new.txt", "w1.bin", "w2.bin"]
    # Carried over, not fetched: the very same files (hard links of the stored ones).
    assert after["w1.bin"] == before["w1.bin"] and after["w2.bin"] == before["w2.bin"]
    assert (root / "models" / key / "config.json").read_bytes() == b'{"a": 2}'
    assert run_cli("verify", uri, "--root", str(root)).returncode == 0
    assert rows(run_cli("pull", "--check", uri, "--root", str(root), env=env).stdout)[key][0] == "current"
    again = run_cli("pull", "--refresh", "--root", str(root), "--progress", "none", env=env)  # all stored models
    assert again.returncode == 0 and "up to date" in again.stderr, again.stderr


def test_a_refresh_that_fails_midway_leaves_the_stored_model_whole(moto_s3: S3Server, tmp_path: Path) -> None:
    from tests.faultproxy import Fault, FaultProxy

    s3, bucket = moto_s3.client(), moto_s3.new_bucket()
    w1, w2 = os.urandom(300_000), os.urandom(200_000)
    for name, body in {"config.json": b'{"a": 1}', "w1.bin": w1, "w2.bin": w2}.items():
        s3.put_object(Bucket=bucket, Key=f"m/{name}", Body=body)
    host, port = moto_s3.endpoint.split("://", 1)[1].split(":")
    uri, root = f"s3://{bucket}/m", tmp_path / "root"
    with FaultProxy((host, int(port))) as proxy:
        env = moto_s3.env(proxy.base_url)
        assert run_cli("pull", uri, "--root", str(root), "--progress", "none", env=env).returncode == 0
        key = storage_key(uri)
        folder = root / "models" / key
        before, manifest = inodes(folder), NodeStore.at(root).manifest(key)
        s3.put_object(Bucket=bucket, Key="m/config.json", Body=b'{"a": 2, "b": 3}')
        s3.put_object(Bucket=bucket, Key="m/w2.bin", Body=os.urandom(250_000))
        # The new w2.bin cannot be read (403: not retried): the refresh stops after config.json came.
        proxy.add(Fault("status", path=f"/{bucket}/m/w2.bin", status=403, times=None))
        refresh = run_cli("pull", "--refresh", uri, "--root", str(root), "--progress", "none", env=env)
        assert refresh.returncode == 1, refresh.stderr
        assert "w2.bin" in refresh.stderr and "Traceback" not in refresh.stderr
        # Nothing of the half-done refresh shows: the very same files, bytes and manifest.
        assert inodes(folder) == before
        assert (folder / "config.json").read_bytes() == b'{"a": 1}' and (folder / "w2.bin").read_bytes() == w2
        assert NodeStore.at(root).manifest(key) == manifest
        assert run_cli("verify", uri, "--root", str(root)).returncode == 0
        proxy.clear()
        refresh = run_cli("pull", "--refresh", uri, "--root", str(root), "--progress", "none", env=env)
        assert refresh.returncode == 0, refresh.stderr
        assert "2 file(s) fetched again (config.json, w2.bin)" in refresh.stderr, refresh.stderr
        assert (folder / "config.json").read_bytes() == b'{"a": 2, "b": 3}'
        assert inodes(folder)["w1.bin"] == before["w1.bin"]


def test_hf_check_sees_the_branch_move_and_refresh_takes_only_the_changed_file(
        hf_hub: HubServer, tmp_path: Path) -> None:
    big = os.urandom(300_000)
    repo = hf_hub.create_repo("org/drift")
    first = repo.commit({"config.json": b'{"v": 1}\n', "model.safetensors": big})
    env = {k: v for k, v in os.environ.items() if not k.startswith("HF_")}
    env.update(HF_ENDPOINT=hf_hub.url, HF_HOME=str(tmp_path / "hf-home"), HF_HUB_DISABLE_TELEMETRY="1")
    uri, root = "hf://org/drift", tmp_path / "root"
    assert run_cli("pull", uri, "--root", str(root), "--progress", "none", env=env).returncode == 0
    second = repo.commit({"config.json": b'{"v": 2}\n'})
    check = run_cli("pull", "--check", uri, "--root", str(root), "--json", env=env)
    assert check.returncode == 1
    (d,) = json.loads(check.stdout)
    assert (d["state"], d["stored_revision"], d["source_revision"]) == ("changed", first, second)
    assert d["changed"] == ["config.json"] and d["keep"] == ["model.safetensors"]
    assert d["message"].startswith(f"revision {first} -> {second}; 1 changed (config.json: ")
    hf_hub.requests.clear()
    refresh = run_cli("pull", "--refresh", uri, "--root", str(root), "--progress", "none", env=env)
    assert refresh.returncode == 0, refresh.stderr
    fetched = [r.path for r in hf_hub.requests if r.method == "GET" and ("/resolve/" in r.path or r.origin == "cdn")]
    assert fetched and all("config.json" in p for p in fetched), fetched  # the 300 kB file was not fetched again
    manifest = NodeStore.at(root).manifest(storage_key(uri))
    assert manifest is not None and manifest.revision == second
    assert (root / "models" / storage_key(uri) / "config.json").read_bytes() == b'{"v": 2}\n'


def test_http_without_a_digest_is_compared_by_its_etag(nginx: NginxServer, tmp_path: Path) -> None:
    nginx.write("h/w.bin", 100_000, seed=1)
    uri, root = nginx.url("h/w.bin"), tmp_path / "root"
    assert run_cli("pull", uri, "--root", str(root), "--progress", "none").returncode == 0
    manifest = NodeStore.at(root).manifest(storage_key(uri))
    assert manifest is not None and manifest.files[0].version  # the ETag, kept for this comparison
    assert rows(run_cli("pull", "--check", "--root", str(root)).stdout)[storage_key(uri)][0] == "current"
    path = nginx.write("h/w.bin", 100_000, seed=2)  # same size, new bytes: nginx's ETag has the mtime
    os.utime(path, (1_000_000_000, 1_000_000_000))
    check = run_cli("pull", "--check", "--root", str(root))
    assert check.returncode == 1
    assert rows(check.stdout)[storage_key(uri)] == ("changed", f"{uri}: 1 changed (w.bin: version changed)")


def test_a_source_that_is_gone_or_a_model_not_stored_is_an_error_line(tmp_path: Path) -> None:
    src, root = tmp_path / "m", tmp_path / "root"
    src.mkdir()
    (src / "w.bin").write_bytes(b"x" * 1000)
    assert run_cli("pull", str(src), "--root", str(root), "--progress", "none").returncode == 0
    (src / "w.bin").unlink()
    src.rmdir()
    check = run_cli("pull", "--check", str(src), str(tmp_path / "other"), "--root", str(root))
    assert check.returncode == 1
    got = rows(check.stdout)
    assert got[storage_key(str(src))][0] == "error" and "no such file or directory" in got[storage_key(str(src))][1]
    assert got[storage_key(str(tmp_path / "other"))] == ("error", f"{tmp_path / 'other'}: not in the store at "
                                                                  f"{root} (pull it first)")


def test_the_agent_reports_drift_in_status_and_keeps_serving_what_it_has(tmp_path: Path) -> None:
    import subprocess

    from tests.agent_util import agent_cmd, status_of, write_node
    from tests.helpers import REPO, wait_until

    src = tmp_path / "src"
    src.mkdir()
    (src / "w.bin").write_bytes(os.urandom(100_000))
    (src / "config.json").write_text("{}")
    spec, root = tmp_path / "node.yaml", tmp_path / "root"
    write_node(spec, [{"modelName": "m", "sourceModelUri": str(src)}])
    proc = subprocess.Popen(agent_cmd(spec, root, "--watch", "--drift-check-interval", "0.3"), cwd=REPO,
                            stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
    status = spec.with_name("node.yaml.status.yaml")
    try:
        wait_until(lambda: status.exists() and status_of(spec)["modelStatus"] == {"m": "ModelDownloaded"},
                   timeout=30, what="downloaded")
        folder = root / "models" / storage_key(str(src))
        before = inodes(folder)
        (src / "config.json").write_text('{"v": 2}')
        wait_until(lambda: "drift" in status_of(spec)["modelDetails"]["m"], timeout=30, what="drift reported")
        detail = status_of(spec)["modelDetails"]["m"]
        assert detail["drift"] == "1 changed (config.json: size 2 -> 8)"
        assert detail["state"] == "ModelDownloaded" and inodes(folder) == before  # reported, not applied
        assert (folder / "config.json").read_text() == "{}"
        refresh = run_cli("pull", "--refresh", str(src), "--root", str(root), "--progress", "none")
        assert refresh.returncode == 0, refresh.stderr
        wait_until(lambda: "drift" not in status_of(spec)["modelDetails"]["m"], timeout=30, what="drift cleared")
    finally:
        proc.terminate()
        out, _ = proc.communicate(timeout=30)
    assert "the source changed since the download; serving what was downloaded" in out
