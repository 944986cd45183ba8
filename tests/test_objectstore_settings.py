"""Object-store settings from KServe's environment contract and the storage-spec secret."""

from __future__ import annotations

import base64
import json
import os

import pytest

from modelcache.errors import ModelcacheError
from modelcache.sources.credentials import Settings


def test_s3_from_kserve_env() -> None:
    s = Settings.from_env(
        {
            "AWS_ACCESS_KEY_ID": "AKID",
            "AWS_SECRET_ACCESS_KEY": "SECRET1",
            "AWS_SESSION_TOKEN": "TOKEN1",
            "AWS_ENDPOINT_URL": "https://minio.local:9000",
            "AWS_REGION": "eu-west-1",
            "S3_VERIFY_SSL": "0",
            "AWS_CA_BUNDLE": "/etc/ca.pem",
            "awsAnonymousCredential": "true",
            "S3_USER_VIRTUAL_BUCKET": "true",
            "S3_USE_ACCELERATE": "true",
        }
    ).s3
    assert (s.access_key_id, s.secret_access_key, s.session_token) == ("AKID", "SECRET1", "TOKEN1")
    assert s.endpoint_url == "https://minio.local:9000" and s.region == "eu-west-1"
    assert s.verify is False and s.ca_bundle is None  # verification off: no bundle
    assert s.anonymous and s.virtual_addressing and s.use_accelerate
    assert "SECRET1" not in repr(s) and "TOKEN1" not in repr(s) and "AKID" not in repr(s)


def test_s3_region_precedence_and_ca_bundle(tmp_path) -> None:
    ca = tmp_path / "ca.pem"
    ca.write_text("-----BEGIN CERTIFICATE-----\n")
    env = {"AWS_DEFAULT_REGION": "us-west-2", "AWS_REGION": "eu-west-1", "AWS_CA_BUNDLE": str(ca)}
    s = Settings.from_env(env).s3
    assert s.region == "us-west-2" and s.verify and s.ca_bundle == str(ca)
    from modelcache.sources.base import open_source

    # Checked when S3 is used (an HTTP pull must not fail on it), with KServe's message.
    settings = Settings.from_env({"AWS_CA_BUNDLE": "/nope.pem"})
    with pytest.raises(ModelcacheError, match=r"Failed to find ca bundle file\(/nope.pem\)"):
        open_source("s3://bucket/m", settings).list_files()
    assert Settings.from_env({"S3_VERIFY_SSL": "false"}).s3.verify is False
    assert Settings.from_env({"S3_VERIFY_SSL": "1"}).s3.verify is True


@pytest.mark.parametrize(
    ("env", "expected"),
    [
        ({"S3_ENDPOINT": "minio:9000"}, "https://minio:9000"),
        ({"S3_ENDPOINT": "minio:9000", "S3_USE_HTTPS": "0"}, "http://minio:9000"),
        ({"S3_ENDPOINT": "minio:9000", "S3_USE_HTTPS": "1"}, "https://minio:9000"),
        ({"S3_ENDPOINT": "http://minio:9000", "S3_USE_HTTPS": "1"}, "http://minio:9000"),
        ({"S3_ENDPOINT": "minio:9000", "AWS_ENDPOINT_URL": "http://other:1"}, "http://other:1"),
        ({}, None),
    ],
)
def test_s3_endpoint_from_annotation_envs(env: dict[str, str], expected: str | None) -> None:
    assert Settings.from_env(env).s3.endpoint_url == expected


def test_storage_config_overrides_env_and_override_config_wins() -> None:
    spec = {
        "type": "s3",
        "endpoint_url": "http://spec:9000",
        "access_key_id": "SPECKEY",
        "secret_access_key": "SPECSECRET",
        "region": "ap-south-1",
        "ca_bundle": "/spec/ca.pem",
        "verify_ssl": False,
        "anonymous": False,
        "bucket": "ignored",
    }
    env = {"AWS_ACCESS_KEY_ID": "ENVKEY", "AWS_SECRET_ACCESS_KEY": "ENVSECRET", "STORAGE_CONFIG": json.dumps(spec)}
    s = Settings.from_env(env).s3
    assert (s.access_key_id, s.secret_access_key) == ("SPECKEY", "SPECSECRET")
    assert (s.endpoint_url, s.region, s.verify, s.anonymous) == ("http://spec:9000", "ap-south-1", False, False)
    env["STORAGE_OVERRIDE_CONFIG"] = json.dumps({"secret_access_key": "OVERRIDE", "verify_ssl": "1"})
    assert Settings.from_env(env).s3.ca_bundle == "/spec/ca.pem"  # verification back on
    env["STORAGE_OVERRIDE_CONFIG"] = json.dumps({"secret_access_key": "OVERRIDE", "ca_bundle": ""})
    s = Settings.from_env(env).s3
    assert (s.access_key_id, s.secret_access_key, s.verify) == ("SPECKEY", "OVERRIDE", False)
    # A spec of another type leaves S3 alone.
    s = Settings.from_env({"AWS_ACCESS_KEY_ID": "ENVKEY", "STORAGE_CONFIG": json.dumps({"type": "hdfs"})}).s3
    assert s.access_key_id == "ENVKEY"


