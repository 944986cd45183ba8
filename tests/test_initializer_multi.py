"""storage-initializer across schemes (S3 on moto, GCS emulator, Azurite, the test Hugging Face Hub,
OCI registry, WebHDFS, nginx, a local folder), with STORAGE_CONFIG credentials and allow/ignore patterns."""

from __future__ import annotations

import io
import json
import os
import tarfile
import time
from pathlib import Path

import pytest

from tests.fixtures.azure import AzureServer
from tests.fixtures.gcs import GCSServer
from tests.fixtures.http import NginxServer
from tests.fixtures.oci import LAYER_TAR, OCIRegistry
from tests.fixtures.oci import make_tar as oci_make_tar
from tests.fixtures.s3 import S3Server
from tests.hfhub import HubServer
from tests.initializer_util import run_initializer
from tests.webhdfs import WebHDFSServer


def _files(dest: Path) -> dict[str, bytes]:
    return {
        p.relative_to(dest).as_posix(): p.read_bytes()
        for p in dest.rglob("*")
        if p.is_file() and not p.relative_to(dest).as_posix().startswith(".modelcache")
    }


def _spec(s3: S3Server, secret: str | None = None) -> str:
    return json.dumps(
        {
            "type": "s3",
            "access_key_id": s3.access_key,
            "secret_access_key": secret or s3.secret_key,
            "endpoint_url": s3.endpoint,
            "region": s3.region,
        }
    )


@pytest.fixture
def bucket(moto_s3: S3Server) -> str:
    name = moto_s3.new_bucket()
    c = moto_s3.client()
    for key, body in {
        "m/config.json": b'{"a": 1}',
        "m/w.bin": os.urandom(300_000),
        "m/extra/notes.txt": b"notes",
        "m_v2/other.bin": b"not this model",  # KServe's raw prefix would take it; '/'-bounded we don't
    }.items():
        c.put_object(Bucket=name, Key=key, Body=body)
    buf = io.BytesIO()
    with tarfile.open(fileobj=buf, mode="w:gz") as tf:
        info = tarfile.TarInfo("model/weights.bin")
        data = os.urandom(20_000)
        info.size = len(data)
        tf.addfile(info, io.BytesIO(data))
    c.put_object(Bucket=name, Key="arch/model.tar.gz", Body=buf.getvalue())
    return name


def test_pairs_of_every_scheme_in_one_run(
    moto_s3: S3Server, bucket: str, hf_hub: HubServer, nginx: NginxServer, tmp_path: Path
) -> None:
    hf_hub.create_repo("org/tiny").commit({"config.json": b"{}", "model.safetensors": os.urandom(70_000)})
    nginx.write("h/model.onnx", 50_000)
    local = tmp_path / "local"
    local.mkdir()
    (local / "x.txt").write_text("x")
    out = tmp_path / "mnt"
    env = {
        # Credentials only from the storage-spec secret, as KServe's webhook injects them.
        "STORAGE_CONFIG": _spec(moto_s3),
        "HF_ENDPOINT": hf_hub.url,
        "HF_HOME": str(tmp_path / "hf-home"),
    }
    args = [
        f"s3://{bucket}/m", out / "s3",
        f"s3://{bucket}/arch/model.tar.gz", out / "s3-archive",
        "hf://org/tiny", out / "hf",
        nginx.url("h/model.onnx"), out / "http",
        str(local), out / "local",
    ]
    r = run_initializer(*args, env=env)
    assert r.code == 0, r.output
    assert sorted(_files(out / "s3")) == ["config.json", "extra/notes.txt", "w.bin"]
    assert sorted(_files(out / "s3-archive")) == ["model/weights.bin"]
    assert sorted(_files(out / "hf")) == ["config.json", "model.safetensors"]
    assert sorted(_files(out / "http")) == ["model.onnx"]
    assert (out / "local" / "x.txt").read_text() == "x"
    assert moto_s3.secret_key not in r.output
    assert r.out.strip().splitlines()[-1].startswith("done: 5/5 pairs ok")

    # Everything complete: the second run lists nothing and fetches nothing anywhere.
    nginx.clear_access_log()
    hub_requests = hf_hub.count()
    r = run_initializer(*args, env=env)
    assert r.code == 0, r.output
    time.sleep(0.2)
    assert nginx.access_log() == [] and hf_hub.count() == hub_requests
    assert r.out.count("cached:") == 4 and r.out.count("linked:") == 1


