"""storage-initializer without a network: usage, local and PVC sources, the /mnt/models no-op,
archives from local paths, pair grouping and secret scrubbing. Run as a subprocess."""

from __future__ import annotations

import io
import os
import subprocess
import tarfile
import zipfile
from pathlib import Path

import pytest

from initializer.redact import Scrubber, secret_values
from initializer.run import Pair, group_by_dest
from tests.helpers import REPO, require
from tests.initializer_util import initializer_env, run_initializer

USAGE = "Usage: initializer-entrypoint src_uri_0 dest_path_0 ... src_uri_n dest_path_n"


def _model_dir(root: Path) -> Path:
    root.mkdir(parents=True)
    (root / "config.json").write_text('{"k": 1}')
    (root / "weights").mkdir()
    (root / "weights" / "w.bin").write_bytes(os.urandom(4096))
    (root / ".hidden").write_text("skip me")
    return root


def _tar_gz(path: Path, files: dict[str, bytes]) -> Path:
    with tarfile.open(path, "w:gz") as tf:
        for name, data in files.items():
            info = tarfile.TarInfo(name)
            info.size = len(data)
            tf.addfile(info, io.BytesIO(data))
    return path


@pytest.mark.parametrize("args", [[], ["only-src"], ["a", "b", "c"]])
def test_usage_errors(args: list[str]) -> None:
    r = run_initializer(*args)
    assert r.code == 1
    assert r.err.strip() == USAGE
    assert r.out == ""


def test_console_script_usage() -> None:
    script = REPO / ".venv" / "bin" / "storage-initializer"
    require(script.exists(), "the storage-initializer console script (pip install -e .)")
    proc = subprocess.run([str(script)], env=initializer_env(), capture_output=True, text=True, timeout=60)
    assert proc.returncode == 1 and proc.stderr.strip() == USAGE


def test_local_dir_is_linked_and_existing_names_kept(tmp_path: Path) -> None:
    src = _model_dir(tmp_path / "src")
    dest = tmp_path / "out" / "model"
    r = run_initializer(src, dest)
    assert r.code == 0, r.output
    assert sorted(p.name for p in dest.iterdir()) == ["config.json", "weights"]
    assert os.readlink(dest / "config.json") == str(src / "config.json")
    assert (dest / "weights" / "w.bin").read_bytes() == (src / "weights" / "w.bin").read_bytes()
    # A second run with a name the user already placed: kept, not replaced.
    (dest / "config.json").unlink()
    (dest / "config.json").write_text("mine")
    r = run_initializer(f"file://{src}", dest)
    assert r.code == 0, r.output
    assert (dest / "config.json").read_text() == "mine"
    assert "linked" in r.out and r.out.strip().splitlines()[-1].startswith("done: 1/1 pairs ok")


def test_local_single_file_and_missing(tmp_path: Path) -> None:
    src = tmp_path / "model.onnx"
    src.write_bytes(b"onnx")
    dest = tmp_path / "d"
    r = run_initializer(src, dest)
    assert r.code == 0, r.output
    assert (dest / "model.onnx").read_bytes() == b"onnx"
    r = run_initializer(f"file://{tmp_path}/nope", tmp_path / "d2")
    assert r.code == 1
    assert f"Local path file://{tmp_path}/nope does not exist." in r.err


def test_empty_local_dir_is_an_error(tmp_path: Path) -> None:
    (tmp_path / "empty").mkdir()
    r = run_initializer(tmp_path / "empty", tmp_path / "d")
    assert r.code == 1 and "No model found in" in r.err


def test_local_archive_is_unpacked_and_link_removed(tmp_path: Path) -> None:
    src_dir = tmp_path / "src"
    src_dir.mkdir()
    archive = _tar_gz(src_dir / "model.tar.gz", {"model/a.txt": b"a", "model/b.txt": b"b"})
    dest = tmp_path / "d"
    r = run_initializer(src_dir, dest)
    assert r.code == 0, r.output
    assert sorted(p.name for p in dest.iterdir()) == ["model"]
    assert (dest / "model" / "a.txt").read_bytes() == b"a"
    assert archive.exists()  # the source archive itself is never deleted
    assert "unpacked model.tar.gz (2 files)" in r.out
    assert f"unpacking model.tar.gz into {dest}" in r.out


def test_local_hostile_archive_fails_cleanly(tmp_path: Path) -> None:
    src = tmp_path / "evil.zip"
    with zipfile.ZipFile(src, "w") as zf:
        zf.writestr("../escaped.txt", b"x")
    dest = tmp_path / "d"
    r = run_initializer(src, dest)
    assert r.code == 1
    assert "'../escaped.txt'" in r.err and "evil.zip" in r.err
    assert not (tmp_path / "escaped.txt").exists()
    assert [p.name for p in dest.iterdir()] == ["evil.zip"]  # only the link; no staging left


def test_model_mount_is_a_noop(tmp_path: Path) -> None:
    dest = tmp_path / "d"
    r = run_initializer("/mnt/models/some/model", dest)
    assert r.code == 0, r.output
    assert dest.is_dir() and list(dest.iterdir()) == []
    assert "no-op" in r.out


def test_missing_pvc_path(tmp_path: Path) -> None:
    r = run_initializer("/mnt/pvc/not/there", tmp_path / "d")
    assert r.code == 1
    assert "Cannot locate source uri /mnt/pvc/not/there for PVC" in r.err
    assert (tmp_path / "d").is_dir()  # every DEST is created first, as KServe does