def test_invalid_storage_config_never_echoes_the_secret() -> None:
    with pytest.raises(ModelcacheError, match="STORAGE_CONFIG") as err:
        Settings.from_env({"STORAGE_CONFIG": '{"type": "s3", "secret_access_key": "TOPSECRET"'})
    assert "TOPSECRET" not in str(err.value)
    with pytest.raises(ModelcacheError, match="STORAGE_OVERRIDE_CONFIG"):
        Settings.from_env({"STORAGE_OVERRIDE_CONFIG": "[1]"})


def test_gcs_settings() -> None:
    g = Settings.from_env(
        {"GOOGLE_APPLICATION_CREDENTIALS": "/var/secrets/gcp.json", "STORAGE_EMULATOR_HOST": "h:1"}
    ).gcs
    assert g.credentials_file == "/var/secrets/gcp.json" and g.emulator_host == "http://h:1"
    sa = {"type": "service_account", "private_key": "PEMSECRET", "client_email": "x@y"}
    spec = {"type": "gs", "base64_service_account": base64.b64encode(json.dumps(sa).encode()).decode()}
    g = Settings.from_env({"STORAGE_CONFIG": json.dumps(spec)}).gcs
    assert g.service_account_info == sa and "PEMSECRET" not in repr(g)
    # Built when GCS is used: only a pull from GCS fails on it.
    broken = Settings.from_env({"STORAGE_CONFIG": json.dumps({"type": "gs", "base64_service_account": "!!notb64"})})
    with pytest.raises(ModelcacheError, match="base64_service_account"):
        broken.gcs  # noqa: B018 - the property builds the settings


def test_azure_legacy_names_and_credential_choice() -> None:
    from azure.identity import ClientSecretCredential, ManagedIdentityCredential

    from modelcache.sources.azure import make_credential

    a = Settings.from_env({"AZ_CLIENT_ID": "cid", "AZ_CLIENT_SECRET": "CSECRET", "AZ_TENANT_ID": "tid"}).azure
    assert (a.client_id, a.client_secret, a.tenant_id) == ("cid", "CSECRET", "tid") and a.use_default_credential
    assert "CSECRET" not in repr(a)
    assert isinstance(make_credential(a, "acct"), ClientSecretCredential)
    # AZURE_* wins over the legacy name; client id alone: managed identity
    a = Settings.from_env({"AZURE_CLIENT_ID": "new", "AZ_CLIENT_ID": "old"}).azure
    assert a.client_id == "new" and isinstance(make_credential(a, "acct"), ManagedIdentityCredential)
    # identity wins over the key (KServe's order), key over anonymous
    a = Settings.from_env({"AZURE_STORAGE_ACCESS_KEY": "KEY"}).azure
    assert make_credential(a, "acct") == {"account_name": "acct", "account_key": "KEY"}
    assert make_credential(Settings.from_env({}).azure, "acct") is None
    spec = {"type": "azure", "client_id": "c2", "client_secret": "S2", "tenant_id": "t2"}
    a = Settings.from_env({"AZURE_STORAGE_ACCESS_KEY": "KEY", "STORAGE_CONFIG": json.dumps(spec)}).azure
    assert isinstance(make_credential(a, "acct"), ClientSecretCredential)


def test_merged_ca_bundle_is_one_file_per_content_across_processes(tmp_path) -> None:  # type: ignore[no-untyped-def]
    """Each process that trusts a custom CA merges it with the system bundle into a file: one
    file per distinct content, reused by every later process, not a new temp file per start."""
    import os
    import subprocess
    import sys
    from pathlib import Path

    custom = tmp_path / "cabundle.crt"
    custom.write_text("-----BEGIN CERTIFICATE-----\nQUJD\n-----END CERTIFICATE-----\n")
    tmp = tmp_path / "tmp"
    tmp.mkdir()

    def merged() -> Path:
        code = ("import sys; from modelcache.sources.cabundle import merged_ca_bundle; "
                "print(merged_ca_bundle(sys.argv[1]))")
        out = subprocess.run([sys.executable, "-c", code, str(custom)], env={**os.environ, "TMPDIR": str(tmp)},
                             capture_output=True, text=True, check=True)
        return Path(out.stdout.strip())

    first = {merged() for _ in range(3)}
    assert len(first) == 1
    path = first.pop()
    assert [p for p in tmp.rglob("*") if p.is_file()] == [path]
    assert path.read_text().endswith(custom.read_text()) and oct(path.parent.stat().st_mode & 0o777) == "0o700"
    custom.write_text("-----BEGIN CERTIFICATE-----\nREVG\n-----END CERTIFICATE-----\n")  # a rotated CA
    other = merged()
    assert other != path and sorted(p for p in tmp.rglob("*") if p.is_file()) == sorted([path, other])