def test_allow_and_ignore_patterns(moto_s3: S3Server, bucket: str, tmp_path: Path) -> None:
    env = {
        **moto_s3.env(),
        "STORAGE_ALLOW_PATTERNS": '["*.json", "*.bin", "extra/*"]',
        "STORAGE_IGNORE_PATTERNS": "extra/*",
    }
    r = run_initializer(f"s3://{bucket}/m", tmp_path / "d", env=env)
    assert r.code == 0, r.output
    assert sorted(_files(tmp_path / "d")) == ["config.json", "w.bin"]
    r = run_initializer(f"s3://{bucket}/m", tmp_path / "e", env={**env, "STORAGE_ALLOW_PATTERNS": "*.nothing"})
    assert r.code == 1 and f"s3://{bucket}/m" in r.err


def test_storage_config_with_a_wrong_secret(moto_s3: S3Server, bucket: str, tmp_path: Path) -> None:
    wrong = "WrongSecretValue" + "x" * 24
    r = run_initializer(f"s3://{bucket}/m", tmp_path / "d", env={"STORAGE_CONFIG": _spec(moto_s3, wrong)})
    assert r.code == 1
    (line,) = [x for x in r.err.splitlines() if x.startswith("error:")]
    assert f"s3://{bucket}/m" in line
    assert wrong not in r.output and moto_s3.secret_key not in r.output


def test_oci_fetch_mode_modelcar_image(oci_registry: OCIRegistry, oci_repo: str, tmp_path: Path) -> None:
    """KServe's OCI fetch mode runs the initializer on oci+fetch://: the image's /models tree lands in DEST."""
    weights = os.urandom(40_000)
    layer = oci_make_tar([("usr/bin/tool", b"t"), ("models/config.json", b"{}"), ("models/w/model.bin", weights)])
    oci_registry.push_image(oci_repo, "v1", [(layer, LAYER_TAR)])
    env = {"KSERVE_OCI_INSECURE_REGISTRY": "true", "KSERVE_OCI_DOCKER_CONFIG": str(tmp_path / "none.json")}
    uri = f"oci+fetch://{oci_registry.host}/{oci_repo}:v1"
    r = run_initializer(uri, tmp_path / "d", env=env)
    assert r.code == 0, r.output
    assert _files(tmp_path / "d") == {"config.json": b"{}", "w/model.bin": weights}
    r = run_initializer(uri, tmp_path / "d", env=env)
    assert r.code == 0 and "cached:" in r.out, r.output


def test_hdfs_from_storage_config_spec(webhdfs: WebHDFSServer, tmp_path: Path) -> None:
    """KServe's storage spec of type hdfs: its keys become the HDFS secret-dir files."""
    webhdfs.put("/models/bert/config.json", b"{}")
    webhdfs.put("/models/bert/w/model.bin", b"w" * 70_000)
    spec = {"type": "hdfs", "HDFS_NAMENODE": webhdfs.url, "HEADERS": json.dumps({"X-Gw": "hdfs-header-secret"})}
    r = run_initializer("hdfs://models/bert", tmp_path / "d", env={"STORAGE_CONFIG": json.dumps(spec)})
    assert r.code == 0, r.output
    assert _files(tmp_path / "d") == {"config.json": b"{}", "w/model.bin": b"w" * 70_000}
    # Without the spec there is no namenode: a clear error naming the URI, and no secret.
    spec.pop("HDFS_NAMENODE")
    r = run_initializer("hdfs://models/bert", tmp_path / "e", env={"STORAGE_CONFIG": json.dumps(spec)})
    assert r.code == 1 and "hdfs://models/bert" in r.err and "hdfs-header-secret" not in r.output


def test_gcs_and_azure_pairs(gcs_emulator: GCSServer, azurite: AzureServer, tmp_path: Path) -> None:
    weights = os.urandom(120_000)
    bucket = gcs_emulator.new_bucket()
    gbucket = gcs_emulator.client().bucket(bucket)
    gbucket.blob("m/config.json").upload_from_string(b"{}")
    gbucket.blob("m/w/model.bin").upload_from_string(weights)
    container = azurite.new_container()
    cc = azurite.service().get_container_client(container)
    cc.upload_blob("m/config.json", b'{"az": 1}')
    cc.upload_blob("m/model.bin", weights)
    env = {**gcs_emulator.env(), **azurite.env(), "STORAGE_IGNORE_PATTERNS": "*.json"}
    r = run_initializer(
        f"gs://{bucket}/m", tmp_path / "gcs", azurite.uri(container, "m"), tmp_path / "az", env=env
    )
    assert r.code == 0, r.output
    assert _files(tmp_path / "gcs") == {"w/model.bin": weights}
    assert _files(tmp_path / "az") == {"model.bin": weights}
    assert azurite.key not in r.output
    r = run_initializer(
        f"gs://{bucket}/m", tmp_path / "gcs", azurite.uri(container, "m"), tmp_path / "az", env=env
    )
    assert r.code == 0 and r.out.count("cached:") == 2, r.output