def test_pvc_scheme_resolves_under_mount_root(tmp_path: Path) -> None:
    root = tmp_path / "pvc"
    _model_dir(root / "models" / "m1")
    dest = tmp_path / "d"
    r = run_initializer("pvc://my-claim/models/m1", dest, env={"MODELCACHE_PVC_ROOT": str(root)})
    assert r.code == 0, r.output
    assert (dest / "config.json").read_text() == '{"k": 1}'
    r = run_initializer("pvc://my-claim/models/none", tmp_path / "d2", env={"MODELCACHE_PVC_ROOT": str(root)})
    assert r.code == 1 and "Cannot locate source uri pvc://my-claim/models/none for PVC" in r.err


def test_multiple_pairs_one_failing(tmp_path: Path) -> None:
    a = _model_dir(tmp_path / "a")
    b = tmp_path / "b.bin"
    b.write_bytes(b"b")
    r = run_initializer(a, tmp_path / "da", "/mnt/pvc/missing", tmp_path / "dx", b, tmp_path / "db")
    assert r.code == 1
    assert (tmp_path / "da" / "config.json").exists() and (tmp_path / "db" / "b.bin").exists()
    errors = [line for line in r.err.splitlines() if line.startswith("error:")]
    assert len(errors) == 1 and "/mnt/pvc/missing" in errors[0]
    assert r.out.strip().splitlines()[-1].startswith("FAILED: 2/3 pairs ok")


def test_unknown_scheme_and_bad_uri(tmp_path: Path) -> None:
    r = run_initializer("ftp://host/model.bin", tmp_path / "d", "relative/not/there", tmp_path / "e")
    assert r.code == 1
    lines = [line for line in r.err.splitlines() if line.startswith("error:")]
    assert len(lines) == 2
    assert any(line.startswith("error: ftp://host/model.bin -> ") for line in lines)
    assert any(line.startswith("error: relative/not/there -> ") for line in lines)


def test_settings_error_names_every_pair_without_secret(tmp_path: Path) -> None:
    # A malformed headers variable: its value (likely a secret) must not be echoed.
    env = {"example.com-headers": "Bearer sup3r-s3cret-value"}
    r = run_initializer("https://example.com/m.bin", tmp_path / "d", env=env)
    assert r.code == 1
    assert "example.com-headers" in r.err and "sup3r-s3cret-value" not in r.output


def test_missing_ca_bundle_is_a_warning_for_a_pair_that_is_not_s3(tmp_path: Path) -> None:
    """KServe's rule: a CA bundle ConfigMap without cabundle.crt fails S3 only (see
    test_kserve_credentials); every other pair keeps the default trust store, with a warning."""
    env = {"CA_BUNDLE_CONFIGMAP_NAME": "cabundle", "CA_BUNDLE_VOLUME_MOUNT_POINT": str(tmp_path / "nope")}
    (tmp_path / "src").mkdir()
    (tmp_path / "src" / "m.bin").write_bytes(b"x")
    r = run_initializer(tmp_path / "src", tmp_path / "d", env=env)
    assert r.code == 0, r.output
    assert f"CA bundle file {tmp_path / 'nope' / 'cabundle.crt'} not found" in r.err


def test_group_by_dest_serializes_same_and_nested(tmp_path: Path) -> None:
    pairs = [
        Pair(0, "s0", str(tmp_path / "a")),
        Pair(1, "s1", str(tmp_path / "b")),
        Pair(2, "s2", str(tmp_path / "a") + "/"),
        Pair(3, "s3", str(tmp_path / "b" / "sub")),
        Pair(4, "s4", str(tmp_path / "c")),
        Pair(5, "s5", str(tmp_path / "ab")),
    ]
    groups = sorted([[p.index for p in g] for g in group_by_dest(pairs)])
    assert groups == [[0, 2], [1, 3], [4], [5]]


def test_scrubber_removes_env_secrets_queries_and_userinfo() -> None:
    env = {
        "AWS_SECRET_ACCESS_KEY": "wJalrXUtnFEMI/K7MDENG",
        "AWS_ACCESS_KEY_ID": "AKIAEXAMPLEID",
        "HF_TOKEN": "hf_abcdefghijklmnop",
        "host.example-headers": '{"Authorization": "Bearer tok-123456"}',
        "STORAGE_CONFIG": '{"type": "s3", "access_key_id": "AKIA2", "secret_access_key": "storage-secret-1"}',
        "GOOGLE_APPLICATION_CREDENTIALS": "/var/secrets/gcp.json",
    }
    values = secret_values(env)
    assert "AKIAEXAMPLEID" not in values and "/var/secrets/gcp.json" not in values
    scrub = Scrubber(values)
    text = (
        "failed wJalrXUtnFEMI/K7MDENG hf_abcdefghijklmnop Bearer tok-123456 storage-secret-1 "
        "https://user:pw@h.example/x?sig=abc&se=1 done\nsecond line"
    )
    out = scrub(text)
    for secret in ("wJalrXUtnFEMI/K7MDENG", "hf_abcdefghijklmnop", "tok-123456", "storage-secret-1", "pw@", "sig=abc"):
        assert secret not in out
    assert "https://<redacted>@h.example/x?<redacted> done second line" in out


def test_confidential_mode_is_refused_not_ignored(tmp_path: Path) -> None:
    src = _model_dir(tmp_path / "src")
    r = run_initializer(src, tmp_path / "d", env={"CONFIDENTIAL_ENABLED": "true"})
    assert r.code == 1 and "CONFIDENTIAL_ENABLED" in r.err
    assert list((tmp_path / "d").iterdir()) == []