def test_each_backends_settings_are_built_on_first_use_by_its_registry_line(tmp_path, monkeypatch) -> None:
    """Settings.from_env builds no backend's settings: each is built once, when a source of its
    kind asks, by the factory its line in modelcache.sources.backends names. An HDFS storage spec writes its
    secret folder only when HDFS is used, and a broken HDFS secret dir fails HDFS alone."""
    import tempfile

    from modelcache.sources import backends, credentials

    monkeypatch.setattr(tempfile, "tempdir", str(tmp_path))
    secret_dir = tmp_path / "hdfscreds"
    secret_dir.mkdir()
    (secret_dir / "N_THREADS").write_text("many")
    spec = {"type": "hdfs", "HDFS_NAMENODE": "https://nn:9871", "TLS_CA": base64.b64encode(b"PEM").decode()}
    env = {"AWS_ACCESS_KEY_ID": "AKID", "HDFS_SECRET_DIR": str(secret_dir), "STORAGE_CONFIG": json.dumps(spec)}
    s = Settings.from_env(env)
    assert s.s3.access_key_id == "AKID" and s.local.pvc_root == credentials.DEFAULT_PVC_ROOT
    assert sorted(s._built) == ["local", "s3"]
    assert list(tmp_path.glob("modelcache-hdfs-spec-*")) == []  # no HDFS folder for an S3 pull
    assert s.for_kind("s3") is s.s3  # built once
    hdfs = s.hdfs  # the spec's folder wins over HDFS_SECRET_DIR, as in KServe
    (folder,) = tmp_path.glob("modelcache-hdfs-spec-*")
    assert hdfs.secret_dir == str(folder) and hdfs.namenode == "https://nn:9871"
    assert (folder / "TLS_CA").read_bytes() == b"PEM"
    # Without the spec, the secret dir's bad N_THREADS fails HDFS, and only HDFS.
    plain = Settings.from_env({"AWS_ACCESS_KEY_ID": "AKID", "HDFS_SECRET_DIR": str(secret_dir)})
    assert plain.s3.access_key_id == "AKID" and plain.gcs.credentials_file is None and plain.hf.token is None
    with pytest.raises(ModelcacheError, match="N_THREADS' is not an integer"):
        plain.hdfs  # noqa: B018 - the property builds the settings
    # Every line that reads settings of its own names a factory that exists; HTTP reads the shared ones.
    for kind, line in backends.BACKENDS.items():
        assert not line.settings or callable(backends.load(line.settings)), kind
    assert {k for k, line in backends.BACKENDS.items() if not line.settings} == {"http", "modelscope"}
    with pytest.raises(ModelcacheError, match="http backend has no settings of its own"):
        plain.for_kind("http")


def test_an_s3_pull_builds_no_hdfs_settings(moto_s3, tmp_path, monkeypatch) -> None:
    """A real S3 pull in an environment that also holds an HDFS storage spec and a broken HDFS
    secret dir: it succeeds, writes no HDFS spec folder and builds only S3's settings (before,
    every pull built every backend's: this one failed on N_THREADS and left a temp folder)."""
    import tempfile

    from modelcache.pull import pull

    monkeypatch.setattr(tempfile, "tempdir", str(tmp_path / "tmp"))
    (tmp_path / "tmp").mkdir()
    bucket = moto_s3.new_bucket()
    moto_s3.client().put_object(Bucket=bucket, Key="llm/w.bin", Body=b"w" * 1000)
    secret_dir = tmp_path / "hdfscreds"
    secret_dir.mkdir()
    (secret_dir / "N_THREADS").write_text("many")
    spec = {"type": "hdfs", "HDFS_NAMENODE": "https://nn:9871", "HDFS_ROOTPATH": "/models"}
    settings = Settings.from_env({**moto_s3.env(), "HDFS_SECRET_DIR": str(secret_dir),
                                  "STORAGE_CONFIG": json.dumps(spec)})
    result = pull(f"s3://{bucket}/llm", root=tmp_path / "root", settings=settings)
    assert result.files == 1 and result.bytes == 1000
    assert sorted(settings._built) == ["s3"]
    assert list((tmp_path / "tmp").glob("modelcache-hdfs-spec-*")) == []


def test_the_hdfs_spec_folder_with_its_keytab_goes_when_the_process_ends(tmp_path) -> None:
    """A storage spec's files (a keytab among them) are written to a 0700 folder for the HDFS
    client; it lives as long as the process, not longer."""
    import subprocess
    import sys

    spec = {"type": "hdfs", "HDFS_NAMENODE": "https://nn:9871", "KERBEROS_KEYTAB": base64.b64encode(b"KT").decode()}
    code = ("import json, os, sys; from modelcache.sources.credentials import hdfs_spec_dir; "
            "d = hdfs_spec_dir({'STORAGE_CONFIG': sys.argv[1]}); "
            "print(d, open(os.path.join(d, 'KERBEROS_KEYTAB')).read())")
    (tmp_path / "tmp").mkdir()
    out = subprocess.run([sys.executable, "-c", code, json.dumps(spec)], capture_output=True, text=True, check=True,
                         env={**os.environ, "TMPDIR": str(tmp_path / "tmp")})
    folder, keytab = out.stdout.split()
    assert folder.startswith(str(tmp_path / "tmp" / "modelcache-hdfs-spec-")) and keytab == "KT"
    assert list((tmp_path / "tmp").iterdir()) == []
